"""Chat templates (Jinja2, rendered like transformers' apply_chat_template) and parsing of tool calls in model output."""
from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any, Optional

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from exl2.errors import ConfigError

# ChatML, for models that ship no template; tools are announced Hermes-style so parse_tool_calls can read the reply.
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "You may call one or more functions. Function signatures are inside <tools></tools>:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "To call a function, reply with a JSON object inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _GenerationTag(Extension):
    """`{% generation %}…{% endgeneration %}` (transformers marks assistant spans with it): renders the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators=None, sort_keys: bool = False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template; `render` turns messages (and tools) into the prompt text the model was trained on."""

    def __init__(self, template: Optional[str] = None, bos_token: Optional[str] = None,
                 eos_token: Optional[str] = None, special_tokens: Optional[dict[str, str]] = None):
        self.source = template if template else CHATML_TEMPLATE
        self.is_fallback = not template
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        if bos_token is not None:
            self.special_tokens["bos_token"] = bos_token
        if eos_token is not None:
            self.special_tokens["eos_token"] = eos_token
        try:
            self._compiled = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"The chat template has a syntax error on line {e.lineno}: {e.message}.") from None

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ChatTemplate":
        """The model's own template (or ChatML when it has none) with its special-token strings."""
        return cls(tokenizer.chat_template, special_tokens=tokenizer.special_tokens_map)

    @property
    def reserved_variables(self) -> frozenset[str]:
        """Names `render` sets itself (its arguments, the special tokens, the template's functions): extra
        variables from a request must not replace them."""
        return frozenset({"self", "messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                          *self.special_tokens, *self._compiled.environment.globals})

    def render(self, messages: list[dict], tools: Optional[list[dict]] = None, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        kwargs = {**self.special_tokens, **extra}
        try:
            return self._compiled.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         **kwargs)
        except jinja2.exceptions.SecurityError as e:
            raise ConfigError(f"The chat template tried an unsafe operation ({e}).") from None
        except jinja2.TemplateError as e:
            raise ConfigError(f"The chat template failed to render: {e}.") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ConfigError(f"The chat template failed to render these messages ({type(e).__name__}: {e}).") from None


# ---- tool calls -----------------------------------------------------------------------------------------------

def tool_call_format(template: ChatTemplate) -> str:
    """How the model writes tool calls, from its template: 'hermes' (`<tool_call>{json}</tool_call>`: Qwen, Hermes
    and the ChatML fallback), 'mistral' (`[TOOL_CALLS][{json}, ...]`) or 'llama' (Llama 3.1: the bare JSON object
    `{"name": ..., "parameters": {...}}`). Templates that name none of them get 'hermes'."""
    src = template.source
    if "<tool_call>" in src:
        return "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<|python_tag|>" in src or "ipython" in src:
        return "llama"
    return "hermes"


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def _call(obj: Any, need_args: bool = False) -> Optional[dict]:
    """{'name', 'arguments': dict} from one decoded call object, or None when it is not a call."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # OpenAI-shaped {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if args is None and not need_args and ("arguments" in obj or "parameters" in obj or len(obj) == 1):
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": name, "arguments": args}


def _json_values(text: str) -> Optional[list]:
    """All JSON values in `text` separated only by whitespace, ';' or ','; None if anything else is there."""
    dec = json.JSONDecoder()
    out, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n;,":
            i += 1
        if i >= n:
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def _calls(values: list, need_args: bool = False) -> list[dict]:
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    calls = [_call(v, need_args) for v in flat]
    return calls if calls and all(calls) else []


def parse_tool_calls(text: str) -> list[dict]:
    """Tool calls in a model reply, as [{'name': str, 'arguments': dict}]; [] when the reply calls nothing.

    Recognised: Hermes/Qwen `<tool_call>{json}</tool_call>`, Mistral `[TOOL_CALLS][{...}]` and
    `[TOOL_CALLS]name[ARGS]{...}`, and Llama-3.1 replies that are just `{"name": ..., "parameters": ...}`
    (optionally after `<|python_tag|>`, several separated by ';').
    """
    if "<tool_call>" in text:
        found = []
        for body in _HERMES.findall(text):
            values = _json_values(body)
            found.extend(_calls(values) if values else [])
        return found
    if "[TOOL_CALLS]" in text:
        rest = text.split("[TOOL_CALLS]", 1)[1].strip()
        if "[ARGS]" in rest:
            found = []
            for chunk in rest.split("[TOOL_CALLS]"):
                name, _, args = chunk.partition("[ARGS]")
                call = _call({"name": name.strip(), "arguments": args.strip() or "{}"})
                if call:
                    found.append(call)
            return found
        values = _json_values(rest.replace("</s>", ""))
        return _calls(values) if values else []
    body = text.replace("<|python_tag|>", "").replace("<|eom_id|>", "").replace("<|eot_id|>", "").strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    if not body.startswith(("{", "[")):
        return []
    values = _json_values(body)
    # Bare JSON is only a call when it says so with its arguments, so ordinary JSON answers are not mistaken.
    return _calls(values, need_args=True) if values else []
