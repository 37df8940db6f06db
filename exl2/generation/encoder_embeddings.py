"""Embeddings from a BERT-family encoder (`models.encoder`): sentence-transformers models such as all-MiniLM, bge
or multilingual-e5, served beside a chat model (`exl2 serve --embedding-model`). Inputs are tokenized as the
model's tokenizer post-processes a document ([CLS] … [SEP]), batched right-padded under an attention mask, and
pooled as the model's `1_Pooling/config.json` says (mean, or the [CLS] state), L2-normalised where its modules.json
has a Normalize step: `generation.embeddings.embed` with the encoder's forward."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional, Sequence

import torch

from exl2.generation.embeddings import EmbeddingResult, Pooling, PoolingMode, embed, input_ids, pool
from exl2.generation.tokenizer import Tokenizer
from exl2.models.encoder import Encoder, load_encoder


def _encoder_pooled(model: Encoder, rows: list[Sequence[int]], mode: PoolingMode) -> torch.Tensor:
    """One right-padded forward of `rows` under the padding mask; each row's pooled final hidden state [B, H]."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=model.device)
    lengths = torch.tensor([len(r) for r in rows], device=model.device)
    return pool(model(ids, lengths).float(), lengths, mode)


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
        ids = input_ids(self.tokenizer, inputs)
        with self._lock:
            vectors = embed(self.model, ids, self.pooling, dimensions, self.max_seq_len, pooled=_encoder_pooled)
        return EmbeddingResult(vectors, [len(x) for x in ids])
