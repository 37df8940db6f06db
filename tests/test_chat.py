"""Chat templates rendered like transformers' apply_chat_template; the sandbox; tool-call parsing."""
from __future__ import annotations

import pytest

from exl2.errors import ConfigError
from exl2.generation.chat import CHATML_TEMPLATE, ChatTemplate, parse_tool_calls

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
