"""OpenAI's `/v1/embeddings` on the served model (`Engine.embed`), or on an embedding model loaded beside it
(`exl2 serve --embedding-model`): meant for decoder embedding models such as Qwen3-Embedding; any causal LM answers
too, with its pooled hidden states."""
from __future__ import annotations

import asyncio
import base64

from fastapi import APIRouter, Request

from exl2.errors import ConfigError, ContextLengthError
from exl2.server.errors import APIError
from exl2.server.host import acquire, serving
from exl2.server.schemas import EmbeddingRequest

router = APIRouter()
MAX_INPUTS = 2048    # OpenAI's limit on the inputs of one request


def _inputs(body: EmbeddingRequest) -> list[str | list[int]]:
    """The request's inputs as texts or token id lists (a flat id list is one input, as in OpenAI's API)."""
    x = body.input
    if isinstance(x, str):
        items = [x]
    elif x and all(isinstance(t, int) for t in x):
        items = [list(x)]
    else:
        items = list(x)
    if not items:
        raise APIError(400, "input must hold at least one text or token list.", param="input")
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"input holds {len(items)} items; at most {MAX_INPUTS} are embedded per request.",
                       param="input")
    return items


async def acquire_unless_embedder(request: Request) -> None:
    """The route's dependency: with an embedding model of its own the served model is not needed (none may be
    loaded yet); otherwise the served model is pinned as for the other engine routes (`host.acquire`)."""
    if request.app.state.exl2_embedder is None:
        await acquire(request)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    """One vector per input: floats, or with `encoding_format: "base64"` their little-endian float32 bytes."""
    embedder = request.app.state.exl2_embedder
    if embedder is not None:     # an embedding model of its own (exl2 serve --embedding-model)
        engine, name = embedder, embedder.model_name
    else:
        st = serving(request)
        engine, name = st.engine, st.name
    items = _inputs(body)
    vocab = engine.tokenizer.vocab_size
    for i, item in enumerate(items):
        bad = next((t for t in item if not 0 <= t < vocab), None) if isinstance(item, list) else None
        if bad is not None:
            raise APIError(400, f"Token id {bad} of input {i} is outside the vocabulary (0 to {vocab - 1}).",
                           param="input")
    try:
        result = await asyncio.to_thread(engine.embed, items, body.dimensions)
    except ContextLengthError as e:
        raise APIError(400, str(e), param="input", code="context_length_exceeded") from None
    except ConfigError as e:
        raise APIError(400, str(e), param="dimensions" if "dimensions" in str(e) else "input") from None
    vectors = result.vectors
    data = []
    for i, v in enumerate(vectors):
        emb = base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() if body.encoding_format == "base64" \
            else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    tokens = sum(result.tokens)
    return {"object": "list", "data": data, "model": name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
