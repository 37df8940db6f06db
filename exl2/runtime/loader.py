"""Load a model directory (HF, EXL2, GPTQ) into a DecoderModel on a device, or split over several GPUs."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from exl2.errors import ConfigError
from exl2.formats.safetensors_io import TensorSource
from exl2.models.decoder import DecoderModel
from exl2.models.registry import read_config, spec_from_config
from exl2.models.rope import RopeOverride
from exl2.models.spec import ModelSpec
from exl2.runtime.load_progress import Progress, reporting
from exl2.runtime.paged_cache import layer_bytes_per_token
from exl2.runtime.placement import GpuSplit, Plan, plan_model, split_budgets
from exl2.runtime.weights import WeightLoader

if TYPE_CHECKING:
    from exl2.config import EngineConfig

PAGE_SIZE = 256  # the dynamic generator's page: the cache it allocates is whole pages plus one scratch page
DEFAULT_CONTEXT = 4096  # max_seq_len when none is asked for (EngineConfig's and the CLI's default)
log = logging.getLogger("exl2.model")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.float32


def pick_device(device: Optional[str] = None) -> torch.device:
    if device:
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("--device cuda was requested but no CUDA GPU is available.")
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(model_dir: Path | str, device: Optional[str] = None, dtype: Optional[torch.dtype] = None,
               gpu_split: Optional[GpuSplit] = None, cache_tokens: Optional[int] = None, cache_mode: str = "fp16",
               tensor_parallel: bool = False, rope: Optional[RopeOverride] = None,
               experts_per_token: Optional[int] = None, prefill_fp8: bool = False,
               progress: Optional[Progress] = None) -> DecoderModel:
    """`gpu_split` (GB per GPU, or "auto"; runtime.placement) spreads the decoder layers over several GPUs, with
    room for the KV cache of `cache_tokens` tokens (default: the model's context, at most 4096) in `cache_mode`
    next to each layer. A plan that uses one GPU loads the model there as if no split had been asked for.
    `tensor_parallel` shards every layer over the GPUs instead (runtime.tp): those `gpu_split` lists with a
    budget above 0, or every visible GPU. `rope` (-rs/-ra/-ry) overrides config.json's RoPE; the spec's
    `max_position` is then the context the override covers. `experts_per_token` overrides how many experts a
    mixture-of-experts model routes each token to (exllamav2's -ept). `prefill_fp8` sends prompt-sized matmuls
    of quantized weights through e4m3 (`kernels.fp8_prefill`: faster prompts, slightly different numbers).
    `progress(done, total)` hears of each decoder layer and then the head as they load (`runtime.load_progress`)."""
    cfg = read_config(model_dir)
    spec = with_experts_per_token(spec_from_config(cfg, rope), experts_per_token)
    qc = cfg.get("quantization_config") or {}
    fmt = dict(checkpoint_format=qc.get("checkpoint_format", "gptq"),
               gptq_bits=int(qc.get("bits", 4)) if qc.get("quant_method") == "gptq" else 4)
    src = TensorSource(model_dir)
    with reporting(progress):
        if tensor_parallel:
            model = _load_tensor_parallel(src, spec, device, dtype or torch.float16, gpu_split, fmt)
        elif gpu_split is None:
            dev = pick_device(device)
            model = _build(spec, WeightLoader(src, dev, dtype or default_dtype(dev), **fmt))
        else:
            model = _load_split(src, spec, device, dtype or torch.float16, gpu_split, cache_tokens, cache_mode, fmt)
    model.config_dict = cfg
    model.model_dir = Path(model_dir)
    if prefill_fp8:
        use_prefill_fp8(model)
    return model


def use_prefill_fp8(model: torch.nn.Module) -> bool:
    """Opt the model's quantized weights in to FP8 prompt matmuls (`set_prefill_fp8`); False, with a one-line
    warning, where that changes nothing: no quantized weights, or devices without e4m3 tensor cores (the CPU, GPUs
    before sm_89)."""
    from exl2.kernels.fp8_prefill import fp8_available
    from exl2.runtime.linear import quant_kernels, set_prefill_fp8

    weights = quant_kernels(model)  # none on the CPU, which decodes at load
    devices = {w.device for w in weights} or {t.device for t in model.parameters()}
    if not devices or not all(fp8_available(d) for d in devices):
        log.warning("prefill_fp8 needs CUDA GPUs whose PyTorch runs row-scaled e4m3 GEMMs (sm_89 or newer; "
                    "checked with a test GEMM), so prompts run without it on this device.")
    elif not set_prefill_fp8(model, True):
        log.warning("prefill_fp8 applies to quantized (EXL2/GPTQ) weights and this model has none, so its prompts "
                    "run in fp16.")
    else:
        return True
    return False


def native_context(model_dir: Path | str) -> int:
    """The context a model's own config.json covers (its RoPE scaling included; no override)."""
    return spec_from_config(read_config(model_dir)).max_position


def with_experts_per_token(spec: ModelSpec, k: Optional[int]) -> ModelSpec:
    """`spec` routing each token to `k` experts instead of config.json's count (None: unchanged). Fewer run faster
    and answer worse; more, slower. One-sentence ConfigError for a model without experts or a count it cannot
    route (DeepSeek-style group routing picks only from its top groups)."""
    if k is None:
        return spec
    moe = spec.moe
    if moe is None or not any(layer.moe for layer in spec.layers):
        raise ConfigError("experts_per_token applies to mixture-of-experts models, and this model has no experts.")
    limit = moe.num_experts
    if moe.router == "sigmoid_grouped" and moe.n_group > 1:
        limit = moe.topk_group * (moe.num_experts // moe.n_group)
    if not 1 <= k <= limit:
        raise ConfigError(f"experts_per_token must be between 1 and {limit} for this model (it routes to "
                          f"{moe.top_k} by default), not {k}.")
    return dataclasses.replace(spec, moe=dataclasses.replace(moe, top_k=k))


def engine_rope(config: "EngineConfig") -> RopeOverride:
    """The RoPE override an EngineConfig asks for; its max_seq_len counts as asked for (what rope_alpha allows)
    only where it was given, not EngineConfig's default."""
    explicit = "max_seq_len" in config.model_fields_set
    return RopeOverride(config.rope_scale, config.rope_alpha, config.rope_yarn,
                        context=config.max_seq_len if explicit else None)


def context_length(spec: ModelSpec, requested: Optional[int]) -> int:
    """The max_seq_len to run: `requested` (None: the default 4096), at most the positions the model's RoPE
    covers (`spec.max_position`, which a RoPE override extends). A request past that is capped with a one-line
    warning, never silently: beyond them the model sees positions it was not trained on."""
    limit = spec.max_position
    if requested is None:
        return min(DEFAULT_CONTEXT, limit)
    if requested > limit:
        ov = spec.rope_override
        if ov is None or not ov.active:
            log.warning(f"max_seq_len {requested} is longer than the model's native context of {limit} positions, "
                        f"so it is capped at {limit}; rope_scale, rope_alpha or rope_yarn extend it.")
        else:
            log.warning(f"max_seq_len {requested} is longer than the {limit} positions that {ov.describe()} "
                        f"covers (native {spec.native_max_position}), so it is capped at {limit}.")
        return limit
    return requested


def _build(spec: ModelSpec, w, layer_w=None, head_w=None) -> DecoderModel:
    with torch.no_grad():
        model = DecoderModel(spec, w, layer_w, head_w)
    return model.eval()


def _load_split(src: TensorSource, spec: ModelSpec, device: Optional[str], dtype: torch.dtype, gpu_split: GpuSplit,
                cache_tokens: Optional[int], cache_mode: str, fmt: dict) -> DecoderModel:
    if device is not None and not device.startswith("cuda"):
        raise ConfigError(f"--gpu_split places the model on CUDA GPUs; it cannot be combined with --device {device}.")
    if not torch.cuda.is_available():
        raise ConfigError("--gpu_split needs CUDA GPUs, and none is available; leave it out to run on the CPU.")
    tokens = cache_tokens or min(spec.max_position, 4096)
    pages = -(-tokens // PAGE_SIZE) + 1
    per_layer = int(pages * PAGE_SIZE * layer_bytes_per_token(spec, cache_mode, dtype.itemsize))
    plan = plan_model(src, spec, dtype, gpu_split, per_layer)
    devices = [torch.device("cuda", i) for i in range(max(plan.gpus) + 1)]
    # the embedding's GPU becomes the current one: input ids, sampling and captured graphs work there, and Triton
    # launches on the current device
    torch.cuda.set_device(devices[plan.embed])
    try:
        if len(plan.gpus) == 1:
            return _build(spec, WeightLoader(src, devices[plan.embed], dtype, **fmt))
        return build_split(src, spec, plan, devices, dtype, **fmt)
    except torch.cuda.OutOfMemoryError:
        raise ConfigError("Loading the model ran out of GPU memory: lower the GB per GPU of --gpu_split (each "
                          "budget must leave room for activations) or use 'auto'.") from None


def build_split(src: TensorSource, spec: ModelSpec, plan: Plan, devices: Sequence[torch.device],
                dtype: torch.dtype, **fmt) -> DecoderModel:
    """A model laid out by `plan`, GPU i of the plan being `devices[i]`: one WeightLoader per planned GPU, so the
    model runs its split path even where several entries name one device (how the CPU tests exercise it)."""
    loaders = {g: WeightLoader(src, devices[g], dtype, **fmt) for g in plan.gpus}
    return _build(spec, loaders[plan.embed], [loaders[g] for g in plan.layers], loaders[plan.head])


def tensor_parallel_devices(gpu_split: Optional[GpuSplit], visible: int) -> list[int]:
    """The GPUs a tensor-parallel model shards over: those `gpu_split` gives a budget above 0 (its GB are not
    planned: every GPU holds an equal share), or with "auto" or no split every visible one."""
    if visible == 0:
        raise ConfigError("--tensor-parallel needs CUDA GPUs, and none is available; leave it out to run on the "
                          "CPU.")
    if gpu_split is None or gpu_split == "auto":
        gpus = list(range(visible))
    else:
        split_budgets(gpu_split, [0] * visible)  # the split's own checks: entries, GPUs visible
        gpus = [i for i, gb in enumerate(gpu_split) if gb > 0]
    if len(gpus) < 2:
        have = "only one is visible" if gpu_split is None or gpu_split == "auto" else "the GPU split lists one"
        raise ConfigError(f"--tensor-parallel needs at least two GPUs, but {have}; leave it out to run on one.")
    return gpus


def _load_tensor_parallel(src: TensorSource, spec: ModelSpec, device: Optional[str], dtype: torch.dtype,
                          gpu_split: Optional[GpuSplit], fmt: dict) -> DecoderModel:
    from exl2.runtime.tp.model import build_tensor_parallel
    from exl2.runtime.tp.shard import check_supported

    if device is not None and not device.startswith("cuda"):
        raise ConfigError(f"--tensor-parallel shards the model over CUDA GPUs; it cannot be combined with --device "
                          f"{device}.")
    gpus = tensor_parallel_devices(gpu_split, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    check_supported(spec, len(gpus))
    devices = [torch.device("cuda", i) for i in gpus]
    torch.cuda.set_device(devices[0])  # input ids, the head and sampling live on the first GPU
    try:
        return build_tensor_parallel(src, spec, devices, dtype, **fmt)
    except torch.cuda.OutOfMemoryError:
        raise ConfigError("Loading the tensor-parallel model ran out of GPU memory: each GPU holds an equal share "
                          "of every layer; add GPUs or use a smaller model.") from None
