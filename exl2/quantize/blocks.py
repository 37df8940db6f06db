"""The units the quantizer works on: one attention or MLP block of one decoder layer at a time.

A layer is built alone from the source directory (memory stays at about one layer); its blocks are run over the
calibration hidden states in row batches, with forward pre-hooks on the projections collecting input Hessians.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from exl2.formats.safetensors_io import TensorSource
from exl2.models.decoder import DecoderLayer, DecoderModel, final_logits
from exl2.models.layers import make_norm
from exl2.models.spec import ModelSpec
from exl2.runtime.linear import Linear
from exl2.runtime.weights import WeightLoader

_ROLE_OF = {"q_proj": "q_proj", "q_a_proj": "q_proj", "q_b_proj": "q_proj", "k_proj": "k_proj",
            "kv_a_proj": "k_proj", "v_proj": "v_proj", "kv_b_proj": "v_proj", "o_proj": "o_proj",
            "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
_MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@dataclass(frozen=True)
class Slot:
    """One measured/quantized block: the attention or the feed-forward half of a decoder layer."""

    index: int
    layer: int
    kind: str      # "attn" | "mlp"
    key: str       # measurement.json key, e.g. "model.layers.3.self_attn"


@dataclass
class Proj:
    """A projection inside a block: its tensor key in the output files, its option role and the module."""

    key: str
    role: str
    name: str      # the projection's name in measurement/strategy dicts (q_proj … or w1/w3/w2)
    module: Linear


def slots(spec: ModelSpec) -> list[Slot]:
    out = []
    for i in range(spec.num_layers):
        out.append(Slot(2 * i, i, "attn", f"model.layers.{i}.self_attn"))
        out.append(Slot(2 * i + 1, i, "mlp", f"model.layers.{i}.{spec.mlp_key}"))
    return out


class _KeyedLoader(WeightLoader):
    """A WeightLoader that tags every linear it builds with the tensor prefix it came from."""

    def linear(self, prefix, in_features, out_features, bias):
        lin = super().linear(prefix, in_features, out_features, bias)
        lin.source_key = prefix
        return lin


class SourceModel:
    """Lazy access to a source model's pieces: embeddings, one layer at a time, the head."""

    def __init__(self, source_dir: Path | str, spec: ModelSpec, device: torch.device, dtype: torch.dtype):
        self.dir = Path(source_dir)
        self.spec, self.device, self.dtype = spec, device, dtype
        self.src = TensorSource(self.dir)
        self.loader = _KeyedLoader(self.src, device, dtype, use_kernels=False)
        self._ns = SimpleNamespace(spec=spec, dtype=dtype, device=device)
        self._tables: dict[int, dict] = {}

    def layer(self, i: int) -> DecoderLayer:
        with torch.no_grad():
            layer = DecoderLayer(self.spec, i, self.loader)
        return layer.eval()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.loader.tensor("model.embed_tokens.weight")
        ids = torch.where(ids >= weight.shape[0], torch.zeros_like(ids), ids)
        x = F.embedding(ids.to(self.device), weight)
        if self.spec.embed_scale != 1.0:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        return x

    def head_key(self) -> str:
        """Tensor prefix of the head's source weight (the embedding for tied models)."""
        for key in ("lm_head.weight", "lm_head.q_weight", "lm_head.qweight"):
            if key in self.src:
                return "lm_head"
        return "model.embed_tokens" if self.spec.tie_embeddings else "lm_head"

    def final_norm(self) -> nn.Module:
        return make_norm(self.spec, self.loader.tensor("model.norm.weight"))

    def head_linear(self) -> Linear:
        return self.loader.linear(self.head_key(), self.spec.hidden_size, self.spec.vocab_size, False)

    def logits(self, norm: nn.Module, head: Linear, x: torch.Tensor) -> torch.Tensor:
        return final_logits(self.spec, head(norm(x)))

    def rope(self, batch: int, length: int, layer: int):
        """(q_pos [B, T], the layer's rope argument) for rows that start at position 0."""
        q_pos = torch.arange(length, device=self.device).expand(batch, length)
        if length not in self._tables:
            self._tables[length] = DecoderModel.rope_tables(self._ns, q_pos, length)
        return q_pos, DecoderModel.layer_rope(self._ns, self._tables[length], layer)


