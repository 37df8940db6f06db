"""Structured output: a JSON schema, a regular expression or a Lark grammar allows, at each step, only the
tokens that keep the reply valid.

The token masks come from llguidance (a Rust parser over the model's own tokenizer, tens of microseconds a
step), which runs on the host while the GPU decodes; the sampler then draws among the allowed tokens only.
"""
from __future__ import annotations

import json
from typing import Any, Optional

import numpy as np
import torch

from exl2.errors import ConfigError
from exl2.generation.chat import is_text_schema
from exl2.generation.tokenizer import Tokenizer


# One line, spaces after separators: free whitespace lets a model pad a reply with blanks until it runs out of
# tokens. Lenient: keywords the compiler does not implement are ignored instead of rejecting the schema.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ConfigError("Structured output needs the llguidance package (pip install llguidance).") from None
    return llguidance


def _grammar_tokenizer(tokenizer: Tokenizer):
    """The llguidance view of the model's tokenizer, built once per tokenizer (it costs about a second)."""
    cached = getattr(tokenizer, "_llg_tokenizer", None)
    if cached is None:
        backend = getattr(tokenizer._b, "tok", None)
        if backend is None:
            raise ConfigError("Structured output needs a tokenizer.json; this model only has a SentencePiece "
                              "tokenizer.model.")
        eos = sorted(tokenizer.eos_ids) or None
        cached = _llguidance().LLTokenizer(backend.to_str(), eos_token=eos)
        tokenizer._llg_tokenizer = cached
    return cached


class Grammar:
    """One reply's grammar state: `allowed()` before sampling, `advance(token)` after."""

    def __init__(self, tokenizer: Tokenizer, grammar: str):
        llg = _llguidance()
        self.matcher = llg.LLMatcher(_grammar_tokenizer(tokenizer), grammar, log_level=0)
        if self.matcher.is_error():
            raise ConfigError(f"The output format is invalid: {self.matcher.get_error()}")

    def allowed(self, vocab: int, device: torch.device) -> Optional[torch.Tensor]:
        """[vocab] bool: the tokens the grammar accepts next (logit columns past the tokenizer's are never);
        None when it accepts none (the grammar failed)."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = np.zeros(vocab, dtype=bool)
        n = min(vocab, bits.size)
        mask[:n] = bits[:n].astype(bool)
        if self.matcher.is_error() or not mask.any():
            return None
        return torch.from_numpy(mask).to(device, non_blocking=True)

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The reply is complete: nothing but an end-of-sequence token may follow."""
        return self.matcher.is_stopped()


def json_grammar(tokenizer: Tokenizer, schema: Optional[dict[str, Any]] = None) -> Grammar:
    """Replies that are JSON matching `schema` (None: any JSON object)."""
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                                         defaults=JSON_STYLE)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"The JSON schema cannot be used: {e}") from None
    return _checked(tokenizer, grammar)


def regex_grammar(tokenizer: Tokenizer, pattern: str) -> Grammar:
    """Replies that match a regular expression."""
    return _checked(tokenizer, _llguidance().LLMatcher.grammar_from_regex(pattern))


def lark_grammar(tokenizer: Tokenizer, grammar: str) -> Grammar:
    """Replies in a Lark grammar (llguidance's dialect)."""
    return _checked(tokenizer, _llguidance().LLMatcher.grammar_from_lark(grammar))


def tool_call_grammar(tokenizer: Tokenizer, tools: list[dict[str, Any]], fmt: str = "hermes",
                      name: Optional[str] = None) -> Grammar:
    """Replies that are one or more calls of `tools` (OpenAI-shaped {"type": "function", "function": {...}}), or of
    the tool called `name` only, in the model's own format (`chat.tool_call_format`), arguments following each
    tool's JSON schema: what tool_choice 'required' or a named function means, enforced rather than hoped for."""
    args_key = "parameters" if fmt == "llama" else "arguments"
    fns = [tool.get("function", tool) for tool in tools]
    fns = [fn for fn in fns if name is None or fn["name"] == name]
    if not fns:
        raise ConfigError(f"No tool named '{name}' to call." if name else "A tool call needs at least one tool.")
    if fmt in ("deepseek", "pythonic", "harmony"):
        raise ConfigError(f"Forcing a tool call is not supported for this model's tool-call format ({fmt}); "
                          "use tool_choice 'auto'.")
    if fmt == "qwen3_xml":
        return _checked(tokenizer, _qwen3_xml_lark(fns))
    if fmt == "glm":
        return _checked(tokenizer, _glm_lark(fns))
    if fmt == "minimax":
        return _checked(tokenizer, _minimax_lark(fns))
    calls = []
    for fn in fns:
        params = fn.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
        calls.append({"type": "object", "additionalProperties": False, "required": ["name", args_key],
                      "properties": {"name": {"const": fn["name"]}, args_key: params}})
    call = json.dumps({"anyOf": calls, "x-guidance": JSON_STYLE})
    if fmt == "hermes":
        lark = f'start: call ("\\n" call)*\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {call}'
    elif fmt == "mistral":
        lark = f'start: "[TOOL_CALLS]" "[" body (", " body)* "]"\nbody: %json {call}'
    elif fmt == "llama":
        lark = f'start: body\nbody: %json {call}'
    else:
        raise ConfigError(f"Unknown tool-call format '{fmt}'.")
    return _checked(tokenizer, lark)


