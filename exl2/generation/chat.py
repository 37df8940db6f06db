"""Chat templates (Jinja2, rendered like transformers' apply_chat_template) and parsing of tool calls in model output."""
from __future__ import annotations

import ast
import json
import math
import re
from datetime import datetime
from typing import Any, Optional

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from exl2.errors import ConfigError
from exl2.generation import harmony
from exl2.generation.harmony import CHANNEL, is_harmony

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


def _cut_after_final(text: str, messages: list[dict]) -> str:
    """`text` cut right after the last message's content, where the template wrote it (its outer whitespace kept
    where the template kept it), as transformers' continue_final_message does."""
    final = (messages[-1].get("content") if messages else None) or ""
    core = final.strip()
    if not core or core not in text:
        raise ConfigError("The final message cannot be continued: it is empty, or the chat template does not "
                          "write its text as given.")
    at = text.rindex(core)
    kept = final.lstrip()
    return text[:at + len(kept)] if text[at:at + len(kept)] == kept else text[:at + len(core)]


class ChatTemplate:
    """A compiled chat template; `render` turns messages (and tools) into the prompt text the model was trained on."""

    def __init__(self, template: Optional[str] = None, bos_token: Optional[str] = None,
                 eos_token: Optional[str] = None, special_tokens: Optional[dict[str, str]] = None):
        self.source = template if template else CHATML_TEMPLATE
        self.is_fallback = not template
        self.name: Optional[str] = None      # a chosen template's name (`templates.choose_template`)
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
               continue_final_message: bool = False, **extra: Any) -> str:
        """The prompt text; `continue_final_message` (Hugging Face's and vLLM's) ends it inside the last message,
        right after its text, so that the reply continues that message (a template that rewrites the text
        beyond its outer whitespace cannot be continued: ConfigError)."""
        kwargs = {**self.special_tokens, **extra}
        try:
            text = self._compiled.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         **kwargs)
        except jinja2.exceptions.SecurityError as e:
            raise ConfigError(f"The chat template tried an unsafe operation ({e}).") from None
        except jinja2.TemplateError as e:
            raise ConfigError(f"The chat template failed to render: {e}.") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ConfigError(f"The chat template failed to render these messages ({type(e).__name__}: {e}).") from None
        return _cut_after_final(text, messages) if continue_final_message else text


# ---- tool calls -----------------------------------------------------------------------------------------------

# DeepSeek V3/R1/V3.1 call tokens, exactly as their templates write them: fullwidth bars (U+FF5C) and U+2581 for
# the spaces.
DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
DS_EOS = "<｜end▁of▁sentence｜>"
PY_START, PY_END = "<|python_start|>", "<|python_end|>"   # Llama 4 wraps code (and calls) in these

# Where call markup starts in a reply, for every format parse_tool_calls reads. A reply that is only a call, as
# JSON (Llama 3.1) or a Python list (pythonic), has no marker: it opens with '{' or '['.
MM_CALL = "<minimax:tool_call>"   # MiniMax-M2 wraps its <invoke> blocks in this
CALL_MARKERS = ("<tool_call>", "<function=", "[TOOL_CALLS]", "<|python_tag|>", DS_CALLS_BEGIN, DS_CALL_BEGIN,
                PY_START, MM_CALL)


