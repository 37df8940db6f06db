"""Fill-in-the-middle prompts for code models: the text before and after a gap laid out with the model's own
FIM tokens, so that the reply is what goes in between (OpenAI's legacy completions `suffix`).

Each family names its tokens differently and some put the suffix first; the tokenizer's vocabulary says which
family a model belongs to. The prefix and suffix are tokenized as plain text (special-token text inside them
stays text), and the FIM tokens are added by id.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from exl2.errors import ConfigError


@dataclass(frozen=True)
class FimFormat:
    """The marker before the prefix, before the suffix and before the middle (None: the family has none), and
    whether the suffix comes first (suffix-prefix-middle order)."""

    prefix: str
    suffix: str
    middle: Optional[str]
    suffix_first: bool = False


FORMATS = (
    FimFormat("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),       # Qwen2.5-Coder, Qwen3-Coder
    FimFormat("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),             # StarCoder 1/2, SantaCoder, Granite code
    FimFormat("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),          # DeepSeek-Coder (V1, V2)
    FimFormat("[PREFIX]", "[SUFFIX]", None, suffix_first=True),           # Codestral: [SUFFIX] s [PREFIX] p
)


def fim_format(tokenizer) -> Optional[FimFormat]:
    """The FIM format whose markers are all single tokens of this tokenizer, or None."""
    for fmt in FORMATS:
        markers = [fmt.prefix, fmt.suffix] + ([fmt.middle] if fmt.middle else [])
        if all(tokenizer.token_to_id(m) is not None for m in markers):
            return fmt
    return None


def fim_prompt(tokenizer, prefix: str, suffix: str) -> list[int]:
    """Token ids asking the model for the text between `prefix` and `suffix` (BOS first where the model wants
    one). ConfigError (one sentence) when the tokenizer has no FIM tokens."""
    fmt = fim_format(tokenizer)
    if fmt is None:
        raise ConfigError("This model's tokenizer has no fill-in-the-middle tokens, so it cannot complete text "
                          "between a prompt and a suffix.")
    mark = tokenizer.token_to_id
    pre = [mark(fmt.prefix), *tokenizer.encode(prefix, add_bos=False, special=False)]
    suf = [mark(fmt.suffix), *tokenizer.encode(suffix, add_bos=False, special=False)]
    ids = (suf + pre) if fmt.suffix_first else (pre + suf)
    if fmt.middle:
        ids.append(mark(fmt.middle))
    if tokenizer.add_bos and tokenizer.bos_id is not None:
        ids.insert(0, tokenizer.bos_id)
    return ids