def projections(layer: DecoderLayer, slot: Slot) -> list[Proj]:
    """The quantizable linears of a block, in module order, with their output keys and option roles."""
    root = layer.self_attn if slot.kind == "attn" else layer.mlp
    sub = "self_attn" if slot.kind == "attn" else layer.spec.mlp_key
    found = [(path, m) for path, m in root.named_modules() if isinstance(m, Linear)]
    mixtral = any(getattr(m, "source_key", "").endswith((".w1", ".w2", ".w3")) for _, m in found)
    out = []
    for path, m in found:
        leaf = path.rsplit(".", 1)[-1]
        role = _ROLE_OF.get(leaf)
        if role is None:
            raise ValueError(f"no quantization role for {path}")
        key = getattr(m, "source_key", None)
        if key is None or key.endswith(("qkv_proj", "gate_up_proj")):
            key = f"model.layers.{slot.layer}.{sub}.{path}"
        name = _MIXTRAL_NAMES[role] if mixtral and role in _MIXTRAL_NAMES else role
        out.append(Proj(key, role, name, m))
    return out


def advances(spec: ModelSpec, slot: Slot) -> bool:
    """Whether the block's output is the next block's input: not for a parallel layer's attention (Cohere), whose
    MLP reads the same input."""
    return not (spec.parallel_block and slot.kind == "attn")


def run_block(model: SourceModel, layer: DecoderLayer, slot: Slot, x: torch.Tensor) -> torch.Tensor:
    """The residual stream after the block, for a batch of rows x [B, T, H] on the compute device.

    A parallel layer's attention block gives `x + attn(n(x))` (what its quantization changes), and its MLP block the
    whole layer, `x + attn(n(x)) + mlp(n(x))`, with the attention as it stands (quantized, in the quantization
    pass): the errors the MLP's inputs carry are then those of the model the next layer will see."""
    if slot.kind == "mlp" and not layer.spec.parallel_block:
        return layer.mlp_block(x)
    q_pos, rope = model.rope(x.shape[0], x.shape[1], slot.layer)
    if not layer.spec.parallel_block:
        return layer.attn_block(x, q_pos, rope)
    return layer.parallel_attn(x, q_pos, rope) if slot.kind == "attn" else layer.parallel(x, q_pos, rope)


def row_batches(rows: int, length: int, tokens_per_batch: int) -> Iterator[slice]:
    step = max(1, tokens_per_batch // max(1, length))
    for a in range(0, rows, step):
        yield slice(a, min(rows, a + step))


def map_rows(fn: Callable[[torch.Tensor], torch.Tensor], states: torch.Tensor, device: torch.device,
             tokens_per_batch: int, out: Optional[torch.Tensor] = None,
             each: Optional[Callable[[slice, torch.Tensor, torch.Tensor], None]] = None) -> Optional[torch.Tensor]:
    """Apply `fn` to row batches of `states` [R, T, H] on `device`; store results in `out` and/or pass them to `each`."""
    with torch.no_grad():
        for sl in row_batches(states.shape[0], states.shape[1], tokens_per_batch):
            x = states[sl].to(device)
            y = fn(x)
            if each is not None:
                each(sl, x, y)
            if out is not None:
                out[sl] = y.to(out.device, out.dtype)
    return out


class HessianCollector:
    """Accumulates `Σ XᵀX` (fp32) over the inputs of a set of linears; linears fed the very same input tensor in
    one forward (q/k/v, gate/up) share one accumulator, as exllamav2's `reuse_h` does."""

    def __init__(self, projs: list[Proj]):
        self.projs = projs
        self.owner: dict[str, str] = {}
        self.h: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}
        self._last: Optional[tuple[torch.Tensor, str]] = None
        self._handles = []

    def __enter__(self) -> "HessianCollector":
        for p in self.projs:
            self._handles.append(p.module.register_forward_pre_hook(self._hook(p.key)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._last = None

    def _hook(self, key: str):
        def hook(module, inputs):
            x = inputs[0]
            if self._last is not None and self._last[0] is x:
                self.owner.setdefault(key, self._last[1])
                return
            self._last = (x, key)   # holding x keeps its memory from being reused by another input
            self.add(key, x)
        return hook

    def add(self, key: str, x: torch.Tensor) -> None:
        """Accumulate the inputs `x [..., K]` of projection `key` (also usable without hooks)."""
        self.owner.setdefault(key, key)
        xf = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        if key not in self.h:
            self.h[key] = torch.zeros((xf.shape[1], xf.shape[1]), dtype=torch.float32, device=xf.device)
            self.count[key] = 0
        self.h[key].addmm_(xf.t(), xf)
        self.count[key] += xf.shape[0]

    def end_batch(self) -> None:
        self._last = None

    def hessian(self, key: str, k: int, device: torch.device) -> tuple[str, torch.Tensor]:
        """(owner key, mean XᵀX) for a projection; a projection that saw no tokens gets zeros."""
        owner = self.owner.get(key, key)
        if owner not in self.h:
            return owner, torch.zeros((k, k), dtype=torch.float32, device=device)
        return owner, self.h[owner] / max(1, self.count[owner])
