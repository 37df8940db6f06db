"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) for text embeddings: the sentence-transformers models people
run for retrieval (all-MiniLM, bge, e5, multilingual-e5) beside a chat model. Bidirectional attention over a
padding mask, learned absolute positions, post-norm layers; fp16/fp32 PyTorch (no quantized weights: these models
are small)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from exl2.errors import ConfigError, ModelLoadError
from exl2.formats.safetensors_io import TensorSource

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")
_PREFIXES = ("bert.", "roberta.", "model.")     # checkpoints saved from *ForMaskedLM / sentence-transformers


@dataclass(frozen=True)
class EncoderSpec:
    """What an encoder's config.json says."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position: int
    eps: float
    activation: str
    position_offset: int        # RoBERTa numbers positions from pad_token_id + 1

    @classmethod
    def from_config(cls, cfg: dict) -> "EncoderSpec":
        kind = cfg.get("model_type")
        if kind not in ENCODER_TYPES:
            raise ConfigError(f"model_type {kind!r} is not an encoder exl2 runs (one of {', '.join(ENCODER_TYPES)}).")
        act = cfg.get("hidden_act", "gelu")
        if act not in ("gelu", "gelu_new", "relu"):
            raise ConfigError(f"The encoder activation {act!r} is not supported (gelu, gelu_new, relu).")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError("Only encoders with absolute position embeddings are supported.")
        offset = int(cfg.get("pad_token_id", 1)) + 1 if kind != "bert" else 0
        try:
            return cls(kind, cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"],
                       cfg["num_attention_heads"], cfg["intermediate_size"], cfg["max_position_embeddings"] - offset,
                       float(cfg.get("layer_norm_eps", 1e-12)), act, offset)
        except KeyError as e:
            raise ModelLoadError(f"The encoder's config.json lacks {e.args[0]}.") from None


def is_encoder_dir(model_dir: Path | str) -> bool:
    """Whether `model_dir`'s config.json describes a BERT-family encoder."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and cfg.get("model_type") in ENCODER_TYPES


class _Layer(nn.Module):
    def __init__(self, spec: EncoderSpec, w: dict[str, torch.Tensor], p: str):
        super().__init__()
        self.heads, self.eps, self.act = spec.num_heads, spec.eps, spec.activation
        self.qkv_w = nn.Parameter(torch.cat([w[f"{p}.attention.self.{n}.weight"] for n in ("query", "key", "value")]),
                                  requires_grad=False)
        self.qkv_b = nn.Parameter(torch.cat([w[f"{p}.attention.self.{n}.bias"] for n in ("query", "key", "value")]),
                                  requires_grad=False)
        names = {"o": "attention.output.dense", "ln1": "attention.output.LayerNorm", "up": "intermediate.dense",
                 "down": "output.dense", "ln2": "output.LayerNorm"}
        for short, name in names.items():
            setattr(self, f"{short}_w", nn.Parameter(w[f"{p}.{name}.weight"], requires_grad=False))
            setattr(self, f"{short}_b", nn.Parameter(w[f"{p}.{name}.bias"], requires_grad=False))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = F.linear(x, self.qkv_w, self.qkv_b).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = F.layer_norm(x + F.linear(a.transpose(1, 2).reshape(b, t, h), self.o_w, self.o_b), (h,), self.ln1_w,
                         self.ln1_b, self.eps)
        up = F.linear(x, self.up_w, self.up_b)
        up = F.relu(up) if self.act == "relu" else F.gelu(up, approximate="tanh" if self.act == "gelu_new" else "none")
        return F.layer_norm(x + F.linear(up, self.down_w, self.down_b), (h,), self.ln2_w, self.ln2_b, self.eps)


class Encoder(nn.Module):
    """The final hidden states [B, T, H] of right-padded rows (`lengths` real tokens each; padding is masked out
    of attention, and its states are meaningless)."""

    def __init__(self, spec: EncoderSpec, w: dict[str, torch.Tensor]):
        super().__init__()
        self.spec = spec
        self.word = nn.Parameter(w["embeddings.word_embeddings.weight"], requires_grad=False)
        self.pos = nn.Parameter(w["embeddings.position_embeddings.weight"], requires_grad=False)
        types = w.get("embeddings.token_type_embeddings.weight")
        self.type0 = nn.Parameter(types[0], requires_grad=False) if types is not None else None
        self.ln_w = nn.Parameter(w["embeddings.LayerNorm.weight"], requires_grad=False)
        self.ln_b = nn.Parameter(w["embeddings.LayerNorm.bias"], requires_grad=False)
        self.layers = nn.ModuleList(_Layer(spec, w, f"encoder.layer.{i}") for i in range(spec.num_layers))

    @property
    def device(self) -> torch.device:
        return self.word.device

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        if t > self.spec.max_position:
            raise ConfigError(f"The encoder takes {self.spec.max_position} tokens at most, not {t}.")
        real = torch.arange(t, device=ids.device)[None, :] < lengths[:, None]
        positions = torch.arange(t, device=ids.device) + self.spec.position_offset
        x = self.word[ids] + self.pos[positions][None]
        if self.type0 is not None:
            x = x + self.type0
        x = F.layer_norm(x, (self.spec.hidden_size,), self.ln_w, self.ln_b, self.spec.eps)
        mask = torch.zeros(b, 1, 1, t, dtype=x.dtype, device=x.device).masked_fill(~real[:, None, None, :],
                                                                                  torch.finfo(x.dtype).min)
        for layer in self.layers:
            x = layer(x, mask)
        return x


def load_encoder(model_dir: Path | str, device: Optional[str] = None,
                 dtype: Optional[torch.dtype] = None) -> Encoder:
    """The encoder in `model_dir` (config.json and safetensors weights), on `device` (default: cuda if available)
    in `dtype` (default fp16 on CUDA, fp32 on the CPU)."""
    d = Path(model_dir)
    try:
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"The encoder's config.json in {d} cannot be read ({e.__class__.__name__}).") from None
    spec = EncoderSpec.from_config(cfg)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.float16 if dev.type == "cuda" else torch.float32)
    src = TensorSource(d)
    w = {}
    for key in src.keys():
        name = next((key[len(p):] for p in _PREFIXES if key.startswith(p)), key)
        if name.startswith(("embeddings.", "encoder.")):
            w[name] = src.get(key).to(device=dev, dtype=dtype)
    try:
        return Encoder(spec, w).eval()
    except KeyError as e:
        raise ModelLoadError(f"The encoder in {d} lacks the tensor {e.args[0]}.") from None