def tool_call_format(template: ChatTemplate) -> str:
    """How the model writes tool calls, from its template: 'hermes' (`<tool_call>{json}</tool_call>`: Qwen, Hermes
    and the ChatML fallback), 'qwen3_xml' (Qwen3-Coder: `<tool_call>` around `<function=NAME>` and
    `<parameter=KEY>` blocks), 'glm' (GLM-4.5: `<tool_call>NAME` then `<arg_key>` / `<arg_value>` pairs),
    'minimax' (MiniMax-M2: `<minimax:tool_call>` around `<invoke name=...>` and `<parameter name=...>` blocks),
    'harmony' (gpt-oss: a commentary message `to=functions.NAME` whose body is the JSON arguments),
    'deepseek' (V3/R1/V3.1 `<｜tool▁call▁begin｜>` tokens), 'mistral' (`[TOOL_CALLS][{json}, ...]`), 'pythonic' (a
    Python list of calls, `[f(a=1), g()]`: Llama 3.2/4 pythonic and Gemma-style templates) or 'llama' (Llama 3.1:
    the bare JSON object `{"name": ..., "parameters": {...}}`). Templates that name none of them get 'hermes'."""
    src = template.source
    if is_harmony(src):
        return "harmony"
    if "<function=" in src:            # before hermes: Qwen3-Coder templates also write <tool_call>
        return "qwen3_xml"
    if "<arg_key>" in src:             # GLM-4.5 writes <tool_call> too
        return "glm"
    if MM_CALL in src:
        return "minimax"
    if "tool▁calls▁begin" in src:
        return "deepseek"
    if "<tool_call>" in src:
        return "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "[func_name1(" in src:          # the pythonic instruction: "[func_name1(params_name1=params_value1, ...)]"
        return "pythonic"
    if "<|python_tag|>" in src or "ipython" in src:
        return "llama"
    return "hermes"


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)
_NAME = re.compile(r"[^\s<>()\[\]{}\"',;=]+")   # what may be a tool name in markup formats
_XML_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|(?=<function=)|$)", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)
_GLM_CALL = re.compile(r"\s*([^\s<>]*)\s*(.*)", re.S)
_MM_BLOCK = re.compile(re.escape(MM_CALL) + r"(.*?)(?:</minimax:tool_call>|$)", re.S)
_MM_INVOKE = re.compile(r'<invoke name="([^"\n]*)">(.*?)(?:</invoke>|(?=<invoke )|$)', re.S)
_MM_PARAM = re.compile(r'<parameter name="([^"\n]*)">(.*?)(?:</parameter>|(?=<parameter )|$)', re.S)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.S)
_DS_CALL = re.compile(re.escape(DS_CALL_BEGIN) + r"([^<]*)" + re.escape(DS_SEP) + r"(.*?)(?:" + re.escape(DS_CALL_END)
                      + "|(?=" + re.escape(DS_CALL_BEGIN) + ")|(?=" + re.escape(DS_CALLS_END) + ")|$)", re.S)


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


def _tool_params(tools: Optional[list[dict]], name: str) -> dict:
    """The `properties` of tool `name`'s parameters schema ({} when unknown)."""
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties")
            return props if isinstance(props, dict) else {}
    return {}


def is_text_schema(schema: Any) -> bool:
    """Whether a Qwen3-Coder `<parameter>` with this JSON schema is written as plain text (a string) rather than
    as JSON: type 'string' (or a list of types with 'string'), string `enum`/`const` values, or no type and no
    structure at all."""
    if not isinstance(schema, dict):
        return True
    kind = schema.get("type")
    options = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(options, list) and options and kind in (None, "string"):
        return all(isinstance(o, str) for o in options)
    if kind is None:
        return not any(k in schema for k in ("anyOf", "oneOf", "allOf", "enum", "const", "$ref", "properties",
                                             "items"))
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


_PY_WORDS = {"True": True, "False": False, "None": None}


def _no_constant(name: str):
    raise ValueError(name)


def _xml_value(text: str, schema: Any) -> Any:
    """A Qwen3-Coder parameter value. With the tool's schema: text for string parameters, JSON otherwise. Without
    it: JSON when the text is a number, boolean, object or array, else the text itself."""
    if schema is not None and is_text_schema(schema):
        return text
    try:
        value = json.loads(text, parse_constant=_no_constant)   # no NaN / Infinity
    except ValueError:
        # Qwen3-Coder templates render history values with Jinja's `string`, so the model has seen Python's words
        return _PY_WORDS.get(text.strip(), text) if schema is not None else text
    if schema is None and (value is None or isinstance(value, str)):
        return text
    return value