# A Qwen3-Coder text value: anything without "</parameter>", then the newline and the closing tag, all one lexeme so
# that the value ends exactly where the model closes it (and parse_tool_calls, which cuts at the first
# "</parameter>", reads back the same value).
_XML_TEXT = 'XML_TEXT: (/(?s:.*)/ & ~/(?s:.*<\\/parameter>.*)/) "\\n</parameter>"'
# MiniMax-M2's text value: anything without "</parameter>", then the closing tag
_MM_TEXT = 'MM_TEXT: (/(?s:.*)/ & ~/(?s:.*<\\/parameter>.*)/) "</parameter>"'
# GLM-4.5's text value: anything without "</arg_value>", then the closing tag
_GLM_TEXT = 'GLM_TEXT: (/(?s:.*)/ & ~/(?s:.*<\\/arg_value>.*)/) "</arg_value>"'


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _qwen3_xml_value(schema: Any, defs: dict[str, Any], close: str = "\n</parameter>", text: str = "XML_TEXT") -> str:
    """The Lark expression of one parameter's value and its closing tag `close` (`text`: the free-text rule)."""
    if not isinstance(schema, dict):
        return text
    if is_text_schema(schema):
        options = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
            return "(" + " | ".join(_lit(o + close) for o in options) + ")"
        return text
    return f'%json {json.dumps({**defs, **schema, "x-guidance": JSON_STYLE})} {_lit(close)}'


def _qwen3_xml_lark(fns: list[dict[str, Any]]) -> str:
    """Qwen3-Coder calls as its template writes them: `<tool_call>\\n<function=NAME>\\n`, each parameter in the
    schema's order (the required ones always, the others optionally) as `<parameter=KEY>\\nVALUE\\n</parameter>\\n`,
    then `</function>\\n</tool_call>`. Text parameters (`chat.is_text_schema`) are free text without
    `</parameter>`, or one of their string `enum` values; the others are JSON following their schema."""
    rules = ['start: call ("\\n" call)*',
             'call: "<tool_call>\\n" (' + " | ".join(f"fn{i}" for i in range(len(fns))) + ') "</tool_call>"']
    for i, fn in enumerate(fns):
        params = fn.get("parameters") or {}
        required = set(params.get("required") or ())
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}   # for "#/$defs/..." references
        parts = [_lit(f"<function={fn['name']}>\n")]
        for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
            opening = _lit(f"<parameter={key}>\n")
            rules.append(f'fn{i}_p{j}: {opening} {_qwen3_xml_value(schema, defs)} "\\n"')
            parts.append(f"fn{i}_p{j}" + ("" if key in required else "?"))
        rules.append(f"fn{i}: " + " ".join(parts) + ' "</function>\\n"')
    return "\n".join(rules + [_XML_TEXT]) + "\n"


def _glm_lark(fns: list[dict[str, Any]]) -> str:
    """GLM-4.5 calls as its template writes them: `<tool_call>NAME\n`, each parameter in the schema's order (the
    required ones always) as `<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n`, then `</tool_call>`; values
    as Qwen3-Coder's (text for string parameters, JSON following the schema otherwise)."""
    rules = ['start: call ("\\n" call)*',
             'call: "<tool_call>" (' + " | ".join(f"fn{i}" for i in range(len(fns))) + ') "</tool_call>"']
    for i, fn in enumerate(fns):
        params = fn.get("parameters") or {}
        required = set(params.get("required") or ())
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        parts = [_lit(f"{fn['name']}\n")]
        for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
            opening = _lit(f"<arg_key>{key}</arg_key>\n<arg_value>")
            rules.append(f'fn{i}_p{j}: {opening} {_qwen3_xml_value(schema, defs, "</arg_value>", "GLM_TEXT")} "\\n"')
            parts.append(f"fn{i}_p{j}" + ("" if key in required else "?"))
        rules.append(f"fn{i}: " + " ".join(parts))
    return "\n".join(rules + [_GLM_TEXT]) + "\n"


def _minimax_lark(fns: list[dict[str, Any]]) -> str:
    """MiniMax-M2 calls as its template writes them: `<minimax:tool_call>\\n`, then per call `<invoke name="NAME">\\n`,
    each parameter in the schema's order (the required ones always) as `<parameter name="KEY">VALUE</parameter>\\n`,
    `</invoke>\\n`, and last `</minimax:tool_call>`; values as Qwen3-Coder's."""
    rules = ['start: "<minimax:tool_call>\\n" call+ "</minimax:tool_call>"',
             "call: (" + " | ".join(f"fn{i}" for i in range(len(fns))) + ')  "</invoke>\\n"']
    for i, fn in enumerate(fns):
        params = fn.get("parameters") or {}
        required = set(params.get("required") or ())
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        parts = [_lit(f'<invoke name="{fn["name"]}">\n')]
        for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
            opening = _lit(f'<parameter name="{key}">')
            rules.append(f'fn{i}_p{j}: {opening} {_qwen3_xml_value(schema, defs, "</parameter>", "MM_TEXT")} "\\n"')
            parts.append(f"fn{i}_p{j}" + ("" if key in required else "?"))
        rules.append(f"fn{i}: " + " ".join(parts))
    return "\n".join(rules + [_MM_TEXT]) + "\n"


def _checked(tokenizer: Tokenizer, grammar: str) -> Grammar:
    error = _llguidance().LLMatcher.validate_grammar(grammar, _grammar_tokenizer(tokenizer))
    if error and not error.startswith("WARNING"):
        raise ConfigError(f"The output format is invalid: {error.strip().splitlines()[0]}")
    return Grammar(tokenizer, grammar)

