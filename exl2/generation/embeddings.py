"""Text embeddings from a decoder model: the final hidden states pooled into one vector per text.

Decoder embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral) are causal LMs read at their last token;
sentence-transformers' `1_Pooling/config.json` says which pooling a model was trained with and `modules.json`
whether its vectors are L2-normalised. Texts are batched right-padded: a causal model's real tokens never see
the padding, so each row's last real position (or its mean over real positions) is exact.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch

from exl2.errors import ConfigError, ContextLengthError

PoolingMode = Literal["last", "mean", "cls"]
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
BATCH_TOKENS = 8192     # padded tokens per forward


@dataclass(frozen=True)
class Pooling:
    """How hidden states become one vector: the position(s) read, and whether the vector is L2-normalised."""

    mode: PoolingMode = "last"
    normalize: bool = True

    @classmethod
    def from_dir(cls, model_dir: Path | str, mode: Optional[PoolingMode] = None) -> "Pooling":
        """The model's sentence-transformers pooling (default: last token, normalised, what decoder embedding
        models use); `mode` overrides it."""
        d = Path(model_dir)
        pooling = _read_json(d / "1_Pooling" / "config.json")
        found = next((m for key, m in _MODES.items() if pooling.get(key)), None)
        normalize = True
        modules = _read_json(d / "modules.json")
        if isinstance(modules, list) and modules:
            normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules if isinstance(m, dict))
        return cls(mode or found or "last", normalize)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


@dataclass
class EmbeddingResult:
    """The vectors of several inputs [N, D] (float32, CPU) and each input's token count."""

    vectors: torch.Tensor
    tokens: list[int]


def input_ids(tokenizer, inputs: Sequence[str | Sequence[int]]) -> list[list[int]]:
    """Texts tokenized as the model's tokenizer post-processes a document (`Tokenizer.encode_document`: how
    embedding models were trained to see a text); token id lists as they are."""
    return [tokenizer.encode_document(x) if isinstance(x, str) else [int(t) for t in x] for x in inputs]


@torch.inference_mode()
def embed(model, inputs: Sequence[Sequence[int]], pooling: Pooling, dimensions: Optional[int] = None,
          max_len: Optional[int] = None, batch_tokens: int = BATCH_TOKENS, pooled=None) -> torch.Tensor:
    """[N, H] float32 vectors of the token id lists `inputs` (on the CPU). `dimensions` keeps the first that many
    components (Matryoshka-trained models), normalised again where the pooling normalises. An empty input, one
    longer than `max_len`, or a `dimensions` outside 1..H is a one-sentence error. `pooled(model, rows, mode)`
    runs one forward of a batch (default: a decoder's, `_pooled`)."""
    check_inputs(inputs, model.spec.hidden_size, dimensions, max_len)
    out = torch.empty(len(inputs), model.spec.hidden_size, dtype=torch.float32)
    for batch in batches([len(x) for x in inputs], batch_tokens):
        out[batch] = (pooled or _pooled)(model, [inputs[i] for i in batch], pooling.mode).float().cpu()
    if dimensions is not None:
        out = out[:, :dimensions].contiguous()
    return torch.nn.functional.normalize(out, dim=-1) if pooling.normalize else out


def check_inputs(inputs: Sequence[Sequence[int]], hidden_size: int, dimensions: Optional[int] = None,
                 max_len: Optional[int] = None) -> None:
    """One-sentence errors for what `embed` cannot do: `dimensions` outside 1..hidden_size, an empty input, an
    input longer than `max_len`."""
    if dimensions is not None and not 1 <= dimensions <= hidden_size:
        raise ConfigError(f"dimensions must be between 1 and {hidden_size} for this model, not {dimensions}.")
    for i, ids in enumerate(inputs):
        if not ids:
            raise ConfigError(f"Input {i} is empty; there is nothing to embed.")
        if max_len is not None and len(ids) > max_len:
            raise ContextLengthError(f"Input {i} is {len(ids)} tokens long but the context holds {max_len} tokens.")


def batches(lengths: Sequence[int], batch_tokens: int = BATCH_TOKENS) -> list[list[int]]:
    """Indices of inputs of these lengths grouped into forwards: shortest first (similar lengths pad little),
    each group's padded size within `batch_tokens` (a longer input alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] * (len(groups[-1]) + 1) <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _pooled(model, rows: list[Sequence[int]], mode: PoolingMode) -> torch.Tensor:
    """One right-padded forward of `rows`; each row's pooled final hidden state [B, H]."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([list(r) + [r[-1]] * (width - len(r)) for r in rows], dtype=torch.long, device=model.device)
    lengths = torch.tensor([len(r) for r in rows], device=model.device)
    if mode == "last":
        return model(ids, last_only=lengths - 1, hidden=True)[:, 0]
    return pool(model(ids, hidden=True).float(), lengths, mode)


def pool(states: torch.Tensor, lengths: torch.Tensor, mode: PoolingMode) -> torch.Tensor:
    """[B, H]: right-padded rows' final hidden states [B, T, H] pooled over their `lengths` real tokens."""
    if mode == "cls":
        return states[:, 0]
    if mode == "last":
        return states[torch.arange(states.shape[0], device=states.device), lengths - 1]
    mask = (torch.arange(states.shape[1], device=states.device)[None, :] < lengths[:, None]).to(states.dtype)
    return (states * mask[..., None]).sum(1) / lengths[:, None].to(states.dtype)
