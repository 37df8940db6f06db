"""Pydantic v2 models for everything a user configures: the engine, sampling, conversion, the server."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)

KV_CACHE_MODES = ("fp16", "q8", "q6", "q4", "q3", "q2")
# exllamav2's integer cache codes: 0 = 16-bit, 1 = 8-bit, 2 = 4-bit, 3 = 2-bit.
KV_CACHE_CODES = {0: "fp16", 1: "q8", 2: "q4", 3: "q2"}
# YaRN computes every frequency for the longer context itself; exllamav2 also never stacks -ry on -rs/-ra.
ROPE_YARN_EXCLUSIVE = ("rope_yarn cannot be combined with rope_scale or rope_alpha, because YaRN sets every "
                       "frequency itself")


def rope_factor_problem(name: str, value: Optional[float]) -> Optional[str]:
    """One sentence on why `value` is no RoPE factor (None: it is one, or unset); shared by EngineConfig and
    the command line so both say the same."""
    if value is not None and not (math.isfinite(value) and value > 0):
        return f"{name} must be a positive number, not {value}"
    return None


# prompt tokens one generator step prefills at most: EngineConfig.chunk_size and the CLI generator's --chunk-size
CHUNK_DEFAULT, CHUNK_MIN, CHUNK_MAX = 2048, 256, 16384


class LoraSpec(BaseModel):
    """A LoRA adapter to apply at runtime: its PEFT directory and the factor its update is scaled by."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Path
    scaling: float = Field(1.0, ge=0.0, allow_inf_nan=False)


