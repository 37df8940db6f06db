"""Request fields -> engine arguments, and the 400s for what the engine cannot do (never silently ignored)."""
from __future__ import annotations

import json
from typing import Optional

from pydantic import ValidationError

from exl2.config import SamplingSettings
from exl2.errors import ConfigError
from exl2.generation.constraints import Grammar, lark_grammar
from exl2.generation.fim import fim_prompt
from exl2.server.errors import APIError, first_problem, unsupported
from exl2.server.schemas import (ChatCompletionRequest, CompletionRequest, NamedToolChoice, ResponseFormat,
                                 SamplingFields)

MAX_STOPS = 64  # OpenAI allows 4; TabbyAPI has no cap and roleplay clients send a stop per character
MAX_N = 16
MAX_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS = 20, 5   # OpenAI's bounds


def logprobs(req: SamplingFields) -> Optional[int]:
    """How many alternatives each token's log-probability comes with (None: no log-probabilities)."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def _format_schema(fmt: ResponseFormat) -> Optional[dict]:
    """The schema a non-text response_format asks for: json_object → None (any JSON object), json_schema → its
    `schema`."""
    if fmt.type != "json_schema":
        return None
    schema = (fmt.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema must carry a 'schema' object.", param="response_format")
    return schema


def constraint_fields(req: SamplingFields) -> list[str]:
    """The given fields that hold the reply to a grammar: a non-text response_format, TabbyAPI's json_schema,
    regex_pattern and grammar_string (empty ones count as not given, as in TabbyAPI) and a tool_choice that forces
    a call."""
    fmt = req.response_format
    forced = isinstance(req, ChatCompletionRequest) and bool(req.tools) and (
        req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice))
    given = {"response_format": fmt is not None and fmt.type != "text", "json_schema": bool(req.json_schema),
             "regex_pattern": bool(req.regex_pattern), "grammar_string": bool(req.grammar_string),
             "tool_choice": forced}
    return [name for name, on in given.items() if on]


def response_grammar(engine, req: SamplingFields) -> Optional[Grammar]:
    """The grammar of the request's response_format, json_schema (as response_format json_schema with that
    schema), regex_pattern or grammar_string (Lark); `check_supported` lets at most one of them through. An
    invalid one is a 400 naming its field."""
    fmt = req.response_format
    if req.json_schema:
        param, build = "json_schema", lambda: engine.json_grammar(req.json_schema)
    elif req.regex_pattern:
        param, build = "regex_pattern", lambda: engine.regex_grammar(req.regex_pattern)
    elif req.grammar_string:
        # the Engine has no Lark builder of its own: the constraints module's, over the engine's tokenizer
        param, build = "grammar_string", lambda: lark_grammar(engine.tokenizer, req.grammar_string)
    elif fmt is not None and fmt.type != "text":
        schema = _format_schema(fmt)
        param, build = "response_format", lambda: engine.json_grammar(schema)
    else:
        return None
    try:
        return build()
    except ConfigError as e:
        raise APIError(400, str(e), param=param) from None


def tool_grammar(engine, tools: Optional[list[dict]], choice) -> Optional[Grammar]:
    """The grammar of a tool_choice that forces a call ('required', or a named function): the reply is then one or
    more calls in the model's own format, arguments following each tool's schema. None for 'auto'/'none'."""
    if not tools or not (choice == "required" or isinstance(choice, NamedToolChoice)):
        return None
    try:
        return engine.tool_grammar(tools, choice.function.name if isinstance(choice, NamedToolChoice) else None)
    except ConfigError as e:
        raise APIError(400, str(e), param="tools") from None


def check_supported(req: SamplingFields) -> None:
    """Reject fields whose meaning the engine cannot deliver, so a client never gets a silently different reply."""
    if req.n > MAX_N:
        raise APIError(400, f"'n' is at most {MAX_N}.", param="n")
    if req.mirostat_mode == 1:
        raise APIError(400, "Only Mirostat 2 is supported: mirostat_mode (mirostat) must be 0 or 2, not 1.",
                       param="mirostat_mode")
    constraints = constraint_fields(req)
    if len(constraints) > 1:
        named = [f"{c} (forcing a tool call)" if c == "tool_choice" else c for c in constraints]
        raise APIError(400, f"{' and '.join(named)} cannot be combined: only one of response_format, json_schema, "
                            "regex_pattern, grammar_string and a tool_choice that forces a call may constrain the "
                            "reply.", param=constraints[-1])
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true.", param="top_logprobs")
        if (req.top_logprobs or 0) > MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs is at most {MAX_TOP_LOGPROBS}.", param="top_logprobs")
    if isinstance(req, CompletionRequest):
        if (req.logprobs or 0) > MAX_COMPLETION_LOGPROBS:
            raise APIError(400, f"logprobs is at most {MAX_COMPLETION_LOGPROBS}.", param="logprobs")
        if req.logprobs is not None and req.echo:
            raise unsupported("logprobs", "logprobs with echo (the prompt's log-probabilities)")
        if req.best_of is not None:
            if req.best_of < req.n:
                raise APIError(400, f"best_of ({req.best_of}) must be at least n ({req.n}).", param="best_of")
            if req.best_of > MAX_N:  # candidates a prompt, as many as n allows
                raise APIError(400, f"best_of is at most {MAX_N}.", param="best_of")
            if req.stream and req.best_of > req.n:
                raise APIError(400, "best_of cannot be combined with stream: the best candidates are known only "
                                    "once all have finished.", param="best_of")


def _check_token(token: int, vocab: Optional[int], param: str) -> None:
    """A 400 naming `param` when `token` is not a token id of the model (`vocab` logits; None: unknown)."""
    if token < 0 or (vocab is not None and token >= vocab):
        raise APIError(400, f"{param} names token {token}, outside the model's vocabulary.", param=param)


def logit_bias(req: SamplingFields, vocab: Optional[int]) -> Optional[dict[int, float]]:
    """OpenAI's logit_bias (token id strings → -100..100) with integer ids; a key that is not a token id of the
    model (`vocab` logits; None: unknown) is a 400, not a bias silently dropped."""
    out: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias key '{key}' is not a token id.", param="logit_bias") from None
        _check_token(token, vocab, "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise APIError(400, f"logit_bias values must be between -100 and 100 (token {token}: {value}).",
                           param="logit_bias")
        out[token] = value
    return out or None


def token_list(req: SamplingFields, param: str, vocab: Optional[int]) -> Optional[tuple[int, ...]]:
    """TabbyAPI's banned_tokens / allowed_tokens (`param`): a list of ids or a string of comma-separated ids. Each
    must be a token id of the model (`vocab` logits; None: unknown), else a 400: an id the sampler would skip
    silently is a client's mistake. Empty: None."""
    value = getattr(req, param)
    if isinstance(value, str):
        try:
            value = [int(item) for item in value.split(",") if item.strip()]
        except ValueError:
            raise APIError(400, f"{param} must be token ids: a list of integers or comma-separated integers.",
                           param=param) from None
    for token in value or ():
        _check_token(token, vocab, param)
    return tuple(value) if value else None


