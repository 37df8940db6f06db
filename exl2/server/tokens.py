"""Tokenizer endpoints (TabbyAPI's): `/v1/token/encode` counts and lists the tokens of a text or of chat messages
as the template renders them, `/v1/token/decode` turns ids back into text. Clients use them to fit prompts into
the context window without a tokenizer of their own."""
from __future__ import annotations

from fastapi import APIRouter, Request

from exl2.errors import Exl2Error
from exl2.server.errors import APIError
from exl2.server.host import serving
from exl2.server.messages import template_messages
from exl2.server.schemas import DecodeRequest, EncodeRequest

router = APIRouter()


@router.post("/v1/token/encode")
async def encode(body: EncodeRequest, request: Request):
    """`{tokens, length}` of a string, or of chat messages rendered without the reply's opening."""
    engine = serving(request).engine
    text = body.text
    if not isinstance(text, str):
        try:
            text = engine.chat_prompt(template_messages(text), None, add_generation_prompt=False)
        except Exl2Error as e:
            raise APIError(400, str(e), param="text") from e
    ids = engine.tokenizer.encode(text, add_bos=body.add_bos_token, special=body.encode_special_tokens)
    return {"tokens": ids, "length": len(ids)}


@router.post("/v1/token/decode")
async def decode(body: DecodeRequest, request: Request):
    """`{text}` of token ids; ids outside the vocabulary are a 400 naming the first one."""
    tokenizer = serving(request).engine.tokenizer
    vocab = tokenizer.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"Token id {body.tokens[bad]} is outside the vocabulary (0 to {vocab - 1}).",
                       param=f"tokens[{bad}]")
    return {"text": tokenizer.decode(body.tokens, skip_special=not body.decode_special_tokens)}
