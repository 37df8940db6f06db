"""Structured output (generation.constraints): sampled replies follow a JSON schema or a regular expression, even
from a random model, and constrained jobs batch with free ones without changing them."""
import json
import re

import pytest

from exl2.config import EngineConfig, SamplingSettings
from exl2.engine import Engine
from exl2.errors import ConfigError
from exl2.generation.chat import ChatTemplate, parse_tool_calls, tool_call_format
from exl2.generation.constraints import json_grammar, regex_grammar, tool_call_grammar
from exl2.generation.dynamic import DynamicGenerator, Job

from test_dynamic import GREEDY, MODEL, PROMPTS, greedy_reference

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model_dir=MODEL, max_seq_len=512, device="cpu"))


def check_schema(value):
    assert set(value) == {"name", "age", "tags"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and value["age"] >= 0
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_json_follows_the_schema(engine, seed):
    r = engine.generate("Person:", SamplingSettings(temperature=1.0, seed=seed), 200,
                        grammar=engine.json_grammar(SCHEMA))
    assert r.finish_reason == "stop"
    check_schema(json.loads(r.text))


def test_regex_and_any_json_object(engine):
    r = engine.generate("Code:", SamplingSettings(temperature=1.0, seed=5), 40,
                        grammar=engine.regex_grammar(r"[0-9]{3}-[a-z]{2,4}"))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", r.text) and r.finish_reason == "stop"
    r = engine.generate("Data:", SamplingSettings(temperature=1.0, seed=5), 300, grammar=engine.json_grammar())
    if r.finish_reason == "stop":
        assert isinstance(json.loads(r.text), dict)
    else:  # ran out of tokens inside the object: still a valid prefix of one
        assert r.text.startswith("{")


def test_constrained_and_free_jobs_share_a_batch(engine):
    tok = engine.tokenizer
    gen = DynamicGenerator(engine.model, tok, 512, max_batch=4, page_size=16)
    free = [Job(tok.encode(p), GREEDY, 12) for p in PROMPTS[:2]]
    bound = Job(tok.encode("JSON:"), SamplingSettings(temperature=0.9, seed=4), 200, grammar=json_grammar(tok, SCHEMA))
    results = gen.generate([free[0], bound, free[1]])
    check_schema(json.loads(results[1].text))
    assert [results[0].token_ids, results[2].token_ids] == [greedy_reference(engine.model, j.ids, 12) for j in free]


def test_bad_formats_are_user_errors(engine):
    with pytest.raises(ConfigError):
        regex_grammar(engine.tokenizer, "([a-z")
    with pytest.raises(ConfigError):
        json_grammar(engine.tokenizer, {"type": "object", "properties": {"x": {"type": "no-such-type"}}})


# ---- forced tool calls -------------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["a", "b"],
             "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                            "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
         {"type": "function", "function": {"name": "now"}}]
WRITTEN = {"hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
           "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "now", "arguments": {}}]',
           "llama": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
           "qwen3_xml": "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
                        "</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>",
           "glm": "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b</arg_key>\n"
                  "<arg_value>2</arg_value>\n</tool_call>\n<tool_call>now\n</tool_call>",
           "minimax": '<minimax:tool_call>\n<invoke name="add">\n<parameter name="a">1</parameter>\n'
                      '<parameter name="b">2</parameter>\n</invoke>\n<invoke name="now">\n</invoke>\n'
                      "</minimax:tool_call>"}
# How each written reply is taken out of its schema (b = 200 > 99).
OUT_OF_SCHEMA = {"qwen3_xml": ("2\n</parameter>", "200\n</parameter>"), "glm": ("2</arg_value>", "200</arg_value>"),
                 "minimax": ("2</parameter>", "200</parameter>")}


def _accepts(grammar, tok, text: str) -> bool:
    ids = [i for i in tok.encode(text) if i != tok.bos_id]
    return all(grammar.advance(i) is None and not grammar.matcher.is_error() for i in ids) and \
        grammar.matcher.is_accepting()


@pytest.mark.parametrize("fmt", sorted(WRITTEN))
def test_tool_call_grammar_accepts_calls_in_the_models_format(engine, fmt):
    tok = engine.tokenizer
    text = WRITTEN[fmt]
    assert parse_tool_calls(text)[0] == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert _accepts(tool_call_grammar(tok, TOOLS, fmt), tok, text)
    assert not _accepts(tool_call_grammar(tok, TOOLS, fmt, name="now"), tok, text)      # only 'now' may be called
    old, new = OUT_OF_SCHEMA.get(fmt, ("2}", "200}"))
    assert old in text
    assert not _accepts(tool_call_grammar(tok, TOOLS, fmt), tok, text.replace(old, new))  # out of its schema
    assert not _accepts(tool_call_grammar(tok, TOOLS, fmt), tok, "Sure! " + text)           # nothing but calls
    with pytest.raises(ConfigError):
        tool_call_grammar(tok, TOOLS, fmt, name="missing")