def _xml_calls(text: str, tools: Optional[list[dict]]) -> list[dict]:
    """Qwen3-Coder calls: `<function=NAME>` blocks of `<parameter=KEY>\\nVALUE\\n</parameter>`; a block that is
    malformed (no name, stray text between its parameters) is skipped."""
    found = []
    for name, body in _XML_FUNCTION.findall(text):
        name = name.strip()
        if not _NAME.fullmatch(name):
            continue
        if "<parameter=" not in body:          # no parameters, or a JSON object of them
            call = _call({"name": name, "arguments": body.strip() or "{}"})
            if call:
                found.append(call)
            continue
        if _XML_PARAMETER.sub("", body).strip():
            continue
        props = _tool_params(tools, name) if tools else None
        args = {}
        for key, raw in _XML_PARAMETER.findall(body):
            key = key.strip()
            value = raw[1:] if raw.startswith("\n") else raw
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _xml_value(value, None if props is None else props.get(key))   # unknown: no schema
        if "" not in args:
            found.append({"name": name, "arguments": args})
    return found


def _glm_call(body: str, tools: Optional[list[dict]]) -> Optional[dict]:
    """A GLM-4.5 call, the inside of `<tool_call>`: its name, then `<arg_key>KEY</arg_key>` `<arg_value>VALUE
    </arg_value>` pairs (values typed as Qwen3-Coder's: text for string parameters, JSON otherwise); None when the
    body is not one (no name, text between the pairs)."""
    name, rest = _GLM_CALL.fullmatch(body).groups()
    if not _NAME.fullmatch(name) or _GLM_ARG.sub("", rest).strip():
        return None
    props = _tool_params(tools, name) if tools else None
    args = {key.strip(): _xml_value(value, None if props is None else props.get(key.strip()))
            for key, value in _GLM_ARG.findall(rest)}
    return None if "" in args else {"name": name, "arguments": args}


def _minimax_calls(text: str, tools: Optional[list[dict]]) -> list[dict]:
    """MiniMax-M2 calls: `<invoke name="NAME">` blocks of `<parameter name="KEY">VALUE</parameter>` inside
    `<minimax:tool_call>` (values typed as Qwen3-Coder's); a malformed invoke (no name, stray text) is skipped."""
    found = []
    for block in _MM_BLOCK.findall(text):
        for name, body in _MM_INVOKE.findall(block):
            if not _NAME.fullmatch(name.strip()) or _MM_PARAM.sub("", body).strip():
                continue
            name = name.strip()
            props = _tool_params(tools, name) if tools else None
            args = {}
            for key, raw in _MM_PARAM.findall(body):
                value = raw[1:] if raw.startswith("\n") else raw
                value = value[:-1] if value.endswith("\n") else value
                args[key.strip()] = _xml_value(value, None if props is None else props.get(key.strip()))
            if "" not in args:
                found.append({"name": name, "arguments": args})
    return found


def _deepseek_calls(text: str) -> list[dict]:
    """DeepSeek calls: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`
    (V3, R1) or `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` (V3.1); malformed ones are skipped."""
    found = []
    for head, rest in _DS_CALL.findall(text):
        head = head.strip()
        rest = rest.replace(DS_EOS, "").replace(DS_CALLS_END, "")
        if head in ("function", "") and not rest.lstrip().startswith("{"):
            name, _, body = rest.strip().partition("\n")
        else:
            name, body = head, rest
        name, body = name.strip(), body.strip()
        fenced = _FENCE.match(body)
        if fenced:
            body = fenced.group(1)
        call = _call({"name": name, "arguments": body or "{}"}) if _NAME.fullmatch(name) else None
        if call:
            found.append(call)
    return found


class _JsonWords(ast.NodeTransformer):
    """true / false / null, which models often write in Python calls, as the constants they mean."""
    WORDS = {"true": True, "false": False, "null": None}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(self.WORDS[node.id]) if node.id in self.WORDS else node


