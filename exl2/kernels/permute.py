"""The quantized matmuls' permuted inputs: x read through each weight's act-order index (`QuantWeight.x_index`,
-1 for "zero"), so the small-batch kernels read contiguous rows in the weight's stored order. Made by
`gather_input` (one launch for the weights sharing an input) or by the kernel producing x (`norm.rms_norm_gather`,
`activation.glu(index=...)`); weights with one index tensor share one copy (`input_layout`). Triton and PyTorch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from exl2.kernels.backend import pdl_args, pdl_sync, tl, triton, use_triton

if TYPE_CHECKING:  # qweight imports this module's twin
    from exl2.kernels.qweight import QuantWeight


@triton.jit
def gather_block(src_row, idx_ptr, dst_row, n, offs):
    """dst[p] = src[idx[p]] (0 where idx[p] < 0) for the positions `offs` below n."""
    m = offs < n
    idx = tl.load(idx_ptr + offs, mask=m, other=-1)
    v = tl.load(src_row + idx, mask=idx >= 0, other=0.0)
    tl.store(dst_row + offs, v.to(dst_row.dtype.element_ty), mask=m)


def take_columns(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x[..., index]` with 0 where index < 0: the PyTorch twin of `gather_block`."""
    i = index.long()
    return x.index_select(-1, i.clamp(min=0)).masked_fill(i < 0, 0)


@triton.jit
def _gather_kernel(x_ptr, stride_xm, out_ptr, stride_om, i0, o0, n0, i1, o1, n1, i2, o2, n2, i3, o3, n3,
                   BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out[m, o_w + p] = x[m, idx_w[p]] (0 where idx_w[p] < 0) for up to four weights w (grid axis 2)."""
    if PDL:
        pdl_sync()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = tl.program_id(1).to(tl.int64)
    which = tl.program_id(2)
    x_row = x_ptr + row * stride_xm
    out_row = out_ptr + row * stride_om
    if which == 0:
        gather_block(x_row, i0, out_row + o0, n0, offs)
    elif which == 1:
        gather_block(x_row, i1, out_row + o1, n1, offs)
    elif which == 2:
        gather_block(x_row, i2, out_row + o2, n2, offs)
    else:
        gather_block(x_row, i3, out_row + o3, n3, offs)


def input_layout(ws: Sequence[QuantWeight]) -> tuple[list[torch.Tensor], list[int], int]:
    """Layout of the shared permuted-input buffer of weights that read one input: (the distinct `x_index`
    tensors in first-appearance order, each weight's column offset, the buffer width). Weights whose x_index is
    the same tensor object (aliased at load by `share_input_orders`) read one copy. Identity only: no device
    sync, so it is free and CUDA-graph safe."""
    unique: list[torch.Tensor] = []
    offsets: list[int] = []
    seen: dict[int, int] = {}
    total = 0
    for w in ws:
        off = seen.get(id(w.x_index))
        if off is None:
            off = seen[id(w.x_index)] = total
            unique.append(w.x_index)
            total += w.x_index.numel()
        offsets.append(off)
    return unique, offsets, total


def buffer_offsets(buf: torch.Tensor, ws: Sequence[QuantWeight]) -> list[int]:
    """Each weight's column offset in `buf`, a permuted-input buffer laid out by `input_layout`; a buffer of
    another width stops with one sentence."""
    _, offsets, total = input_layout(ws)
    if buf.shape[-1] != total:
        raise ValueError(f"the permuted-input buffer is {buf.shape[-1]} wide, the weights' layout {total}.")
    return offsets


def share_input_orders(ws: Sequence[QuantWeight]) -> int:
    """Point the `x_index` of each weight that equals (`torch.equal`) an earlier one's at that tensor, so the
    producers and consumers of their shared input (`input_layout`) write and read one permuted copy instead of
    one per weight. For weights reading one input (q/k/v, gate/up), once at load: the comparison syncs the
    device. Drops the cached launch plans that hold offsets into the buffer. Returns how many were aliased."""
    aliased = 0
    for i, w in enumerate(ws):
        for first in ws[:i]:
            if first.x_index is w.x_index:
                break
            a, b = first.x_index, w.x_index
            if a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b):
                w.x_index = a
                aliased += 1
                break
    if aliased:
        for w in ws:
            for key in [k for k in w._cache if isinstance(k, tuple) and k[0] == "group"]:
                del w._cache[key]
    return aliased


def gather_input(x: torch.Tensor, ws: Sequence[QuantWeight], whole: bool = False):
    """Each weight's permuted input (`QuantWeight.x_index` order) for x `[M, K]`, from one launch for up to four
    distinct input orders of weights that share x (q/k/v, gate/up): the small-batch kernels then read plain
    contiguous rows. Weights with one x_index tensor share one copy (`input_layout`). `whole=True` returns the
    one `[M, total]` buffer instead of the per-weight views."""
    if not ws:
        return []
    unique, _, total = input_layout(ws)
    if not use_triton(x):
        parts = {id(idx): take_columns(x, idx).contiguous() for idx in unique}
        return torch.cat(list(parts.values()), dim=1) if whole else [parts[id(w.x_index)] for w in ws]
    if len(unique) > 4:
        if whole:
            raise ValueError("one gather buffer holds at most four distinct input orders.")
        return gather_input(x, ws[:4]) + gather_input(x, ws[4:])
    sizes = [idx.numel() for idx in unique]
    offs = [sum(sizes[:i]) for i in range(len(unique))]
    m = x.shape[0]
    out = torch.empty((m, total), dtype=x.dtype, device=x.device)
    if m:
        args = []
        for i in range(4):
            j = min(i, len(unique) - 1)
            args += [unique[j], offs[j], sizes[j]]
        block = 1024
        _gather_kernel[(triton.cdiv(max(sizes), block), m, len(unique))](
            x, x.stride(0), out, out.stride(0), *args, BLOCK=block, num_warps=4, **pdl_args(x.device, m))
    return out if whole else split_permuted(out, ws)


def split_permuted(buf: torch.Tensor, ws: Sequence[QuantWeight]) -> list[torch.Tensor]:
    """Each weight's view of a `[M, total]` buffer of permuted inputs laid out by `input_layout` (from
    `gather_input(whole=True)` or a kernel that writes them, such as `rms_norm_gather`)."""
    return [buf[:, o:o + w.x_index.numel()] for w, o in zip(ws, buffer_offsets(buf, ws))]


def permuted_for(x: torch.Tensor, w: QuantWeight, xp: torch.Tensor | None) -> torch.Tensor:
    """x `[M, K]` permuted for w: `xp` when the caller already has it (checked against w), else one gather."""
    if xp is None:
        return gather_input(x, [w])[0]
    if xp.shape != (x.shape[0], w.x_index.numel()) or xp.stride(-1) != 1:
        raise ValueError("the permuted input does not match this weight (use gather_input).")
    return xp