def test_tool_call_format_follows_the_template():
    assert tool_call_format(ChatTemplate(None)) == "hermes"   # the ChatML fallback announces Hermes-style calls
    assert tool_call_format(ChatTemplate("{{ '[TOOL_CALLS]' }}")) == "mistral"
    assert tool_call_format(ChatTemplate("{{ '<|python_tag|>' }}{{ messages }}")) == "llama"


NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "required": ["text"], "$defs": {"tag": {"type": "string", "maxLength": 3}},
    "properties": {"text": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                   "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}}}}}}


@pytest.mark.parametrize("text, ok", [
    # free text (even code with '<' and a partial closing tag), a string enum as text, JSON following the schema
    ('<tool_call>\n<function=note>\n<parameter=text>\nif a < b:\n    x = "</param"\n</parameter>\n'
     '<parameter=unit>\nc\n</parameter>\n<parameter=tags>\n["ab", "c"]\n</parameter>\n</function>\n</tool_call>', True),
    ("<tool_call>\n<function=note>\n<parameter=text>\n\n</parameter>\n</function>\n</tool_call>", True),
    ("<tool_call>\n<function=note>\n</function>\n</tool_call>", False),                       # 'text' is required
    ("<tool_call>\n<function=note>\n<parameter=text>\nx</parameter>y\n</parameter>\n</function>\n</tool_call>",
     False),                                                                                     # value ends at the tag
    ("<tool_call>\n<function=note>\n<parameter=text>\nx\n</parameter>\n<parameter=unit>\nk\n</parameter>\n"
     "</function>\n</tool_call>", False),                                                        # not in the enum
    ('<tool_call>\n<function=note>\n<parameter=text>\nx\n</parameter>\n<parameter=tags>\n["abcd"]\n</parameter>\n'
     "</function>\n</tool_call>", False),                                                        # $ref'd maxLength
])
def test_qwen3_xml_grammar_values(engine, text, ok):
    tok = engine.tokenizer
    assert _accepts(tool_call_grammar(tok, TOOLS + [NOTE], "qwen3_xml"), tok, text) is ok
    if ok:  # what the grammar lets through reads back as the tool's arguments
        args = parse_tool_calls(text, TOOLS + [NOTE])[0]["arguments"]
        assert isinstance(args["text"], str) and args.get("unit", "c") == "c" and args.get("tags", ["ab", "c"]) == \
            ["ab", "c"]


@pytest.mark.parametrize("fmt", ["deepseek", "pythonic", "harmony"])
def test_forcing_a_call_in_formats_without_a_grammar_is_refused(engine, fmt):
    with pytest.raises(ConfigError, match=rf"^Forcing a tool call is not supported for this model's tool-call "
                                          rf"format \({fmt}\); use tool_choice 'auto'\.$"):
        tool_call_grammar(engine.tokenizer, TOOLS, fmt)


@pytest.mark.parametrize("fmt, seed", [("qwen3_xml", 1), ("qwen3_xml", 2), ("glm", 1), ("minimax", 1)])
def test_a_random_model_forced_into_xml_calls_calls(engine, fmt, seed):
    tools = TOOLS + [{"type": "function", "function": {"name": "unit", "parameters": {
        "type": "object", "required": ["u"], "properties": {"u": {"enum": ["c", "f"]}}}}}]
    for name in (None, "add", "unit"):
        r = engine.generate("Call:", SamplingSettings(temperature=1.0, seed=seed), 200,
                            grammar=tool_call_grammar(engine.tokenizer, tools, fmt, name))
        calls = parse_tool_calls(r.text, tools)
        assert r.finish_reason == "stop" and calls, r.text
        for call in calls:
            assert name is None or call["name"] == name
            if call["name"] == "add":
                assert set(call["arguments"]) == {"a", "b"} and all(0 <= v <= 99 for v in call["arguments"].values())
            if call["name"] == "unit":
                assert call["arguments"] in ({"u": "c"}, {"u": "f"})


@pytest.mark.parametrize("seed", [1, 2])
def test_a_random_model_forced_to_call_a_tool_calls_it(engine, seed):
    """tool_choice 'required' / a named function on a model that writes gibberish: the reply is still calls of
    the allowed tools with arguments in their schemas."""
    prompt = engine.chat_prompt([{"role": "user", "content": "What is 1+2?"}], TOOLS)
    for name in (None, "add"):
        r = engine.generate(prompt, SamplingSettings(temperature=1.0, seed=seed), 160,
                            grammar=engine.tool_grammar(TOOLS, name))
        calls = parse_tool_calls(r.text)
        assert r.finish_reason == "stop" and calls, r.text
        for call in calls:
            assert call["name"] in ({"add", "now"} if name is None else {name})
            if call["name"] == "add":
                assert set(call["arguments"]) == {"a", "b"} and all(0 <= v <= 99 for v in call["arguments"].values())
