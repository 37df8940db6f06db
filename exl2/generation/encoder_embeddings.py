"""Embeddings from a BERT-family encoder (`models.encoder`): sentence-transformers models such as all-MiniLM, bge
or multilingual-e5, served beside a chat model (`exl2 serve --embedding-model`). Inputs are tokenized as the
model's tokenizer post-processes a document ([CLS] … [SEP]), batched right-padded under an attention mask, and
pooled as the model's `1_Pooling/config.json` says (mean, or the [CLS] state), L2-normalised where its modules.json
has a Normalize step."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional, Sequence

import torch

from exl2.generation.embeddings import EmbeddingResult, Pooling, PoolingMode, batches, check_inputs
from exl2.generation.tokenizer import Tokenizer
from exl2.models.encoder import Encoder, load_encoder


class EncoderEmbedder:
    """The `Engine.embed` surface (embed, tokenizer, model_name, max_seq_len) over an encoder."""

    def __init__(self, model: Encoder, tokenizer: Tokenizer, pooling: Pooling, name: str):
        self.model, self.tokenizer, self.pooling, self.model_name = model, tokenizer, pooling, name
        self.max_seq_len = model.spec.max_position
        self._lock = threading.Lock()     # one forward at a time: requests arrive from several threads

    @classmethod
    def from_dir(cls, model_dir: Path | str, device: Optional[str] = None,
                 pooling: Optional[PoolingMode] = None) -> "EncoderEmbedder":
        d = Path(model_dir)
        mode = Pooling.from_dir(d, pooling)
        if pooling is None and not (d / "1_Pooling" / "config.json").is_file():
            mode = Pooling("mean", mode.normalize)     # no pooling file: mean, as sentence-transformers defaults
        return cls(load_encoder(d, device), Tokenizer.from_dir(d), mode, d.resolve().name)

    def embed(self, inputs: Sequence[str | Sequence[int]], dimensions: Optional[int] = None) -> EmbeddingResult:
        """One vector per text (or token id list), `dimensions` components where given."""
        ids = [self.tokenizer.encode_document(x) if isinstance(x, str) else [int(t) for t in x] for x in inputs]
        hidden = self.model.spec.hidden_size
        check_inputs(ids, hidden, dimensions, self.max_seq_len)
        out = torch.empty(len(ids), hidden, dtype=torch.float32)
        for group in batches([len(x) for x in ids]):
            rows = [ids[i] for i in group]
            with self._lock:
                out[group] = self._pooled(rows)
        if dimensions is not None:
            out = out[:, :dimensions].contiguous()
        if self.pooling.normalize:
            out = torch.nn.functional.normalize(out, dim=-1)
        return EmbeddingResult(out, [len(x) for x in ids])

    def _pooled(self, rows: list[list[int]]) -> torch.Tensor:
        dev = self.model.device
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=dev)
        lengths = torch.tensor([len(r) for r in rows], device=dev)
        states = self.model(ids, lengths).float()
        if self.pooling.mode == "cls":
            return states[:, 0].cpu()
        if self.pooling.mode == "last":
            return states[torch.arange(len(rows), device=dev), lengths - 1].cpu()
        mask = (torch.arange(width, device=dev)[None, :] < lengths[:, None]).float()
        return ((states * mask[..., None]).sum(1) / lengths[:, None].float()).cpu()
