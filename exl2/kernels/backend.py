"""Which implementation runs: the Triton kernel or its plain-PyTorch twin.

Triton runs when the tensor is on CUDA; on the CPU the twin runs, unless the Triton interpreter is active
(`TRITON_INTERPRET=1`, set before Triton is imported) and the caller asked for the kernels with
`force_triton()` — that is how the tests compare each kernel with its twin without a GPU.
`force_torch()` makes CUDA tensors take the twins (reference runs on the GPU).
"""
from __future__ import annotations

import os
from contextlib import AbstractContextManager, contextmanager
from typing import Iterator

import torch

from exl2.errors import ConfigError

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except Exception:  # noqa: BLE001 - an older Triton: programmatic dependent launch stays off
        gdc_launch_dependents = gdc_wait = None
except Exception:  # noqa: BLE001 - any import failure means "no Triton": the twins still run
    HAVE_TRITON = False
    gdc_launch_dependents = gdc_wait = None

    class _Stub:
        """Lets kernel modules import (and define never-called kernels) where Triton is missing."""

        constexpr = object

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

        def __getattr__(self, name):
            raise RuntimeError(f"Triton is not available (needed for triton.{name}).")

    triton = _Stub()  # type: ignore[assignment]
    tl = _Stub()  # type: ignore[assignment]

_mode = "auto"  # "auto" | "triton" | "torch"


@contextmanager
def _set_mode(mode: str) -> Iterator[None]:
    global _mode
    old, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = old


def force_triton() -> AbstractContextManager[None]:
    """Run the Triton kernels on CPU tensors too (only meaningful under TRITON_INTERPRET=1)."""
    return _set_mode("triton")


def force_torch() -> AbstractContextManager[None]:
    """Run the PyTorch twins even for CUDA tensors."""
    return _set_mode("torch")


def triton_usable() -> bool:
    """True if Triton kernels can run at all here (a CUDA GPU, or the interpreter)."""
    return HAVE_TRITON and (INTERPRET or torch.cuda.is_available())


def use_triton(t: torch.Tensor) -> bool:
    """Dispatch rule shared by every kernel: see the module docstring."""
    if not HAVE_TRITON or _mode == "torch":
        return False
    if t.is_cuda:
        return True
    return INTERPRET and _mode == "triton"


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessor count (a fixed small number on CPU, where it only shapes interpreter grids)."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


COUNTER_POOL = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor:
    """A per-device pool of int32 arrival counters, all 0 between launches: kernels whose last-arriving program
    finishes the work (split-K sums, the norm's residual write) count in it and reset what they used. Shared by
    every kernel on the device; calls on one stream never overlap."""
    c = _COUNTERS.get(device)
    if c is None:
        c = _COUNTERS[device] = torch.zeros(COUNTER_POOL, dtype=torch.int32, device=device)
    return c


# Programmatic dependent launch (sm_90+): a kernel launched with it may start while its predecessor in the stream
# finishes; it waits (`pdl_sync`, its first statement) until the predecessor's writes are visible, so only the
# launch and scheduling latency overlaps. Launches of at most PDL_MAX_ROWS rows (EXL2_PDL_MAX_ROWS) use it, except
# decode attention split over the keys and its merge, which stop at PDL_SPLIT_ROWS: on the H200 (session 16, run 5)
# that took batch 16 from 4,965 to 5,336 tok/s (q4 cache 4,440 → 4,648) and batch 8 from 2,626 to 2,743, where PDL
# for the split attention too lost 10 % at q4. EXL2_PDL=0 turns it off.
PDL = os.environ.get("EXL2_PDL", "1") == "1"
_PDL_OK: dict[int, bool] = {}


def env_choice(name: str, default: int, allowed: range | tuple[int, ...]) -> int:
    """An integer switch from the environment, read once at import; out of `allowed` it stops with one sentence."""
    value = os.environ.get(name, str(default))
    if not (value.isdigit() and int(value) in allowed):
        what = (f"an integer from {allowed.start} to {allowed.stop - 1}" if isinstance(allowed, range)
                else "one of " + ", ".join(map(str, allowed)))
        raise ConfigError(f"{name} must be {what}, not {value!r}.")
    return int(value)


def _prefetch_rows() -> int:
    rows = env_choice("EXL2_PREFETCH", 64, range(0, 1025))
    if rows & (rows - 1):
        raise ConfigError(f"EXL2_PREFETCH must be 0 or a power of two up to 1024, not {rows}.")
    return rows


PDL_MAX_ROWS = env_choice("EXL2_PDL_MAX_ROWS", 16, range(1, 4097))
# the same bound for the small launches between the matmuls (norms, RoPE, cache writes, attention, activations)
PDL_SMALL_ROWS = env_choice("EXL2_PDL_SMALL_ROWS", PDL_MAX_ROWS, range(1, 4097))
# and for decode attention split over the keys (partials, then a merge) and its merge launch
PDL_SPLIT_ROWS = env_choice("EXL2_PDL_SPLIT_ROWS", min(4, PDL_SMALL_ROWS), range(1, 4097))

# What a kernel launched with PDL reads before its wait: the gemvs prefetch the first PREFETCH_ROWS word rows of
# each width class of their share of the weights into L2, attention its first key/value block (neither depends on
# the previous kernel, so their DRAM latency overlaps its tail). EXL2_PREFETCH=0 turns both off.
PREFETCH_ROWS = _prefetch_rows()


def pdl_args(device: torch.device, rows: int, prefetch: int | bool | None = None, small: bool = False,
             split: bool = False) -> dict:
    """Launch keyword arguments for a kernel with a `PDL` flag working on `rows` tokens (or input rows):
    programmatic dependent launch where it exists and the launch is decode-sized (`small`: one of the launches
    between the matmuls; `split`: split decode attention or its merge), with the kernel's `PREFETCH` constexpr set
    to `prefetch` (when given) since only a dependent launch has anything to overlap."""
    limit = PDL_SPLIT_ROWS if split else PDL_SMALL_ROWS if small else PDL_MAX_ROWS
    if not PDL or rows > limit or device.type != "cuda" or INTERPRET or gdc_wait is None:
        return {}
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _PDL_OK.get(idx)
    if ok is None:
        ok = _PDL_OK[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    if not ok:
        return {}
    return {"PDL": True, "launch_pdl": True} | ({"PREFETCH": prefetch} if prefetch is not None else {})


@triton.jit
def prefetch_l2_where(ptrs, mask):
    """`prefetch_l2` of the lanes where `mask` holds; the others ask for nothing (`prefetch_l2` of a clamped
    address would still send a request)."""
    tl.inline_asm_elementwise("{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n@p prefetch.global.L2 [$1];\nmov.u32 $0, 0;\n}",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the cache lines at `ptrs` (any shape; a hint with no result, so it costs no registers)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def pdl_sync():
    """Wait for the previous kernel's writes, then let the next kernel launch (programmatic dependent launch)."""
    gdc_wait()
    gdc_launch_dependents()
