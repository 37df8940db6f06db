"""The engine as an MCP tool server (FastMCP 3.x): generate, chat, tokenize, detokenize and model_info.

Generation tools stream MCP progress notifications (tokens so far out of max_tokens) so a client can show that a
long completion is moving. User errors (bad settings, a prompt too long for the context) come back as tool errors
carrying one sentence, never as tracebacks.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Annotated, Any, Literal, Optional, Sequence

from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12

from fastmcp import Context, FastMCP
from fastmcp.server.auth.providers.jwt import StaticTokenVerifier
from fastmcp.exceptions import ToolError
from fastmcp.exceptions import ValidationError as ArgumentError
from fastmcp.server.middleware import Middleware
from pydantic import BaseModel, Field, ValidationError

from exl2.config import SamplingSettings
from exl2.errors import Exl2Error
from exl2.generation.multimodal import VideoSource, with_images

# At most one progress notification per interval: a fast GPU makes hundreds of tokens a second, more than any
# client wants to render. The final count is always sent.
PROGRESS_INTERVAL_S = 0.05

_READ_ONLY = {"readOnlyHint": True, "openWorldHint": False}


class Completion(TypedDict):
    text: str
    finish_reason: str          # "stop" (end of sequence or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


MaxTokens = Annotated[int, Field(ge=1, description="maximum number of tokens to generate")]
Temperature = Annotated[float, Field(description="sampling temperature; 0 = greedy (deterministic)")]
TopP = Annotated[float, Field(description="nucleus sampling cutoff in (0, 1]; 1 = off")]
TopK = Annotated[int, Field(description="keep only the k most likely tokens; 0 = off")]
MinP = Annotated[float, Field(description="drop tokens below min_p times the top probability; 0 = off")]
Seed = Annotated[Optional[int], Field(description="random seed for reproducible sampling")]
RepetitionPenalty = Annotated[float, Field(description="penalty on tokens already in the text, > 0; 1 = off")]
JsonSchema = Annotated[Optional[dict[str, Any]],
                       Field(description="structured output: the reply is JSON matching this JSON schema "
                                         "({} = any JSON object)")]


def one_sentence(e: ValidationError) -> str:
    """The first problem of a pydantic error, naming the argument: 'Invalid top_p: input should be ...'."""
    err = e.errors(include_url=False)[0]
    where = ".".join(str(x) for x in err["loc"]) or "arguments"
    msg = err["msg"]
    return f"Invalid {where}: {msg[:1].lower() + msg[1:]}."


def sampling_settings(**values: Any) -> SamplingSettings:
    """SamplingSettings from tool arguments; an invalid value becomes a ToolError naming the argument."""
    try:
        return SamplingSettings(**values)
    except ValidationError as e:
        raise ToolError(one_sentence(e)) from None


class ArgumentErrors(Middleware):
    """Arguments that do not match a tool's schema: one sentence instead of pydantic's multi-line report."""

    async def on_call_tool(self, context, call_next):
        try:
            return await call_next(context)
        except ArgumentError as e:
            if isinstance(e.__cause__, ValidationError):
                raise ToolError(one_sentence(e.__cause__)) from None
            raise


def reply_grammar(engine, schema: Optional[dict[str, Any]]):
    """The structured-output grammar of a tool call's json_schema (None: free text); a schema the engine cannot
    use is a ToolError."""
    if schema is None:
        return None
    try:
        return engine.json_grammar(schema or None)
    except Exl2Error as e:
        raise ToolError(str(e)) from None


async def stream_completion(engine, ctx: Optional[Context], prompt: str | list[int], settings: SamplingSettings,
                            max_tokens: int, stop: list[str], add_bos: Optional[bool], grammar=None,
                            images: tuple = ()) -> Completion:
    """Run one generation through engine.aevents, reporting progress; engine errors become ToolErrors. `images`:
    those whose tokens a chat prompt's ids hold (`Engine.chat_input`)."""
    events = engine.aevents(prompt, settings, max_tokens, stop, add_bos, grammar, images=images)
    sent, chunks, last_t = 0, 0, 0.0
    result = None
    try:
        async with contextlib.aclosing(events):  # closing early (client cancelled) cancels the engine request
            async for text, result in events:
                if result is not None or not text:
                    continue
                chunks += 1
                now = time.monotonic()
                if ctx is not None and chunks > sent and now - last_t >= PROGRESS_INTERVAL_S:
                    await ctx.report_progress(progress=chunks, total=max_tokens)
                    sent, last_t = chunks, now
    except Exl2Error as e:
        raise ToolError(str(e)) from None
    if result is None:
        raise ToolError("The engine stopped without a result.")
    n = len(result.token_ids)
    if ctx is not None and n > sent:  # progress must only grow; the last notification is the final count
        await ctx.report_progress(progress=n, total=max_tokens, message=f"done ({result.finish_reason})")
    return Completion(text=result.text, finish_reason=result.finish_reason, prompt_tokens=result.prompt_tokens,
                      completion_tokens=n)