def _plain(value: Any) -> Any:
    """A Python literal as JSON-ready data (tuples become lists); ValueError for what JSON cannot hold."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v) for k, v in value.items()}
    raise ValueError(f"{type(value).__name__} is not JSON")


def _pythonic_calls(text: str, tools: Optional[list[dict]]) -> list[dict]:
    """A reply that is exactly a Python list of calls, `[get_weather(city="Paris", days=3), ping()]`, keyword
    arguments with literal values only; [] for anything else (so lists in ordinary answers are not calls). With
    `tools`, every name must be one of them."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    names = {(t.get("function", t) or {}).get("name") for t in tools} if tools else None
    found = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return []
        if names is not None and node.func.id not in names:
            return []
        args = {}
        for kw in node.keywords:
            if kw.arg is None:                     # **kwargs
                return []
            try:
                args[kw.arg] = _plain(ast.literal_eval(_JsonWords().visit(kw.value)))
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return []
        found.append({"name": node.func.id, "arguments": args})
    return found


def parse_tool_calls(text: str, tools: Optional[list[dict]] = None) -> list[dict]:
    """Tool calls in a model reply, as [{'name': str, 'arguments': dict}]; [] when the reply calls nothing.

    Recognised: Hermes/Qwen `<tool_call>{json}</tool_call>`; Qwen3-Coder `<tool_call><function=NAME>
    <parameter=KEY>VALUE</parameter>...</function></tool_call>` (also without the `<tool_call>` wrapper); GLM-4.5
    `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>`; MiniMax-M2
    `<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke>...`;
    DeepSeek V3/R1/V3.1 `<｜tool▁call▁begin｜>...<｜tool▁sep｜>...<｜tool▁call▁end｜>`; Mistral `[TOOL_CALLS][{...}]`
    and `[TOOL_CALLS]name[ARGS]{...}`; Llama-3.1 replies that are just `{"name": ..., "parameters": ...}`
    (optionally after `<|python_tag|>`, several separated by ';'); and replies that are just a Python list of
    calls with literal keyword arguments (`[f(a=1), g()]`, optionally inside `<|python_start|>...<|python_end|>`).

    `tools` (OpenAI-shaped, optional) types Qwen3-Coder and GLM values by their schema: without it a value is
    decoded as JSON when it is a number, boolean, object or array and kept as text otherwise. It also limits
    pythonic calls to the tools' names.
    """
    if MM_CALL in text:
        return _minimax_calls(text, tools)
    if "to=functions." in text and CHANNEL in text:
        return harmony.split(text)[2]
    if "<tool_call>" in text:
        found = []
        for body in _HERMES.findall(text):
            if body.startswith("<function="):
                found.extend(_xml_calls(body, tools))
                continue
            values = _json_values(body)
            if values:
                found.extend(_calls(values))
            elif not body.startswith(("{", "[")) and (call := _glm_call(body, tools)):
                found.append(call)
        return found
    if DS_CALL_BEGIN in text:
        return _deepseek_calls(text)
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
    if "<function=" in text:                   # Qwen3-Coder sometimes leaves out the <tool_call> wrapper
        return _xml_calls(text, tools)
    body = text
    if PY_START in body:
        body = body.split(PY_START, 1)[1].split(PY_END, 1)[0]
    for end in ("<|python_tag|>", "<|eom_id|>", "<|eot_id|>", "<|eom|>", "<|eot|>"):
        body = body.replace(end, "")
    body = body.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    if not body.startswith(("{", "[")):
        return []
    values = _json_values(body)
    if values is None:
        return _pythonic_calls(body, tools) if body.startswith("[") and not fenced else []
    # Bare JSON is only a call when it says so with its arguments, so ordinary JSON answers are not mistaken.
    return _calls(values, need_args=True) if values else []