class EngineConfig(BaseModel):
    """How to load and run one model."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    model_dir: Path = Field(validation_alias=AliasChoices("model_dir", "model_directory"))
    # the engine caps it at what the model's RoPE covers (with -rs/-ra/-ry it may exceed the native context)
    max_seq_len: int = Field(4096, ge=512, le=1 << 20)
    gpu_split: Optional[Union[list[float], Literal["auto"]]] = None
    # shard every layer over the GPUs gpu_split lists (budget above 0), or over every visible GPU (runtime.tp)
    tensor_parallel: bool = False
    kv_cache_mode: str = "fp16"
    # prompt attention through PyTorch's flash/cuDNN SDPA or the flash_attn package where they apply; False keeps
    # it in the engine's own Triton flash-attention kernel (decode attention is always the engine's kernel)
    flash_attention_enabled: bool = True
    # prompt-sized matmuls of quantized weights in FP8 (e4m3 weights and inputs, one scale a column and a row) on
    # GPUs that have it (sm_89+): faster prompts, slightly different numbers; decoding stays exact (fp8_prefill)
    prefill_fp8: bool = False
    device: Optional[str] = None
    max_batch_size: int = Field(16, ge=1, le=256)
    cache_size: Optional[int] = Field(None, ge=512)   # tokens of KV cache all requests share; default max_seq_len
    # GB of host memory for cached prompt pages the GPU cache evicts (TabbyAPI's sysmem_kv_cache): copied back when a
    # later prompt starts with them instead of computed again; 0: none
    host_cache_gb: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    # prompt tokens a generator step prefills at most (TabbyAPI's chunk_size): smaller chunks need less activation
    # memory and let running replies go on between a long prompt's chunks; larger ones prefill faster
    chunk_size: int = Field(CHUNK_DEFAULT, ge=CHUNK_MIN, le=CHUNK_MAX)
    # decode steps replayed from CUDA graphs (batch sizes 1, 2, 4, ... up to max_batch_size); False runs them eagerly:
    # slower, but no capture time or graph memory, and easier to profile or debug (exllamav2's -ng)
    cuda_graphs: bool = True
    # Speculative decoding (while at most max_draft_batch requests decode): guesses from n-grams of each request's
    # own text or from a small model with the same tokenizer, checked num_draft_tokens at a time.
    ngram_draft: bool = False
    draft_model_dir: Optional[Path] = None
    num_draft_tokens: int = Field(4, ge=1, le=16)
    max_draft_batch: int = Field(8, ge=1, le=256)   # and fewer guesses past 3 (DynamicGenerator.check_guesses)
    # drafting pauses for a while where its guesses are rarely kept (a check then costs more than it saves);
    # False drafts every step (TabbyAPI's dynamic_draft is the same idea)
    adaptive_draft: bool = Field(True, validation_alias=AliasChoices("adaptive_draft", "dynamic_draft"))
    # the draft model's RoPE overrides (TabbyAPI's draft_rope_scale / draft_rope_alpha); unset, a draft model whose
    # native context is shorter than max_seq_len gets an NTK alpha for the difference (speculative.draft_rope)
    draft_rope_scale: Optional[float] = None
    draft_rope_alpha: Optional[float] = None
    # RoPE overrides (exllamav2's -rs/-ra/-ry), None = the model's own config.json. rope_scale divides positions
    # (linear interpolation), rope_alpha multiplies the base by alpha^(d/(d-2)) (NTK-aware), rope_yarn is a YaRN
    # factor over the native context. max_seq_len may then exceed max_position_embeddings: up to native × scale or
    # × yarn; with rope_alpha the max_seq_len given is taken as is (alpha defines no length), as exllamav2 does.
    rope_scale: Optional[float] = None
    rope_alpha: Optional[float] = None
    rope_yarn: Optional[float] = None
    # LoRA adapters applied to the model (not the draft model) from the start; Engine.set_loras changes them
    loras: list[LoraSpec] = Field(default_factory=list)
    # experts a mixture-of-experts model routes each token to (exllamav2's -ept); None = config.json's count
    experts_per_token: Optional[int] = Field(None, ge=1)
    # how Engine.embed pools hidden states into a vector: "last" (decoder embedding models), "mean" or "cls";
    # None = the model's sentence-transformers 1_Pooling/config.json, else "last"
    embedding_pooling: Optional[Literal["last", "mean", "cls"]] = None
    # the chat template: a bundled name (chatml, alpaca), a name tokenizer_config.json lists (tool_use, rag), or a
    # .jinja file's path; None = the model's own (ChatML where it has none). generation.templates
    prompt_template: Optional[str] = None
    # load the model's vision tower so chat messages may hold images (Mistral 3.1/3.2); off by default, as
    # TabbyAPI's `vision`, since the tower takes memory that text-only use does not need
    vision: bool = False
    # Gemma 3: cut images much wider or taller than square into crops read besides the whole (pan-and-scan);
    # None = as the model's processor config says (off in the published ones)
    pan_and_scan: Optional[bool] = None

    @field_validator("rope_scale", "rope_alpha", "rope_yarn", "draft_rope_scale", "draft_rope_alpha")
    @classmethod
    def _rope(cls, v: Optional[float], info: ValidationInfo) -> Optional[float]:
        # a field validator, not a model one, so that the error names the field (the CLI reports loc[0])
        problem = rope_factor_problem(info.field_name, v)
        if problem is None and info.field_name == "rope_yarn" and v is not None and (
                info.data.get("rope_scale") is not None or info.data.get("rope_alpha") is not None):
            problem = ROPE_YARN_EXCLUSIVE
        if problem is not None:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _cache_size(self):
        if self.cache_size is not None and self.cache_size < self.max_seq_len:
            raise ValueError(f"cache_size ({self.cache_size}) must be at least max_seq_len ({self.max_seq_len})")
        if self.ngram_draft and self.draft_model_dir is not None:
            raise ValueError("choose ngram_draft or a draft_model_dir, not both")
        if self.tensor_parallel and self.device is not None and not self.device.startswith("cuda"):
            raise ValueError(f"tensor_parallel runs on CUDA GPUs and cannot be combined with device {self.device!r}")
        if self.tensor_parallel and isinstance(self.gpu_split, list) and sum(x > 0 for x in self.gpu_split) < 2:
            raise ValueError("tensor_parallel needs at least two GPUs with a budget above 0 in gpu_split")
        return self

    @field_validator("gpu_split")
    @classmethod
    def _split(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("gpu_split must list at least one GPU (or be 'auto')")
            if any(x < 0 for x in v) or not any(x > 0 for x in v):
                raise ValueError("gpu_split entries must be GB per GPU (0 skips a GPU), at least one above 0")
        return v

    @field_validator("kv_cache_mode", mode="before")
    @classmethod
    def _cache_mode(cls, v):
        if isinstance(v, bool):
            raise ValueError("kv_cache_mode must be a mode name or an integer code")
        if isinstance(v, int):
            if v not in KV_CACHE_CODES:
                raise ValueError(f"kv_cache_mode code must be one of {sorted(KV_CACHE_CODES)}")
            return KV_CACHE_CODES[v]
        if isinstance(v, str) and v.lower() in KV_CACHE_MODES:
            return v.lower()
        raise ValueError(f"kv_cache_mode must be one of {', '.join(KV_CACHE_MODES)} or 0-3")


class SamplingSettings(BaseModel):
    """Token sampling; temperature 0 means greedy."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(0.8, ge=0.0, le=10.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    # the repetition penalty over the last repetition_range tokens of the text only (0: all of it), fading
    # linearly to nothing over the repetition_decay tokens before them (exllamav2's range and decay)
    repetition_range: int = Field(0, ge=0)
    repetition_decay: int = Field(0, ge=0)
    # OpenAI's: subtracted from a token's logit per time the reply has it (frequency) or once if it has (presence)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit before everything else
    banned_tokens: Optional[tuple[int, ...]] = None   # never sampled (ids past the vocabulary are ignored)
    allowed_tokens: Optional[tuple[int, ...]] = None  # only these are sampled (None or no valid id: any)
    # exllamav2's banned strings (matched ignoring case): text that could become one is held back, and when one
    # appears the reply is taken back to the token where it began, which is then banned there (not with a grammar)
    banned_strings: Optional[tuple[str, ...]] = None
    # exllamav2's token healing: the prompt's last token is taken off and the reply's first token must begin with
    # its text, so a prompt that ends mid-word ("The capital of Fr") continues as the model would tokenize it
    token_healing: bool = False
    seed: Optional[int] = None
    # exllamav2's and TabbyAPI's further samplers, each off at its default. Order (exllamav2's): penalties,
    # logit_bias, DRY; temperature (dynamic temperature or smoothing in its place; after the truncations with
    # temperature_last); top-k, top-p, top-a, min-p, tail-free, typical, mirostat; XTC; the draw.
    top_a: float = Field(0.0, ge=0.0, le=1.0)          # drop tokens with p < top_a · p_max²
    tfs: float = Field(1.0, ge=0.0, le=1.0)            # tail-free sampling's z; 1 (or 0) = off
    typical: float = Field(1.0, ge=0.0, le=1.0)        # locally typical sampling's mass; 1 (or 0) = off
    smoothing_factor: float = Field(0.0, ge=0.0)       # quadratic sampling: logit → max − factor · (logit − max)²
    temperature_last: bool = False                     # apply the temperature after the truncations
    # dynamic temperature: min_temp + (max_temp − min_temp) · (entropy / max entropy)^temp_exponent replaces
    # `temperature` when max_temp > min_temp
    min_temp: float = Field(1.0, ge=0.0, le=10.0)
    max_temp: float = Field(1.0, ge=0.0, le=10.0)
    temp_exponent: float = Field(1.0, gt=0.0)
    # XTC ("exclude top choices"): with this probability a draw drops every token of probability ≥ the threshold
    # except the least likely of them (when at least two qualify); the tokens of xtc_ignore_tokens are never dropped
    # (None: those whose text holds a newline, and the special tokens)
    xtc_probability: float = Field(0.0, ge=0.0, le=1.0)
    xtc_threshold: float = Field(0.1, ge=0.0, le=1.0)
    xtc_ignore_tokens: Optional[tuple[int, ...]] = None
    # exllamav2's skew: the draw walks the filtered distribution from its likeliest token to the point
    # u^exp(-skew) of its mass (u uniform): > 0 leans toward less likely tokens, < 0 toward likelier ones; 0 = off
    skew: float = Field(0.0, ge=-10.0, le=10.0, allow_inf_nan=False)
    # DRY: a token that would extend a repeat of n ≥ dry_allowed_length tokens of the text loses
    # dry_multiplier · dry_base^(n − dry_allowed_length) from its logit; sequence breakers (tokens whose text
    # holds one of these strings; None: exllamav2's punctuation set and the special tokens) end a repeat
    dry_multiplier: float = Field(0.0, ge=0.0)
    dry_base: float = Field(1.75, ge=1.0)
    dry_allowed_length: int = Field(2, ge=1)
    dry_range: int = Field(0, ge=0)                    # tokens of the text DRY looks back over; 0: all of it
    dry_max_ngram: int = Field(20, ge=1, le=1024)      # the longest repeat DRY measures (longer ones count as this)
    dry_sequence_breakers: Optional[tuple[str, ...]] = None
    # Mirostat 2.0: truncates to the tokens of surprise ≤ μ and steers μ (starting at 2·tau) toward tau by eta
    mirostat_mode: int = 0
    mirostat_tau: float = Field(1.5, gt=0.0)
    mirostat_eta: float = Field(0.1, gt=0.0)
    # classifier-free guidance (exllamav2's cfg_scale): sample from s·log p(token | prompt) + (1 − s)·log p(token |
    # negative prompt); 1 = off, > 1 steers away from the negative prompt (default: the BOS token alone)
    cfg_scale: float = Field(1.0, ge=-100.0, le=100.0, allow_inf_nan=False)

    @field_validator("xtc_ignore_tokens")
    @classmethod
    def _xtc_ignore(cls, v: Optional[tuple[int, ...]]) -> Optional[tuple[int, ...]]:
        if v is not None and any(t < 0 for t in v):    # () stays (): XTC may then drop any token
            raise ValueError("xtc_ignore_tokens must be token ids (non-negative integers)")
        return v

    @field_validator("banned_tokens", "allowed_tokens")
    @classmethod
    def _token_ids(cls, v: Optional[tuple[int, ...]], info: ValidationInfo) -> Optional[tuple[int, ...]]:
        if v is not None and any(t < 0 for t in v):
            raise ValueError(f"{info.field_name} must be token ids (non-negative integers)")
        return v or None

    @field_validator("banned_strings")
    @classmethod
    def _banned_strings(cls, v: Optional[tuple[str, ...]]) -> Optional[tuple[str, ...]]:
        if v is not None and any(not b for b in v):
            raise ValueError("banned_strings must not contain empty strings")
        return v or None

    @field_validator("mirostat_mode")
    @classmethod
    def _mirostat(cls, v: int) -> int:
        if v not in (0, 2):
            raise ValueError("mirostat_mode must be 0 (off) or 2 (Mirostat 2.0)")
        return v

    @field_validator("dry_sequence_breakers")
    @classmethod
    def _breakers(cls, v: Optional[tuple[str, ...]]) -> Optional[tuple[str, ...]]:
        if v is not None and any(not b for b in v):
            raise ValueError("dry_sequence_breakers must not contain empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_values(cls, v: Optional[dict[int, float]]) -> Optional[dict[int, float]]:
        if v is not None and any(not -100.0 <= b <= 100.0 for b in v.values()):
            raise ValueError("logit_bias values must be between -100 and 100")
        if v is not None and any(t < 0 for t in v):
            raise ValueError("logit_bias keys must be token ids (non-negative integers)")
        return v or None

    @property
    def counts_tokens(self) -> bool:
        """Whether sampling needs the reply's token counts (frequency or presence penalty)."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def ranged_penalty(self) -> bool:
        """Whether the repetition penalty looks at a window of the text rather than all of it."""
        return self.repetition_penalty != 1.0 and self.repetition_range > 0

    @property
    def dynamic_temperature(self) -> bool:
        return self.max_temp > self.min_temp

    @property
    def dry(self) -> bool:
        return self.dry_multiplier > 0.0

    @property
    def mirostat(self) -> bool:
        return self.mirostat_mode == 2

    @property
    def extended(self) -> bool:
        """Whether a sampled (non-greedy) draw uses a sampler beyond penalties, temperature, top-k/p and min-p:
        those run on the PyTorch path (`generation.truncation`)."""
        return not self.greedy and (
            0.0 < self.top_a or 0.0 < self.tfs < 1.0 or 0.0 < self.typical < 1.0 or self.smoothing_factor > 0.0
            or self.temperature_last or self.dynamic_temperature or self.xtc_probability > 0.0 or self.mirostat
            or self.skew != 0.0)


class ServerConfig(BaseModel):
    """The OpenAI-compatible HTTP server (`exl2 serve`) and the MCP server's HTTP transport (`exl2 mcp`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(5000, ge=0, le=65535)
    api_keys: tuple[str, ...] = ()           # empty: no authentication
    model_name: Optional[str] = None         # the id /v1/models reports; default: the model directory's name
    max_tokens: int = Field(1024, ge=1)      # completion length when a request names none
    # Chat replies' `<think>` blocks as `reasoning_content` (Qwen3, DeepSeek-R1); None: on when the template has one
    reasoning_parser: Optional[bool] = None
    # whether a chat reply starts inside a think block (TabbyAPI's start_in_reasoning): "auto" reads it from the
    # rendered prompt (it ends with an open <think>), "always" / "never" for templates that open it elsewhere
    start_in_reasoning: Literal["auto", "always", "never"] = "auto"
    # the tags around reasoning (TabbyAPI's reasoning_start_token / reasoning_end_token), both or neither; None:
    # the pair the chat template writes (<think>…</think>, Magistral's [THINK]…[/THINK]), else <think>…</think>
    reasoning_start_token: Optional[str] = Field(None, min_length=1)
    reasoning_end_token: Optional[str] = Field(None, min_length=1)
    # chat-template variables for every chat request (TabbyAPI's template_vars_default / template_vars_force): a
    # request's template_vars / chat_template_kwargs replace the defaults, never the forced ones
    template_vars_default: dict[str, Any] = Field(default_factory=dict)
    template_vars_force: dict[str, Any] = Field(default_factory=dict)
    cors_origins: tuple[str, ...] = ()       # browser origins allowed to call the API ('*': any); empty: no CORS
    # Model management (POST /v1/model/load, /v1/model/unload): keys that may load and unload models (they pass
    # the api_keys check too). None configured: allowed to everyone if api_keys is empty too, else to no one.
    admin_keys: tuple[str, ...] = ()
    model_dir_root: Optional[Path] = None    # the models /v1/model/list shows and /v1/model/load loads by name
    # TabbyAPI's inline loading: a completion or chat request whose `model` names another model of model_dir_root
    # loads it (with the load defaults) before it is answered; /v1/models then lists every model of the root
    inline_model_loading: bool = False
    lora_dir: Optional[Path] = None          # the LoRA adapters /v1/lora/list shows and /v1/lora/load loads by name
    # TabbyAPI's sampler overrides: request-field defaults and forced values for every request (server.overrides);
    # a preset name in sampler_override_dir or a preset file's path
    sampler_override: Optional[str] = None
    sampler_override_dir: Optional[Path] = None
    # the chat templates (`NAME.jinja`) /v1/template/list shows and prompt_template names load (TabbyAPI's templates/)
    template_dir: Optional[Path] = None
    kobold: bool = False                     # also serve TabbyAPI's KoboldAI API under /api (server/kobold.py)
    # TabbyAPI's logging switches: each completion request's prompt, and its sampling settings (those not at their
    # defaults) with max_tokens and stop strings, as INFO lines of the exl2.server logger
    log_prompt: bool = False
    log_generation_params: bool = False
    # seconds between the keep-alive comments of a streamed reply (TabbyAPI's sse_ping_interval), which keep proxies
    # from closing a stream that waits (a long prompt, a queue); 0: none
    sse_ping_interval: float = Field(15.0, ge=0.0, allow_inf_nan=False)

    @field_validator("api_keys", "admin_keys")
    @classmethod
    def _keys(cls, v, info: ValidationInfo):
        if any(not k.strip() for k in v):
            raise ValueError(f"{info.field_name} must not contain empty keys")
        return v

    @model_validator(mode="after")
    def _inline_loading(self):
        if self.inline_model_loading and self.model_dir_root is None:
            raise ValueError("inline_model_loading loads models by name from model_dir_root, which is not set")
        if (self.reasoning_start_token is None) != (self.reasoning_end_token is None):
            raise ValueError("reasoning_start_token and reasoning_end_token go together: give both or neither")
        return self

    @field_validator("template_vars_default", "template_vars_force")
    @classmethod
    def _template_vars(cls, v: dict, info: ValidationInfo) -> dict:
        bad = next((k for k in v if not k.isidentifier() or k in ("messages", "tools", "add_generation_prompt")),
                   None)
        if bad is not None:
            raise ValueError(f"{info.field_name} cannot set {bad!r}: the server passes messages, tools and "
                             "add_generation_prompt itself, and names must be identifiers")
        return v

    @field_validator("model_dir_root", "lora_dir", "sampler_override_dir", "template_dir")
    @classmethod
    def _root(cls, v: Optional[Path]) -> Optional[Path]:
        if v is not None and not v.is_dir():
            raise ValueError(f"{v} is not a directory" if v.exists() else f"{v} does not exist")
        return v

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, v):
        # Browsers send the origin as scheme://host[:port]; anything else (a path, a trailing slash) never matches.
        def origin(o: str) -> bool:
            scheme, sep, host = o.partition("://")
            good_scheme = scheme[:1].isalpha() and scheme.isascii() and all(c.isalnum() or c in "+.-" for c in scheme)
            return bool(good_scheme and sep and host) and not any(c in host for c in "/?# ")

        bad = next((o for o in v if o != "*" and not origin(o)), None)
        if bad is not None:
            raise ValueError(f"entry {bad!r} is not '*' or an origin such as 'http://localhost:3000' "
                             "(scheme and host, no path or trailing slash)")
        return v