def weight_format(model) -> str:
    """'EXL2 4.0 bpw', 'GPTQ 4-bit', 'fp16', ... from the model directory, as `exl2 info` reports it."""
    from exl2.formats.safetensors_io import TensorSource

    qc = (getattr(model, "config_dict", None) or {}).get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    if method == "exl2":
        return f"EXL2 {qc['bits']} bpw" if qc.get("bits") else "EXL2"
    if method == "gptq":
        return f"GPTQ {qc.get('bits', 4)}-bit"
    model_dir = getattr(model, "model_dir", None)
    if model_dir is None:
        return "unknown"
    src = TensorSource(model_dir)
    keys = list(src.keys())
    if any(k.endswith(".q_weight") for k in keys):
        return "EXL2"
    if any(k.endswith(".qweight") for k in keys):
        return "GPTQ"
    for k in keys:
        if k.endswith(".weight"):
            name = src.dtype_name(k)
            return {"F16": "fp16", "BF16": "bf16", "F32": "fp32"}.get(name, name)
    return "unknown"


def build_server(engine, name: Optional[str] = None, api_keys: Sequence[str] = ()) -> FastMCP:
    """A FastMCP server whose tools run on `engine` (concurrent calls go to the engine as they come). With
    `api_keys`, its HTTP transport answers only requests bearing one of them (`Authorization: Bearer KEY`)."""
    auth = StaticTokenVerifier({k: {"client_id": "exl2", "scopes": []} for k in api_keys}) if api_keys else None
    mcp = FastMCP(name or f"exl2 ({engine.model_name})",
                  instructions=f"Local language model {engine.model_name} served by exl2: plain completion "
                               "(generate), chat through the model's template (chat), embedding vectors (embed), "
                               "and its tokenizer.",
                  middleware=[ArgumentErrors()], auth=auth)

    @mcp.tool(annotations=_READ_ONLY)
    async def generate(prompt: str, ctx: Context, max_tokens: MaxTokens = 256, temperature: Temperature = 0.8,
                       top_p: TopP = 1.0, top_k: TopK = 0, min_p: MinP = 0.0, seed: Seed = None,
                       repetition_penalty: RepetitionPenalty = 1.0,
                       stop: Annotated[Optional[list[str]], Field(description="stop strings")] = None,
                       json_schema: JsonSchema = None) -> Completion:
        """Complete a prompt with the local model (no chat template); progress counts the generated tokens."""
        settings = sampling_settings(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                                     repetition_penalty=repetition_penalty)
        return await stream_completion(engine, ctx, prompt, settings, max_tokens, stop or [], None,
                                       reply_grammar(engine, json_schema))

    @mcp.tool(annotations=_READ_ONLY)
    async def chat(messages: list[ChatMessage], ctx: Context, max_tokens: MaxTokens = 512,
                   temperature: Temperature = 0.7, top_p: TopP = 1.0, top_k: TopK = 0, min_p: MinP = 0.0,
                   seed: Seed = None, repetition_penalty: RepetitionPenalty = 1.0,
                   system: Annotated[Optional[str], Field(description="system prompt put before the messages")] = None,
                   stop: Annotated[Optional[list[str]], Field(description="stop strings")] = None,
                   json_schema: JsonSchema = None,
                   images: Annotated[Optional[list[str]], Field(
                       description="images for the last user message, before its text: data URIs (base64) or "
                                   "http(s) URLs; needs a vision model served with --vision")] = None,
                   videos: Annotated[Optional[list[str]], Field(
                       description="videos for the last user message, after its images and before its text: data "
                                   "URIs (base64) or http(s) URLs of video files or animated images; needs a Qwen "
                                   "vision model served with --vision")] = None) -> Completion:
        """Answer a conversation with the local model through its chat template; progress counts tokens."""
        settings = sampling_settings(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                                     repetition_penalty=repetition_penalty)
        msgs = [m.model_dump() for m in messages]
        if not msgs:
            raise ToolError("messages must hold at least one message.")
        if system is not None:
            if msgs[0]["role"] == "system":
                raise ToolError("Give the system prompt either as `system` or as a first system message, not both.")
            msgs.insert(0, {"role": "system", "content": system})
        media = [*(images or ()), *(VideoSource(v) for v in videos or ())]
        if media:
            if msgs[-1]["role"] != "user":
                raise ToolError("images and videos go with the last message, which must then be the user's.")
            msgs[-1]["content"] = with_images(msgs[-1]["content"], media)
        try:
            if media:   # encoding them runs the vision tower: off the event loop
                prompt, shown = await asyncio.to_thread(engine.chat_input, msgs)
            else:
                prompt, shown = engine.chat_prompt(msgs), ()
        except Exl2Error as e:
            raise ToolError(str(e)) from None
        return await stream_completion(engine, ctx, prompt, settings, max_tokens, stop or [], False,
                                       reply_grammar(engine, json_schema), shown)

    @mcp.tool(annotations=_READ_ONLY)
    def tokenize(text: str) -> dict:
        """Token ids of a text as the model sees it (with BOS when the model adds one)."""
        ids = engine.tokenizer.encode(text)
        return {"ids": ids, "count": len(ids)}

    @mcp.tool(annotations=_READ_ONLY)
    def detokenize(ids: list[int]) -> str:
        """The text of a list of token ids."""
        vocab = engine.tokenizer.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ToolError(f"Token id {bad[0]} is outside the vocabulary (0 to {vocab - 1}).")
        return engine.tokenizer.decode(ids)

    @mcp.tool(annotations=_READ_ONLY)
    async def embed(texts: Annotated[list[str], Field(description="texts to embed", min_length=1, max_length=256)],
                    dimensions: Annotated[Optional[int], Field(description="keep the first N components", ge=1)]
                    = None) -> dict:
        """Embedding vectors of texts (the model's final hidden states pooled, normalised as its
        sentence-transformers files say), for similarity search; meant for embedding models."""
        try:
            result = await asyncio.to_thread(engine.embed, texts, dimensions)
        except Exl2Error as e:
            raise ToolError(str(e)) from None
        return {"embeddings": result.vectors.tolist(), "tokens": result.tokens}

    @mcp.tool(annotations=_READ_ONLY)
    def model_info() -> dict:
        """Name, architecture and size of the loaded model, its context length and KV cache mode."""
        spec = engine.model.spec
        info = {
            "name": engine.model_name,
            "architecture": spec.arch,
            "model_type": spec.model_type,
            "layers": spec.num_layers,
            "hidden_size": spec.hidden_size,
            "attention_heads": spec.num_heads,
            "kv_heads": spec.num_kv_heads,
            "vocab_size": spec.vocab_size,
            "context_length": min(engine.config.max_seq_len, spec.max_position),
            "max_position": spec.max_position,
            "cache_mode": engine.config.kv_cache_mode,
            "weight_format": weight_format(engine.model),
        }
        if spec.moe:
            info["experts"] = {"count": spec.moe.num_experts, "active": spec.moe.top_k}
        return info

    return mcp