def _json_strings(text: str) -> Optional[list[str]]:
    """`text` as a JSON list of strings; None when it is not one."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    return parsed if isinstance(parsed, list) and all(isinstance(b, str) for b in parsed) else None


def dry_sequence_breakers(value: Optional[list[str] | str]) -> Optional[tuple[str, ...]]:
    """The DRY sequence breakers a request sends: a list, or a string holding a JSON list (SillyTavern's form),
    TabbyAPI's bracketless JSON items ('"\\n", ":"') or plain comma-separated text. Empty: None, the engine's own
    set."""
    if isinstance(value, str):
        if value.lstrip().startswith("["):
            parsed = _json_strings(value)
            if parsed is None:
                raise APIError(400, "dry_sequence_breakers must be a JSON list of strings or comma-separated text.",
                               param="dry_sequence_breakers")
        else:
            # a breaker of whitespace alone (a newline) is kept as is; others lose the spaces around the commas
            parsed = _json_strings(f"[{value}]") or [b.strip() or b for b in value.split(",") if b]
        value = parsed
    return tuple(value) if value else None


def banned_strings(value: Optional[list[str] | str]) -> Optional[tuple[str, ...]]:
    """TabbyAPI's banned_strings: a list, or one string; empty strings are dropped (they would ban everything)."""
    items = [value] if isinstance(value, str) else value or []
    return tuple(b for b in items if b) or None


def _or_default(value: float, name: str) -> float:
    """TabbyAPI's 0 for "the engine's default"."""
    return value or SamplingSettings.model_fields[name].default


def sampling(req: SamplingFields, choice: int = 0, bias: Optional[dict[int, float]] = None,
             banned: Optional[tuple[int, ...]] = None, allowed: Optional[tuple[int, ...]] = None) -> SamplingSettings:
    """OpenAI/TabbyAPI sampling fields as engine settings (`bias`: from `logit_bias`; `banned`, `allowed`: from
    `token_list`). top_p 0 keeps only the most likely token (greedy). Choice i of n samples with seed + i: the
    choices differ, yet a seeded request is reproducible. A value the engine refuses (e.g. dry_base below 1) is a
    400 naming the field."""
    try:
        return SamplingSettings(
            temperature=req.temperature, top_k=1 if req.top_p == 0 else max(req.top_k, 0), top_p=req.top_p or 1.0,
            min_p=req.min_p, repetition_penalty=req.repetition_penalty, frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty, logit_bias=bias, banned_tokens=banned, allowed_tokens=allowed,
            repetition_range=max(req.penalty_range, 0), repetition_decay=req.repetition_decay,
            banned_strings=banned_strings(req.banned_strings), token_healing=req.token_healing,
            seed=None if req.seed is None else req.seed + choice, top_a=req.top_a, tfs=req.tfs, typical=req.typical,
            smoothing_factor=req.smoothing_factor, temperature_last=req.temperature_last, min_temp=req.min_temp,
            max_temp=req.max_temp,
            temp_exponent=req.temp_exponent, xtc_probability=req.xtc_probability, xtc_threshold=req.xtc_threshold,
            xtc_ignore_tokens=req.xtc_ignore_tokens, skew=req.skew, dry_max_ngram=req.dry_max_ngram,
            dry_multiplier=req.dry_multiplier, dry_base=_or_default(req.dry_base, "dry_base"),
            dry_allowed_length=_or_default(req.dry_allowed_length, "dry_allowed_length"), dry_range=req.dry_range,
            dry_sequence_breakers=dry_sequence_breakers(req.dry_sequence_breakers),
            mirostat_mode=req.mirostat_mode, mirostat_tau=req.mirostat_tau, mirostat_eta=req.mirostat_eta,
            cfg_scale=req.cfg_scale)
    except ValidationError as e:
        field, msg = first_problem(e)
        raise APIError(400, f"Invalid value for '{field}': {msg}." if field else f"Invalid sampling settings: {msg}.",
                       param=field) from None


def stop_strings(req: SamplingFields) -> list[str]:
    """`stop`'s strings (its integers are stop token ids, `stop_token_ids`)."""
    stops = [req.stop] if isinstance(req.stop, str) else [s for s in req.stop or [] if isinstance(s, str)]
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"'stop' takes at most {MAX_STOPS} strings.", param="stop")
    return [s for s in stops if s]


