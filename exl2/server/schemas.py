"""Request bodies of the OpenAI-compatible endpoints (pydantic v2).

Fields are declared so that types are checked and a wrong value becomes a 400 naming the field. Unknown fields
are ignored, as OpenAI clients send extras (`user`, `metadata`, `service_tier`, ...) that change nothing here.
Fields we declare but cannot honour are rejected in `exl2.server.params`, never silently dropped.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, JsonValue, StrictInt


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Body):
    """One part of a message's content; only `text` parts are supported (checked when the prompt is built)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: Optional[str] = None


class FunctionCall(_Body):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"   # OpenAI sends a JSON string; a dict is accepted too


class ToolCall(_Body):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]   # function: the pre-tools API
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    function_call: Optional[FunctionCall] = None  # the pre-tools API's one call of an assistant message
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None     # an earlier reply's thinking, as this server returned it


class FunctionDef(_Body):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Body):
    include_usage: bool = False


class ResponseFormat(_Body):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: Optional[dict[str, Any]] = None


class RequestLora(_Body):
    """One LoRA adapter a request runs with: a directory name under the server's --lora-dir."""

    name: str
    scaling: float = Field(1.0, ge=0.0, allow_inf_nan=False)


class SamplingFields(_Body):
    """What completions and chat completions share: length, sampling, stops, streaming."""

    model: Optional[str] = None
    # this request's own LoRA adapters instead of the served ones ([]: the base model); batched with requests that
    # use others
    loras: Optional[list[RequestLora]] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=10.0)       # OpenAI's default is 1.0, not the engine's 0.8
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)                            # TabbyAPI: -1 means off, like 0
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    # TabbyAPI's token lists: ids, or a string of comma-separated ids ("1,2,3"); parsed in params
    banned_tokens: Optional[Union[list[StrictInt], str]] = Field(
        None, validation_alias=AliasChoices("banned_tokens", "custom_token_bans"))
    allowed_tokens: Optional[Union[list[StrictInt], str]] = Field(
        None, validation_alias=AliasChoices("allowed_tokens", "allowed_token_ids"))
    seed: Optional[int] = None
    # TabbyAPI's: the repetition penalty over the last N tokens (-1 or 0: all), fading over repetition_decay more
    penalty_range: int = Field(-1, ge=-1, validation_alias=AliasChoices(
        "penalty_range", "repetition_range", "repetition_penalty_range", "rep_pen_range"))
    repetition_decay: int = Field(0, ge=0)
    banned_strings: Optional[Union[list[str], str]] = None   # TabbyAPI's: text never produced (case ignored)
    token_healing: bool = False                               # TabbyAPI's: regrow the prompt's last token
    # TabbyAPI's further samplers, with its names, aliases and defaults; bounds as in SamplingSettings
    top_a: float = Field(0.0, ge=0.0, le=1.0)
    tfs: float = Field(1.0, ge=0.0, le=1.0)
    typical: float = Field(1.0, ge=0.0, le=1.0, validation_alias=AliasChoices("typical", "typical_p"))
    smoothing_factor: float = Field(0.0, ge=0.0)
    temperature_last: bool = False
    min_temp: float = Field(1.0, ge=0.0, le=10.0, validation_alias=AliasChoices("min_temp", "dynatemp_low"))
    max_temp: float = Field(1.0, ge=0.0, le=10.0, validation_alias=AliasChoices("max_temp", "dynatemp_high"))
    temp_exponent: float = Field(1.0, gt=0.0, validation_alias=AliasChoices("temp_exponent", "dynatemp_exponent"))
    xtc_probability: float = Field(0.0, ge=0.0, le=1.0)
    xtc_threshold: float = Field(0.1, ge=0.0, le=1.0)
    xtc_ignore_tokens: Optional[list[int]] = None          # tokens XTC never drops (default: newlines, specials)
    dry_multiplier: float = Field(0.0, ge=0.0)
    dry_base: float = Field(0.0, ge=0.0)                  # 0: the engine's default (params); else at least 1
    dry_allowed_length: int = Field(0, ge=0)              # 0: the engine's default
    dry_range: int = Field(0, ge=0, validation_alias=AliasChoices("dry_range", "dry_penalty_last_n"))
    dry_max_ngram: int = Field(20, ge=1, le=1024)
    # a list, or a string: a JSON list (SillyTavern sends one) or comma-separated; parsed in params
    dry_sequence_breakers: Optional[Union[list[str], str]] = None
    mirostat_mode: int = Field(0, ge=0, le=2, validation_alias=AliasChoices("mirostat_mode", "mirostat"))
    mirostat_tau: float = Field(1.5, gt=0.0)
    mirostat_eta: float = Field(0.3, gt=0.0)
    skew: float = 0.0                                     # TabbyAPI's and exllamav2's (SamplingSettings.skew)
    # TabbyAPI's classifier-free guidance: ≠ 1 steers the reply away from negative_prompt (default: BOS alone)
    cfg_scale: float = Field(1.0, ge=-100.0, le=100.0)
    negative_prompt: Optional[str] = None
    stop: Optional[Union[str, list[Union[str, StrictInt]]]] = Field(None)   # TabbyAPI: integers are stop token ids
    stop_token_ids: Optional[list[int]] = None    # vLLM's: tokens that end the reply like EOS
    min_tokens: Optional[int] = None              # vLLM's and TabbyAPI's; 0 ≤ min_tokens ≤ max_tokens (params)
    ignore_eos: bool = False                      # vLLM's
    ban_eos_token: bool = False                   # TabbyAPI's name for ignore_eos
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    response_format: Optional[ResponseFormat] = None
    # TabbyAPI's structured output; empty counts as not given, as in TabbyAPI (SillyTavern sends "" by default)
    json_schema: Optional[dict[str, Any]] = None
    regex_pattern: Optional[str] = None
    grammar_string: Optional[str] = None                  # a Lark grammar (llguidance's dialect)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None             # accepted; the model decides how many calls it makes
    # OpenAI's deprecated function calling, read as tools (`tools.from_functions`); its replies keep its form
    functions: Optional[list[FunctionDef]] = None
    function_call: Optional[Union[Literal["none", "auto"], NamedFunction]] = None
    # Extra chat-template variables (e.g. Qwen3's {"enable_thinking": false}): vLLM's name and TabbyAPI's.
    chat_template_kwargs: Optional[dict[str, JsonValue]] = None
    template_vars: Optional[dict[str, JsonValue]] = None
    add_generation_prompt: bool = True       # TabbyAPI's: False renders no opening of the assistant's reply
    # TabbyAPI's: a chat template by name (the server's template directory, a bundled one or one the model's
    # tokenizer_config.json lists) for this request only; tool-call and reasoning parsing keep the model's settings
    prompt_template: Optional[str] = None
    response_prefix: Optional[str] = None    # TabbyAPI's: the reply continues this text, which starts its content
    # vLLM's and TabbyAPI's: the reply continues the final (assistant) message instead of starting a new one
    continue_final_message: bool = False
    # TabbyAPI's and OpenAI's top-level switches, passed to the chat template as variables of these names (Qwen3's
    # enable_thinking, gpt-oss's reasoning_effort); template_vars / chat_template_kwargs win where they set them too
    enable_thinking: Optional[bool] = None
    reasoning_effort: Optional[Literal["minimal", "low", "medium", "high"]] = None
    # TabbyAPI's reasoning budget: after this many tokens inside <think> the block is closed for the model (with
    # reasoning_budget_message first), so it answers from what it has thought
    reasoning_budget_tokens: Optional[int] = Field(None, ge=0, validation_alias=AliasChoices(
        "reasoning_budget_tokens", "reasoning_budget", "thinking_budget", "thinking_token_budget"))
    reasoning_budget_message: Optional[str] = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1)
    logprobs: Optional[int] = Field(None, ge=0)
    add_bos_token: Optional[bool] = None                    # TabbyAPI's extension; default: the tokenizer decides


class EncodeRequest(_Body):
    """`/v1/token/encode` (TabbyAPI's): a string, or chat messages to render through the template first."""
    text: Union[str, list[ChatMessage]]
    add_bos_token: Optional[bool] = None      # None: the tokenizer's own rule, as for completions
    encode_special_tokens: bool = True


class EmbeddingRequest(_Body):
    """OpenAI's `/v1/embeddings`: a text, texts, token ids or lists of token ids."""
    input: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None


class DecodeRequest(_Body):
    """`/v1/token/decode` (TabbyAPI's)."""
    tokens: list[int]
    decode_special_tokens: bool = True
