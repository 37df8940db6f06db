"""Which GPU each part of a model goes on when its layers are split over several GPUs (`gpu_split`).

Like exllamav2's manual split, the parts are placed in model order, embedding → decoder layers → final norm and
head, each on the first GPU (from GPU 0 on) whose budget still covers it; a decoder layer's budget share is its
weights plus its pages of the KV cache, which live with the layer. The budgets are either given in GB per GPU
(1 GB = 2**30 bytes) or, with "auto", each visible GPU's free memory less `AUTO_RESERVE` for what the plan does
not count: prefill activations, Triton and cuBLAS workspaces, allocator slack.

`plan_split` and `split_budgets` are plain functions of numbers; `model_sizes` reads the sizes from a model's
tensor headers before anything is loaded, and `gpu_budgets` asks CUDA.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, Optional, Sequence, Union

import torch

from exl2.errors import ConfigError
from exl2.formats.safetensors_io import TensorSource
from exl2.models.spec import ModelSpec

GIB = 1 << 30
AUTO_RESERVE = 1 << 30  # bytes kept free on every GPU under "auto"

GpuSplit = Union[Sequence[float], Literal["auto"]]

_ELEM = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "U64": 8, "I32": 4, "U32": 4,
         "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ModelSizes:
    """Bytes of each part of a loaded model: `layers` the decoder layers' weights, `head` the final norm and the
    output projection, `cache_per_layer` one layer's share of the KV cache."""

    embed: int
    layers: tuple[int, ...]
    head: int
    cache_per_layer: int = 0

    @property
    def weights(self) -> int:
        return self.embed + sum(self.layers) + self.head

    @property
    def cache(self) -> int:
        return self.cache_per_layer * len(self.layers)


@dataclass(frozen=True)
class Plan:
    """GPU ordinals (indices into the budget list) of the embedding, each decoder layer and the head, and the
    bytes planned on each GPU."""

    embed: int
    layers: tuple[int, ...]
    head: int
    used: tuple[int, ...]

    @property
    def gpus(self) -> list[int]:
        """The GPUs that hold something, in order."""
        return sorted({self.embed, self.head, *self.layers})


def plan_split(sizes: ModelSizes, budgets: Sequence[int]) -> Plan:
    """Place the parts in order, each on the current GPU if what is left of its budget (bytes) covers it, else on
    the next GPU that does. Raises ConfigError when the parts run out of GPUs."""
    if not budgets:
        raise ConfigError("The GPU split lists no GPUs.")
    parts = [("the embedding", sizes.embed)]
    parts += [(f"decoder layer {i}", w + sizes.cache_per_layer) for i, w in enumerate(sizes.layers)]
    parts.append(("the output head", sizes.head))
    used = [0] * len(budgets)
    where: list[int] = []
    gpu = 0
    for name, size in parts:
        while used[gpu] + size > budgets[gpu]:
            gpu += 1
            if gpu == len(budgets):
                raise ConfigError(_shortfall(sizes, budgets, name, size))
        used[gpu] += size
        where.append(gpu)
    return Plan(where[0], tuple(where[1:-1]), where[-1], tuple(used))


def _shortfall(sizes: ModelSizes, budgets: Sequence[int], name: str, size: int) -> str:
    need, have = sizes.weights + sizes.cache, sum(budgets)
    per_gpu = ", ".join(f"GPU {i}: {b / GIB:.2f}" for i, b in enumerate(budgets))
    what = (f"The model needs {need / GIB:.2f} GB on the GPUs (weights {sizes.weights / GIB:.2f} GB, KV cache "
            f"{sizes.cache / GIB:.2f} GB)")
    if need > have:
        return f"{what} but the GPU split makes only {have / GIB:.2f} GB available ({per_gpu})."
    return (f"{what} and the GPU split makes {have / GIB:.2f} GB available ({per_gpu}), but filled in order "
            f"{name} ({size / GIB:.2f} GB) does not fit in what is left of the last GPU.")