def stop_token_ids(req: SamplingFields, vocab: Optional[int]) -> list[int]:
    """vLLM's stop_token_ids plus the integers in TabbyAPI's `stop`: tokens that end the reply like EOS. An id
    that is not a token of the model (`vocab` logits; None: unknown) is a 400: it could never end the reply."""
    given = {"stop_token_ids": list(req.stop_token_ids or []),
             "stop": [s for s in req.stop if isinstance(s, int)] if isinstance(req.stop, list) else []}
    for param, ids in given.items():
        for token in ids:
            _check_token(token, vocab, param)
    return given["stop_token_ids"] + given["stop"]


def min_new_tokens(req: SamplingFields, max_new: int) -> int:
    """min_tokens (vLLM, TabbyAPI), checked against the reply's limit `max_new` (see `max_new_tokens`): a reply
    could never reach more."""
    value = req.min_tokens or 0
    if value < 0:
        raise APIError(400, f"min_tokens must be 0 or more, not {value}.", param="min_tokens")
    if value > max_new:
        given = getattr(req, "max_completion_tokens", None) or req.max_tokens
        limit = f"max_tokens ({max_new})" if given else f"the default max_tokens ({max_new})"
        raise APIError(400, f"min_tokens ({value}) is more than {limit}.", param="min_tokens")
    return value


def ignore_eos(req: SamplingFields) -> bool:
    """vLLM's ignore_eos or TabbyAPI's ban_eos_token: the model's end-of-sequence tokens are never sampled."""
    return req.ignore_eos or req.ban_eos_token


def max_new_tokens(req: SamplingFields, default: int) -> int:
    """max_completion_tokens (the newer name) wins over max_tokens; the engine clamps to the context left."""
    value = getattr(req, "max_completion_tokens", None) or req.max_tokens
    return value or default


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts, each text or token ids: `prompt` is one prompt (a string or token ids) or a list of them."""
    p = req.prompt
    prompts = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
    if any(isinstance(one, list) and not one for one in prompts):
        raise APIError(400, "The prompt is empty.", param="prompt")
    return prompts


def fill_in_the_middle(req: CompletionRequest, tokenizer, prompts: list) -> list:
    """With `suffix`, each text prompt as the model's fill-in-the-middle prompt (token ids) for the text between
    it and the suffix; without, the prompts as they are."""
    if not req.suffix:
        return prompts
    if not all(isinstance(one, str) for one in prompts):
        raise APIError(400, "suffix needs text prompts, not token ids.", param="suffix")
    try:
        return [fim_prompt(tokenizer, one, req.suffix) for one in prompts]
    except ConfigError as e:
        raise APIError(400, str(e), param="suffix", code="unsupported_parameter") from None
