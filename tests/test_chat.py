"""Chat templates rendered like transformers' apply_chat_template; the sandbox; tool-call parsing."""
from __future__ import annotations

import json

import pytest

from exl2.errors import ConfigError
from exl2.generation.chat import (CALL_MARKERS, CHATML_TEMPLATE, DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN,
                                  DS_CALLS_END, DS_SEP, ChatTemplate, parse_tool_calls, tool_call_format)
from exl2.server.tools import MARKERS, ToolCallHoldback, content_before_calls

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2.5-style: tools through tojson, tool calls and tool responses, whitespace control.
QWEN_LIKE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "system" %}{% continue %}{% endif %}
    {%- if message.role == "assistant" and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- for tool_call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
            {{- tool_call.function.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama-3.1-style: bos_token, tojson(indent=4), raise_exception, {% generation %}, a custom variable.
LLAMA_LIKE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] | trim }}{% endgeneration %}
    {%- else %}{{- message['content'] | trim }}{%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
{{- eos_token if false }}
"""

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle — current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What's the weather in Zürich?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": '{"temp_c": 21}'},
    {"role": "assistant", "content": "  It is 21 °C.  "},
    {"role": "user", "content": "Thanks 🙏"},
]


@pytest.fixture(scope="module")
def hf_tok():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("template", [SMOLLM2, QWEN_LIKE, LLAMA_LIKE, CHATML_TEMPLATE], ids=["smollm2", "qwen", "llama", "chatml"])
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("gen_prompt", [False, True])
def test_render_matches_transformers(hf_tok, template, with_tools, gen_prompt):
    msgs = MESSAGES if template in (QWEN_LIKE, LLAMA_LIKE) else [m for m in MESSAGES if "tool_calls" not in m
                                                                  and m["role"] != "tool"]
    tools = TOOLS if with_tools else None
    ours = ChatTemplate(template, bos_token="<s>", eos_token="</s>").render(msgs, tools=tools,
                                                                           add_generation_prompt=gen_prompt)
    ref = hf_tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen_prompt,
                                     chat_template=template)
    assert ours == ref
    assert ("Zürich" in ours) and ("\\u00fc" not in ours)  # tojson keeps non-ASCII as HF does


def test_extra_variables_pass_through(hf_tok):
    ours = ChatTemplate(LLAMA_LIKE, bos_token="<s>").render(MESSAGES[:2], date_string="1 Jan 2030")
    ref = hf_tok.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True,
                                     chat_template=LLAMA_LIKE, date_string="1 Jan 2030")
    assert ours == ref and "1 Jan 2030" in ours


def test_fallback_is_chatml():
    t = ChatTemplate(None)
    assert t.is_fallback
    out = t.render([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with_tools = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], tools=TOOLS)
    assert with_tools.count("<|im_start|>system") == 1 and "Be brief." in with_tools and '"get_weather"' in with_tools


def test_strftime_now():
    import datetime

    out = ChatTemplate("{{ strftime_now('%Y') }}").render([])
    assert out == str(datetime.datetime.now().year)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set _ = messages.append({'role': 'x'}) %}",
    "{% for m in messages %}{% set _ = m.update({'content': 'x'}) %}{% endfor %}",
])
def test_sandbox_blocks_unsafe_access(template):
    with pytest.raises(ConfigError, match="unsafe"):
        ChatTemplate(template).render([{"role": "user", "content": "hi"}])


def test_template_errors_are_config_errors():
    with pytest.raises(ConfigError, match="syntax error"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ConfigError, match="Unknown role: narrator"):
        ChatTemplate(LLAMA_LIKE).render([{"role": "narrator", "content": "x"}])


def test_parse_hermes_tool_calls():
    text = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>')
    assert parse_tool_calls(text) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_time", "arguments": {"tz": "CET"}},
    ]
    # An unterminated final call (generation stopped at </tool_call>) still counts.
    assert parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}') == [{"name": "f", "arguments": {}}]
    assert parse_tool_calls("<tool_call>not json</tool_call>") == []


def test_parse_llama31_tool_calls():
    assert parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Oslo"}}') == [
        {"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert parse_tool_calls('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
                            "<|eom_id|>") == [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]
    # Ordinary JSON answers and prose are not tool calls.
    assert parse_tool_calls('{"name": "Alice", "age": 30}') == []
    assert parse_tool_calls('Here: {"name": "f", "parameters": {}}') == []
    assert parse_tool_calls("Paris is the capital of France.") == []


def test_parse_mistral_tool_calls():
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "noop", "arguments": {}}]</s>'
    assert parse_tool_calls(text) == [{"name": "get_weather", "arguments": {"city": "Rome"}},
                                      {"name": "noop", "arguments": {}}]
    assert parse_tool_calls('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}') == [
        {"name": "get_weather", "arguments": {"city": "Rome"}}]
    assert parse_tool_calls("[TOOL_CALLS] nonsense") == []


# ---- DeepSeek, Qwen3-Coder XML and pythonic calls; format detection; streaming holdback -------------------------

B, E = DS_CALLS_BEGIN, DS_CALLS_END
CB, CE, SEP = DS_CALL_BEGIN, DS_CALL_END, DS_SEP
NESTED = {"city": "Paris", "opts": {"units": ["c", "f"], "depth": {"n": 1, "ok": True, "none": None}}}


def test_deepseek_tokens_are_the_templates_own():
    # fullwidth vertical bar U+FF5C and lower one-eighth block U+2581, not '|' and '_'
    assert B == "<\uff5ctool\u2581calls\u2581begin\uff5c>" and E == "<\uff5ctool\u2581calls\u2581end\uff5c>"
    assert CB == "<\uff5ctool\u2581call\u2581begin\uff5c>" and CE == "<\uff5ctool\u2581call\u2581end\uff5c>"
    assert SEP == "<\uff5ctool\u2581sep\uff5c>"


def test_parse_deepseek_v3_tool_calls():
    one = f'{B}{CB}function{SEP}get_weather\n```json\n{json.dumps(NESTED)}\n```{CE}{E}'
    assert parse_tool_calls(one) == [{"name": "get_weather", "arguments": NESTED}]
    two = (f'Let me look that up.{B}{CB}function{SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{CE}\n'
           f'{CB}function{SEP}ping\n```json\n{{}}\n```{CE}{E}<｜end▁of▁sentence｜>')
    assert parse_tool_calls(two) == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                     {"name": "ping", "arguments": {}}]
    assert content_before_calls(two) == "Let me look that up."
    # generation stopped before the end tokens: the complete call still counts
    assert parse_tool_calls(f'{B}{CB}function{SEP}f\n```json\n{{"x": 1}}\n```') == [
        {"name": "f", "arguments": {"x": 1}}]


def test_parse_deepseek_v31_tool_calls():
    one = f'{B}{CB}get_weather{SEP}{json.dumps(NESTED)}{CE}{E}'
    assert parse_tool_calls(one) == [{"name": "get_weather", "arguments": NESTED}]
    two = f'Checking both.\n\n{B}{CB}get_weather{SEP}{{"city": "Oslo"}}{CE}{CB}ping{SEP}{{}}{CE}{E}'
    assert parse_tool_calls(two) == [{"name": "get_weather", "arguments": {"city": "Oslo"}},
                                     {"name": "ping", "arguments": {}}]
    assert content_before_calls(two) == "Checking both."
    # a tool that is itself named 'function' is not mistaken for the V3 form
    assert parse_tool_calls(f'{B}{CB}function{SEP}{{"a": 1}}{CE}{E}') == [{"name": "function", "arguments": {"a": 1}}]


@pytest.mark.parametrize("text", [
    f'{B}{CB}function{SEP}get_weather\n```json\n{{"city": \n```{CE}{E}',      # broken JSON
    f'{B}{CB}get_weather{SEP}not json at all{CE}{E}',
    f'{B}{CB}get_weather{SEP}["a", "list"]{CE}{E}',                          # arguments must be an object
    f'{B}{CB}{SEP}{{"a": 1}}{CE}{E}',                                        # no name
    f'{B}{CB}function{SEP}\n```json\n{{}}\n```{CE}{E}',
    f'{B}{CB}get weather{SEP}{{}}{CE}{E}',                                   # not a name
    f'{B}{CB}get_weather{CE}{E}',                                            # no separator
    f'{B}{E}',
], ids=lambda t: "")
def test_malformed_deepseek_calls_are_no_calls(text):
    assert parse_tool_calls(text) == []


def test_a_malformed_deepseek_call_does_not_hide_a_good_one():
    text = f'{B}{CB}bad{SEP}{{oops{CE}{CB}good{SEP}{{"x": [1, {{"y": 2}}]}}{CE}{E}'
    assert parse_tool_calls(text) == [{"name": "good", "arguments": {"x": [1, {"y": 2}]}}]


QWEN3_XML = ("I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n<parameter=opts>\n" + json.dumps(NESTED["opts"]) + "\n</parameter>\n"
             "<parameter=code>\nif a < b:\n    print('<b>')\n</parameter>\n</function>\n</tool_call>\n"
             "<tool_call>\n<function=ping>\n</function>\n</tool_call>")


def test_parse_qwen3_xml_tool_calls():
    assert parse_tool_calls(QWEN3_XML) == [
        {"name": "get_weather", "arguments": {"city": "New York", "days": 3, "opts": NESTED["opts"],
                                              "code": "if a < b:\n    print('<b>')"}},
        {"name": "ping", "arguments": {}}]
    assert content_before_calls(QWEN3_XML) == "I'll check."
    # written compactly, without the newlines around values
    assert parse_tool_calls("<tool_call><function=f><parameter=a>1</parameter><parameter=b>x y</parameter>"
                            "</function></tool_call>") == [{"name": "f", "arguments": {"a": 1, "b": "x y"}}]
    # several functions in one block, a missing </parameter>, a generation stopped after </function>
    assert parse_tool_calls("<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\n2\n</parameter>\n</function>\n"
                            "<function=g>\n</function>") == [{"name": "f", "arguments": {"a": 1, "b": 2}},
                                                             {"name": "g", "arguments": {}}]
    # Qwen3-Coder sometimes leaves out the <tool_call> wrapper
    assert parse_tool_calls("Sure.\n<function=f>\n<parameter=a>\nhi\n</parameter>\n</function>") == [
        {"name": "f", "arguments": {"a": "hi"}}]
    assert content_before_calls("Sure.\n<function=f>\n</function>") == "Sure."


def test_qwen3_xml_values():
    def value(text, tools=None):
        return parse_tool_calls(f"<tool_call>\n<function=f>\n<parameter=v>\n{text}\n</parameter>\n</function>\n"
                                "</tool_call>", tools)[0]["arguments"]["v"]

    # JSON when it is a number, boolean, object or array; text otherwise
    assert [value(t) for t in ("42", "-1.5", "true", "false", '{"a": [1]}', "[1, 2]")] == \
        [42, -1.5, True, False, {"a": [1]}, [1, 2]]
    assert [value(t) for t in ("Paris", "01234", "null", '"quoted"', "NaN", "Infinity", "", "  padded  ", "1 2")] == \
        ["Paris", "01234", "null", '"quoted"', "NaN", "Infinity", "", "  padded  ", "1 2"]
    assert value("line one\n\nline three") == "line one\n\nline three"
    # with the tools, the schema decides: string parameters stay text
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": {"type": "string"}}}}}]
    assert value("12345", tools) == "12345" and value("true", tools) == "true"
    tools[0]["function"]["parameters"]["properties"]["v"] = {"type": ["integer", "null"]}
    assert value("7", tools) == 7 and value("null", tools) is None
    # the templates render history values with Jinja's `string`, so a model may write Python's words back
    tools[0]["function"]["parameters"]["properties"]["v"] = {"type": "boolean"}
    assert value("True", tools) is True and value("false", tools) is False and value("True") == "True"


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=>\n</function>\n</tool_call>",                                  # no name
    "<tool_call>\n<function=f>\nstray text <parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=f>\n<parameter=>\n1\n</parameter>\n</function>\n</tool_call>",  # no parameter name
    "<tool_call>\n<function=f>\nnot json\n</function>\n</tool_call>",
    "<tool_call>\n<function=f g>\n</function>\n</tool_call>",
    "<tool_call>\n</tool_call>",
])
def test_malformed_qwen3_xml_calls_are_no_calls(text):
    assert parse_tool_calls(text) == []


def test_parse_glm_tool_calls():
    text = ("Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>code</arg_key>\n<arg_value>if a < b:\n"
            "    f('<b>')</arg_value>\n</tool_call>\n<tool_call>ping\n</tool_call>")
    assert parse_tool_calls(text) == [
        {"name": "get_weather", "arguments": {"city": "New York", "days": 3, "code": "if a < b:\n    f('<b>')"}},
        {"name": "ping", "arguments": {}}]
    assert content_before_calls(text) == "Let me look."
    # the schema decides: a string parameter stays text; a generation stopped inside a value keeps what it has
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": {"type": "string"}, "n": {"type": "integer"}}}}}]
    assert parse_tool_calls("<tool_call>f<arg_key>v</arg_key><arg_value>123</arg_value><arg_key>n</arg_key>"
                            "<arg_value>7", tools) == [{"name": "f", "arguments": {"v": "123", "n": 7}}]
    for bad in ("<tool_call>f\nstray<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
                "<tool_call>f<arg_key></arg_key><arg_value>1</arg_value></tool_call>",
                "<tool_call>f g</tool_call>", "<tool_call>{broken</tool_call>"):
        assert parse_tool_calls(bad) == [], bad


def test_parse_minimax_tool_calls():
    text = ('Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">New York</parameter>\n'
            '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="ping">\n</invoke>\n</minimax:tool_call>')
    assert parse_tool_calls(text) == [{"name": "get_weather", "arguments": {"city": "New York", "days": 3}},
                                      {"name": "ping", "arguments": {}}]
    assert content_before_calls(text) == "Checking."
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": {"type": "string"}}}}}]
    assert parse_tool_calls('<minimax:tool_call><invoke name="f"><parameter name="v">12</parameter></invoke>',
                            tools) == [{"name": "f", "arguments": {"v": "12"}}]
    for bad in ('<minimax:tool_call><invoke name="">\n</invoke></minimax:tool_call>',
                '<minimax:tool_call><invoke name="f">stray<parameter name="a">1</parameter></invoke>'):
        assert parse_tool_calls(bad) == [], bad


def test_parse_pythonic_tool_calls():
    assert parse_tool_calls('[get_weather(city="Paris", days=3), ping()]') == [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "ping", "arguments": {}}]
    assert parse_tool_calls(f"[get_weather(city='Paris', opts={NESTED['opts']!r}, pair=(1, 2), neg=-0.5)]") == [
        {"name": "get_weather", "arguments": {"city": "Paris", "opts": NESTED["opts"], "pair": [1, 2], "neg": -0.5}}]
    # JSON's true/false/null, which models write too
    assert parse_tool_calls("[f(a=true, b=false, c=null, d=[true])]") == [
        {"name": "f", "arguments": {"a": True, "b": False, "c": None, "d": [True]}}]
    # Llama 4 wraps code in <|python_start|>...<|python_end|>, possibly after some prose
    text = 'Let me check.\n<|python_start|>[get_weather(city="Rome")]<|python_end|><|eot|>'
    assert parse_tool_calls(text) == [{"name": "get_weather", "arguments": {"city": "Rome"}}]
    assert content_before_calls(text) == "Let me check."
    assert parse_tool_calls('<|python_start|>{"name": "f", "parameters": {"x": 1}}<|python_end|>') == [
        {"name": "f", "arguments": {"x": 1}}]
    # with the tools known, every name must be one of them
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    assert parse_tool_calls('[get_weather(city="Paris")]', tools) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert parse_tool_calls('[print(end="")]', tools) == []


@pytest.mark.parametrize("text", [
    "[f(x)]", "[f(**kw)]", "[f(x=y)]", "[f(x=a + b)]", "[f(x=g())]", "[f(x={1, 2})]", "[f(x=1e999)]", "[f(x=b'raw')]",
    "[f(x=1j)]", "[f(x={1: 2})]", "[mod.f(x=1)]", "[f(x=1)] and then some", "[f(x=1), 2]", "[]", "[f(x=1",
    "```python\n[f(x=1)]\n```",
])
def test_pythonic_lists_that_are_not_plain_calls(text):
    assert parse_tool_calls(text) == []


@pytest.mark.parametrize("text", [
    "[1] Smith, J. (2020). A paper.\n[2] Doe, A. (2021). Another.",
    "[Click here](https://example.com) to read more.",
    "[x] Done\n[ ] To do",
    "- [ ] a markdown task list",
    "[1, 2, 3]",
    '["apples", "pears"]',
    "[x * 2 for x in range(3)]",
    "[len(s)]",
    "[Note]: see below",
    '{"name": "Alice", "age": 30, "tags": ["a"]}',
    '[{"name": "Alice"}, {"name": "Bob"}]',
    '```json\n{"items": [1, 2]}\n```',
    "The function <function> and the tag <tool> are HTML-ish but no calls.",
    "DeepSeek writes <｜tool▁sep｜> between a call's name and arguments.",
    "",
])
def test_ordinary_answers_are_not_calls(text):
    assert parse_tool_calls(text) == []


FORMAT_TEMPLATES = [
    ("{{ '<tool_call>\\n<function=' + name + '>\\n<parameter=' }}<tool_call>", "qwen3_xml"),
    ("{{ '\\n<tool_call>' + tc.name }}<arg_key>{{ k }}</arg_key>", "glm"),
    ("{{ '<minimax:tool_call>\\n' }}<invoke name=\"{{ tc.name }}\">", "minimax"),
    ("{{ '<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' }}", "deepseek"),
    ("{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' }}", "deepseek"),
    ("{{ '<tool_call>\\n' }}", "hermes"),
    ("{{ '[TOOL_CALLS]' }}", "mistral"),
    ("{{- 'you MUST put it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...), "
     "func_name2(params)]' }}{{ '<|start_header_id|>ipython<|end_header_id|>' }}", "pythonic"),
    ("{{ '<|python_tag|>' }}", "llama"),
    ("{{ '<|start_header_id|>ipython<|end_header_id|>' }}", "llama"),
    ("{{ messages }}", "hermes"),
]


@pytest.mark.parametrize("source, fmt", FORMAT_TEMPLATES, ids=[fmt for _, fmt in FORMAT_TEMPLATES])
def test_tool_call_format_detection(source, fmt):
    assert tool_call_format(ChatTemplate(source)) == fmt


def _stream(pieces):
    hb, sent = ToolCallHoldback(), ""
    for piece in pieces:
        sent += hb.push(piece)
    return hb, sent


STREAMED = [
    ("Looking it up. ", f'{B}{CB}get_weather{SEP}{{"city": "Paris"}}{CE}{E}'),
    ("One moment.\n", f'{CB}function{SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{CE}'),
    ("Let me see.\n", '<|python_start|>[get_weather(city="Paris")]<|python_end|>'),
    ("I'll check.\n", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                      "</tool_call>"),
    ("Sure.\n", "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>"),
    ("", '[get_weather(city="Paris")]'),
]


@pytest.mark.parametrize("prose, call", STREAMED,
                         ids=["deepseek_v31", "deepseek_v3", "python_start", "qwen3_xml", "qwen3_xml_bare", "pythonic"])
def test_holdback_keeps_new_markers_cut_anywhere(prose, call):
    text = prose + call
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    splits += [[text[:i], text[i:j], text[j:]] for i in range(len(prose), len(text)) for j in range(i, i + 3)]
    for pieces in splits:
        hb, sent = _stream(pieces)
        assert sent == prose, pieces              # the prose comes through, nothing of the call does
        assert hb.text == text and sent + hb.rest() == text
        assert parse_tool_calls(hb.text) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert content_before_calls(text) == (prose.strip() or None)


@pytest.mark.parametrize("text", [
    "Bars like <｜ and blocks like ▁ are fine.",
    "A list: <|python is a language|> and <function call> in prose.",
    "Almost a marker at the very end <｜tool▁call",
])
def test_holdback_releases_what_was_no_marker(text):
    for i in range(len(text) + 1):
        hb, sent = _stream([text[:i], text[i:]])
        assert sent + hb.rest() == text and parse_tool_calls(hb.text) == []
        assert text.startswith(sent)
    hb, sent = _stream(list(text))
    assert sent + hb.rest() == text


def test_holdback_markers_cover_every_format():
    assert set(CALL_MARKERS) <= set(MARKERS)
    for marker in (B, CB, "<|python_start|>", "<function=", "<tool_call>", "[TOOL_CALLS]", "<|python_tag|>"):
        assert marker in MARKERS


# How the models' templates write calls in the history (the same shapes the models were trained to produce).
WRITES_CALLS = {
    # after MiniMax-M2's chat_template.jinja
    "minimax": "{%- for m in messages %}{{- '<minimax:tool_call>\\n' }}{%- for tc in m.tool_calls %}"
               "{{- '<invoke name=\"' + tc.function.name + '\">\\n' }}{%- for k, v in tc.function.arguments|items %}"
               "{{- '<parameter name=\"' + k + '\">' }}{{- v if v is string else v | tojson }}{{- '</parameter>\\n' }}"
               "{%- endfor %}{{- '</invoke>\\n' }}{%- endfor %}{{- '</minimax:tool_call>' }}{%- endfor %}",
    # GLM-4.5's chat_template.jinja
    "glm": "{%- for m in messages %}{%- for tc in m.tool_calls %}{%- if tc.function %}{%- set tc = tc.function %}"
           "{%- endif %}{{ '\\n<tool_call>' + tc.name }}\n{% set _args = tc.arguments %}{% for k, v in _args.items() %}"
           "<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}"
           "</arg_value>\n{% endfor %}</tool_call>{% endfor %}{%- endfor %}",
    "qwen3_xml": "{%- for m in messages %}{%- for tc in m.tool_calls %}"
                 "{{- '\\n<tool_call>\\n<function=' + tc.function.name + '>\\n' }}"
                 "{%- for k, v in tc.function.arguments|items %}{{- '<parameter=' + k + '>\\n' }}"
                 "{{- v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}"
                 "{{- '\\n</parameter>\\n' }}{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}"
                 "{%- endfor %}",
    "deepseek_v3": "{%- for m in messages %}{{- '<｜tool▁calls▁begin｜>' }}{%- for tc in m.tool_calls %}"
                   "{{- '\\n' if not loop.first }}{{- '<｜tool▁call▁begin｜>' + tc.type + '<｜tool▁sep｜>' + "
                   "tc.function.name + '\\n```json\\n' + tc.function.arguments|tojson + '\\n```<｜tool▁call▁end｜>' }}"
                   "{%- endfor %}{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}{%- endfor %}",
    "deepseek_v31": "{%- for m in messages %}{{- '<｜tool▁calls▁begin｜>' }}{%- for tc in m.tool_calls %}"
                    "{{- '<｜tool▁call▁begin｜>' + tc.function.name + '<｜tool▁sep｜>' + tc.function.arguments|tojson"
                    " + '<｜tool▁call▁end｜>' }}{%- endfor %}{{- '<｜tool▁calls▁end｜>' }}{%- endfor %}",
}


@pytest.mark.parametrize("fmt", sorted(WRITES_CALLS))
def test_calls_as_the_template_writes_them_read_back(fmt):
    calls = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "flag": True, **NESTED}},
             {"name": "ping", "arguments": {}}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "flag": {"type": "boolean"},
        "opts": {"type": "object"}}}}}, {"type": "function", "function": {"name": "ping"}}]
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]}
    written = ChatTemplate(WRITES_CALLS[fmt]).render([message], add_generation_prompt=False)
    assert parse_tool_calls(written, tools) == calls


@pytest.mark.parametrize("template", [SMOLLM2, QWEN_LIKE, LLAMA_LIKE, CHATML_TEMPLATE],
                         ids=["smollm2", "qwen", "llama", "chatml"])
@pytest.mark.parametrize("final", ["The answer is", "The answer is ", "  Well, "])
def test_continue_final_message_matches_transformers(hf_tok, template, final):
    msgs = [{"role": "user", "content": "Question?"}, {"role": "assistant", "content": final}]
    ours = ChatTemplate(template, bos_token="<s>", eos_token="</s>").render(msgs, add_generation_prompt=False,
                                                                           continue_final_message=True)
    ref = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, chat_template=template,
                                     continue_final_message=True)
    assert ours == ref and ours.rstrip().endswith(final.strip())


def test_continue_final_message_needs_the_text_as_given():
    rewrite = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(ConfigError, match="cannot be continued"):
        ChatTemplate(rewrite).render([{"role": "assistant", "content": "abc"}], add_generation_prompt=False,
                                     continue_final_message=True)
    with pytest.raises(ConfigError, match="cannot be continued"):
        ChatTemplate(None).render([{"role": "assistant", "content": ""}], add_generation_prompt=False,
                                  continue_final_message=True)