def split_budgets(gpu_split: GpuSplit, free: Sequence[int], reserve: int = AUTO_RESERVE) -> list[int]:
    """Bytes per GPU: the given GB per GPU, or under "auto" the free bytes of every visible GPU (`free`, one entry
    per visible GPU) less `reserve`."""
    if not free:
        raise ConfigError("--gpu_split needs CUDA GPUs, and none is visible; leave it out to run on one device.")
    if gpu_split == "auto":
        return [max(0, f - reserve) for f in free]
    split = list(gpu_split)
    if not split:
        raise ConfigError("The GPU split lists no GPUs.")
    if len(split) > len(free):
        raise ConfigError(f"The GPU split lists {len(split)} GPUs but only {len(free)} "
                          f"{'is' if len(free) == 1 else 'are'} visible.")
    if any(not math.isfinite(gb) or gb < 0 for gb in split) or not any(gb > 0 for gb in split):
        raise ConfigError("The GPU split needs GB per GPU that are zero or more, at least one above zero.")
    return [int(gb * GIB) for gb in split]


def gpu_budgets(gpu_split: GpuSplit) -> list[int]:
    """`split_budgets` for this machine's visible CUDA GPUs (their free memory, read only under "auto")."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpu_split == "auto":
        free = [torch.cuda.mem_get_info(i)[0] for i in range(count)]
    else:
        free = [0] * count  # only the count matters for a manual split
    return split_budgets(gpu_split, free)


def _tensor_bytes(src: TensorSource, name: str, dtype: torch.dtype) -> int:
    """Bytes of one tensor once loaded: floating tensors in the compute dtype, packed integers as stored, EXL2's
    4-bit packed scales expanded to the kernels' fp16 (an estimate of the kernel layout, within a few percent)."""
    numel = 1
    for d in src.shape(name):
        numel *= d
    kind = src.dtype_name(name)
    if kind.startswith(("F", "BF")):
        return numel * dtype.itemsize
    size = numel * _ELEM.get(kind, 4)
    return size * 4 if name.endswith(".q_scale") else size


def model_sizes(src: TensorSource, spec: ModelSpec, dtype: torch.dtype, cache_per_layer: int = 0) -> ModelSizes:
    """The parts' sizes from the tensor headers alone (nothing is read or loaded)."""
    embed, head, layers = 0, 0, [0] * spec.num_layers
    has_head = False
    for name in src.keys():
        size = _tensor_bytes(src, name, dtype)
        m = _LAYER.match(name)
        if m and int(m.group(1)) < spec.num_layers:
            layers[int(m.group(1))] += size
        elif name.startswith("model.embed_tokens."):
            embed += size
        elif name.startswith(("model.norm.", "lm_head.")):
            head += size
            has_head |= name.startswith("lm_head.")
    if not has_head:  # tied embeddings: the head is a second copy of the embedding on its own device
        head += embed
    return ModelSizes(embed, tuple(layers), head, cache_per_layer)


def plan_model(src: TensorSource, spec: ModelSpec, dtype: torch.dtype, gpu_split: GpuSplit,
               cache_per_layer: int = 0) -> Plan:
    """The plan of a model directory's tensors over this machine's GPUs."""
    return plan_split(model_sizes(src, spec, dtype, cache_per_layer), gpu_budgets(gpu_split))


def parse_gpu_split(text: Optional[str]) -> Optional[GpuSplit]:
    """The command line's "20,24" (GB per GPU) or "auto"; None stays None."""
    if text is None:
        return None
    if text.strip().lower() == "auto":
        return "auto"
    try:
        split = [float(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--gpu_split takes GB per GPU separated by commas (e.g. 20,24) or 'auto', not "
                          f"{text!r}.") from None
    split_budgets(split, [0] * len(split))  # the same checks as for the config, before any CUDA call
    return split
