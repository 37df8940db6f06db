"""The small-batch matmuls of mixture-of-experts layers without a host read: each input row (a token's slot,
token·k + j for its j-th chosen expert) is multiplied by the weight of the expert the router picked for it, found
in per-expert device tables (the weights' addresses, width classes and input orders). Routing on the GPU then
feeds the gemv directly, so a MoE decode step launches a fixed set of kernels and can be captured in a CUDA graph
(`MoE.forward`, `graphs.graph_safe`), where the grouped path waits for the host once a layer and launches a gemv
per active expert.

`RoutedWeights` holds one projection (gate, up or down) of every expert of a layer; its experts may differ in
widths and groups (the decoder of every width they use is compiled in), not in shape. Triton and a PyTorch twin.
"""
from __future__ import annotations

from typing import Sequence

import torch

from exl2.kernels.activation import ACT_ID, glu_torch, glu_values
from exl2.kernels.backend import sm_count, tl, triton, use_triton
from exl2.kernels.gemv import GEMV_BN, GEMV_BS, GEMV_STAGES, GEMV_WARPS, _gemv_widths, fast4_available
from exl2.kernels.matmul_launch import class_args, pairs_view, width_mask
from exl2.kernels.permute import gather_block, take_columns
from exl2.kernels.qweight import QuantWeight, matmul_torch

# Columns of the metadata table: (first step, steps, first word) of the 8/6/5/4/3/2-bit classes, then the
# permuted input's length; of the address table: qweight, scales, zeros, step_group, bias, x_index.
META = tl.constexpr(19)
ADDRS = tl.constexpr(6)


@triton.jit
def _addr(table, col, ELEM: tl.constexpr):
    """The address in column `col` of an address-table row as a pointer to ELEM (16-byte aligned: torch's)."""
    return tl.multiple_of(tl.load(table + col).to(tl.pointer_type(ELEM)), 16)


@triton.jit
def _expert(sel_ptr, s, SEL_N, E_STEP):
    """Slot s's table row: copy s // SEL_N of the choices sel (`RoutedWeights.__call__`)."""
    return tl.load(sel_ptr + s % SEL_N).to(tl.int32) + (s // SEL_N) * E_STEP


@triton.jit
def _routed_gather_kernel(x_ptr, stride_xm, out_ptr, stride_om, sel_ptr, SEL_N, E_STEP, meta_ptr, addr_ptr,
                          ROW_DIV, BLOCK: tl.constexpr):
    """out[s, p] = x[(s % SEL_N) // ROW_DIV, idx_e[p]] (0 where idx_e[p] < 0) for slot s of expert e
    (`_expert`)."""
    s = tl.program_id(1)
    e = _expert(sel_ptr, s, SEL_N, E_STEP)
    n = tl.load(meta_ptr + e * META + META - 1)
    idx = _addr(addr_ptr + e * ADDRS, 5, tl.int32)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    gather_block(x_ptr + ((s % SEL_N) // ROW_DIV).to(tl.int64) * stride_xm, idx,
                 out_ptr + s.to(tl.int64) * stride_om, n, offs)


@triton.jit
def _routed_glu_kernel(gu_ptr, stride_gu, S, out_ptr, stride_om, sel_ptr, meta_ptr, addr_ptr, ACT: tl.constexpr,
                       BLOCK: tl.constexpr):
    """out[s, p] = act(gate_s[c])·up_s[c] with c = idx_e[p] (0 where c < 0): slot s's gated activation in the
    input order of its expert e = sel[s] (this table's weights: the down projections), gate_s and up_s being
    rows s and S + s of gu."""
    s = tl.program_id(1)
    e = tl.load(sel_ptr + s).to(tl.int32)
    n = tl.load(meta_ptr + e * META + META - 1)
    idx = _addr(addr_ptr + e * ADDRS, 5, tl.int32)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    col = tl.load(idx + offs, mask=mask, other=-1)
    y = glu_values(gu_ptr + s.to(tl.int64) * stride_gu, gu_ptr + (S + s).to(tl.int64) * stride_gu, col,
                   mask & (col >= 0), ACT)
    tl.store(out_ptr + s.to(tl.int64) * stride_om + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _routed_gemv_kernel(x_ptr, x32_ptr, stride_xm, X_ROWS, out_ptr, stride_om, stride_ok, sel_ptr, SEL_N, E_STEP,
                        meta_ptr, addr_ptr, wt_ptr, N, SPLIT, MASK: tl.constexpr, HAS_ZEROS: tl.constexpr,
                        HAS_BIAS: tl.constexpr, HAS_WEIGHT: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                        FAST4: tl.constexpr, STAGES: tl.constexpr):
    """Slot s (grid axis 2; input row s % X_ROWS) times its expert's weight (`_expert`; plus bias, times
    wt[s % SEL_N] with HAS_WEIGHT), BN columns (axis 0) over a 1/SPLIT share of the words (axis 1); with
    SPLIT > 1 each share leaves an fp32 partial at out + pid_k·stride_ok (the caller sums them)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    s = tl.program_id(2)
    xs = s % X_ROWS
    e = _expert(sel_ptr, s, SEL_N, E_STEP)
    meta = meta_ptr + e * META
    addr = addr_ptr + e * ADDRS
    qw = _addr(addr, 0, tl.int32)
    sc = _addr(addr, 1, tl.float16)
    zr = _addr(addr, 2, tl.float16)
    sg = _addr(addr, 3, tl.int32)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    xr = x_ptr + xs.to(tl.int64) * stride_xm
    x32r = x32_ptr + xs.to(tl.int64) * (stride_xm // 2)
    res = _gemv_widths(xr, x32r, qw, sc, zr, sg, N, tl.load(meta + 0), tl.load(meta + 1), tl.load(meta + 2),
                       tl.load(meta + 3), tl.load(meta + 4), tl.load(meta + 5), tl.load(meta + 6),
                       tl.load(meta + 7), tl.load(meta + 8), tl.load(meta + 9), tl.load(meta + 10),
                       tl.load(meta + 11), tl.load(meta + 12), tl.load(meta + 13), tl.load(meta + 14),
                       tl.load(meta + 15), tl.load(meta + 16), tl.load(meta + 17), pid_k, SPLIT, offs_n, mask_n,
                       MASK, HAS_ZEROS, BS, BN, FAST4, STAGES)
    if HAS_BIAS:
        if pid_k == 0:
            res += tl.load(_addr(addr, 4, tl.float16) + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        res *= tl.load(wt_ptr + s % SEL_N).to(tl.float32)
    o_ptrs = out_ptr + pid_k.to(tl.int64) * stride_ok + s.to(tl.int64) * stride_om + offs_n
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _slot_sum_kernel(y_ptr, out_ptr, N, OUT_N, stride_split, SPLIT: tl.constexpr, K: tl.constexpr,
                     KP: tl.constexpr, BN: tl.constexpr):
    """out[t, c] = Σ_split Σ_j y[split, t·K + j, c] for c < OUT_N (token t: program row 0; columns: row 1)."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BN + tl.arange(0, BN)
    slots = tl.arange(0, KP)
    mask = (slots[:, None] < K) & (offs[None, :] < OUT_N)
    ptrs = y_ptr + (t.to(tl.int64) * K + slots[:, None]) * N + offs[None, :]
    acc = tl.zeros([KP, BN], dtype=tl.float32)
    for p in tl.static_range(SPLIT):
        acc += tl.load(ptrs + p * stride_split, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * OUT_N + offs, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty),
             mask=offs < OUT_N)


def sum_slots(y: torch.Tensor, k: int, out_n: int, dtype: torch.dtype) -> torch.Tensor:
    """Each token's k slot rows summed, `[N, out_n]` in `dtype`, from the routed gemv's `[N·k, n]` output (or its
    K-split partials `[split, N·k, n]`): one launch for what took a split sum, a reduction and a cast."""
    parts = y if y.dim() == 3 else y[None]
    n = parts.shape[1] // k
    if not use_triton(y):
        return parts.float().sum(0)[:, :out_n].reshape(n, k, out_n).sum(1).to(dtype)
    out = torch.empty((n, out_n), dtype=dtype, device=y.device)
    if n:
        bn = 128
        _slot_sum_kernel[(n, triton.cdiv(out_n, bn))](parts, out, parts.shape[2], out_n, parts.stride(0),
                                                      SPLIT=parts.shape[0], K=k, KP=triton.next_power_of_2(k),
                                                      BN=bn, num_warps=4)
    return out


class RoutedWeights:
    """One projection of every expert of a layer, as the device tables `routed_matmul` reads. The tables hold
    the weights' addresses: the weights are kept referenced here, so they live as long as the tables."""

    def __init__(self, ws: Sequence[QuantWeight]):
        problem = self.problem(ws)
        if problem:
            raise ValueError(problem)
        self.ws = list(ws)
        w0 = self.ws[0]
        self.k, self.n, self.device = w0.k, w0.n, w0.device
        self.has_zeros, self.has_bias = w0.zeros is not None, w0.bias is not None
        self.mask = width_mask(self.ws)
        self.index_len = max(w.x_index.numel() for w in self.ws)
        self.uniform_index = all(w.x_index.numel() == self.index_len for w in self.ws)
        self.n_steps = max(w.n_steps for w in self.ws)
        self._keep = [(w.qweight, w.scales, w.zeros, w.step_group, w.bias, w.x_index) for w in self.ws]
        rows, addrs = [], []
        for w, kept in zip(self.ws, self._keep):
            rows.append(class_args(w)[0] + [w.x_index.numel()])
            addrs.append([(t if t is not None else w.scales).data_ptr() for t in kept])
        self.meta = torch.tensor(rows, dtype=torch.int32, device=self.device)
        self.addrs = torch.tensor(addrs, dtype=torch.int64, device=self.device)

    @staticmethod
    def problem(ws: Sequence[QuantWeight]) -> str | None:
        """Why `ws` cannot share routed tables, or None: one shape, zero-point kind, bias kind and device; fp16
        scales (and bias); int32 input orders."""
        if not ws:
            return "routed weights need at least one expert."
        w0 = ws[0]
        for w in ws:
            if (w.k, w.n, w.zeros is None, w.bias is None, w.device) != (w0.k, w0.n, w0.zeros is None,
                                                                          w0.bias is None, w0.device):
                return "routed experts must agree on shape, zero points, bias and device."
            if w.scales.dtype != torch.float16 or (w.bias is not None and w.bias.dtype != torch.float16):
                return "routed experts need fp16 scales and bias."
            if w.x_index.dtype != torch.int32 or w.qweight.dtype != torch.int32:
                return "routed experts need int32 codes and input orders."
        return None

    def gather(self, x: torch.Tensor, sel: torch.Tensor, row_div: int = 1, scale: torch.Tensor | None = None,
               copies: int = 1, e_step: int = 0) -> torch.Tensor:
        """Each slot's input in its expert's order: `[S, index_len]` from x `[*, K]`, the slots as in `__call__`
        (slot s reads row (s % len(sel)) // row_div), times `scale[s % len(sel)]` when given (Llama 4 scales the
        experts' input by the router weight)."""
        n_sel = sel.numel()
        s = n_sel * copies
        if not use_triton(x):
            experts = self._experts(sel, copies, e_step)
            rows = x[(torch.arange(s, device=x.device) % max(1, n_sel)) // row_div]
            out = torch.stack([take_columns(rows[i], self._padded_index(e)) for i, e in enumerate(experts)]) \
                if s else x.new_zeros((0, self.index_len))
        else:
            x = x if x.stride(-1) == 1 else x.contiguous()
            out = self._inputs(s, x)
            if s:
                block = 1024
                _routed_gather_kernel[(triton.cdiv(self.index_len, block), s)](
                    x, x.stride(0), out, out.stride(0), sel, n_sel, e_step, self.meta, self.addrs, row_div,
                    BLOCK=block, num_warps=4)
        return out if scale is None else out * scale.to(out.dtype).repeat(copies)[:, None]

    @staticmethod
    def _experts(sel: torch.Tensor, copies: int, e_step: int) -> list[int]:
        """The table row of every slot (the twins' `_expert`)."""
        return [int(e) + c * e_step for c in range(copies) for e in sel.reshape(-1).tolist()]

    def glu_gather(self, gu: torch.Tensor, sel: torch.Tensor, activation: str) -> torch.Tensor:
        """Each slot's gated activation act(gate)·up in its expert's input order of this table's weights (the
        down projections): gu `[2S, ≥ K]` holds slot s's gate in row s and its up in row S + s (the routed
        gate/up matmul's output). `[S, index_len]`, in one launch where `gather(glu(...))` takes two."""
        s = sel.numel()
        if not use_triton(gu):
            return self.gather(glu_torch(gu[:s, : self.k], gu[s:, : self.k], activation), sel)
        gu = gu if gu.stride(-1) == 1 else gu.contiguous()
        out = self._inputs(s, gu)
        if s:
            block = 1024
            _routed_glu_kernel[(triton.cdiv(self.index_len, block), s)](
                gu, gu.stride(0), s, out, out.stride(0), sel, self.meta, self.addrs, ACT=ACT_ID[activation],
                BLOCK=block, num_warps=4)
        return out

    def _inputs(self, slots: int, like: torch.Tensor) -> torch.Tensor:
        """The `[slots, index_len]` buffer of the slots' permuted inputs: positions past a shorter input order must
        read 0, so it is cleared only where the orders differ in length."""
        alloc = torch.empty if self.uniform_index else torch.zeros
        return alloc((slots, self.index_len), dtype=like.dtype, device=like.device)

    def _padded_index(self, e: int) -> torch.Tensor:
        idx = self.ws[e].x_index
        pad = self.index_len - idx.numel()
        return idx if not pad else torch.cat([idx, idx.new_full((pad,), -1)])

    def split_for(self, slots: int) -> int:
        """K split so that about two programs run per SM, keeping at least 8 steps a program."""
        programs = triton.cdiv(self.n, GEMV_BN) * slots
        split = 1
        while split < 16 and programs * split * 2 <= 2 * sm_count(self.device) and \
                self.n_steps // (split * 2) >= 8:
            split *= 2
        return split

    def __call__(self, xp: torch.Tensor, sel: torch.Tensor, split: int | None = None,
                 weight: torch.Tensor | None = None, copies: int = 1, e_step: int = 0) -> torch.Tensor:
        """The slots are `copies` copies of the router's choices sel (any integer dtype, read as given): slot s
        is table row sel[s % len(sel)] + (s // len(sel))·e_step (a table of gate's experts then up's computes
        both with copies=2). Slot s's permuted input xp[s % len(xp)] (`gather`) times its expert's weight (plus
        its bias, times `weight[s % len(sel)]` when given): `[S, N]` in xp's dtype, or with a K split the fp32
        partials `[split, S, N]` (sum over dim 0)."""
        n_sel = sel.numel()
        s = n_sel * copies
        if not use_triton(xp):
            experts = self._experts(sel, copies, e_step)
            out = torch.stack([self._twin_row(xp[i % xp.shape[0]], e) for i, e in enumerate(experts)]) \
                if s else xp.new_zeros((0, self.n))
            if weight is not None:
                out = (out.float() * weight.reshape(-1).float().repeat(copies)[:, None]).to(out.dtype)
            return out
        if xp.shape[1] != self.index_len or xp.stride(-1) != 1:
            raise ValueError("the routed input must be `gather`'s output for these experts.")
        split = self.split_for(s) if split is None else split
        if split > 1:
            out = torch.empty((split, s, self.n), dtype=torch.float32, device=xp.device)
        else:
            out = torch.empty((s, self.n), dtype=xp.dtype, device=xp.device)
        if s:
            fast4, x32 = pairs_view(xp, fast4_available(xp.device))
            _routed_gemv_kernel[(triton.cdiv(self.n, GEMV_BN), split, s)](
                xp, x32, xp.stride(0), xp.shape[0], out, self.n, s * self.n, sel, n_sel, e_step, self.meta,
                self.addrs, weight if weight is not None else sel, self.n, split, MASK=self.mask,
                HAS_ZEROS=self.has_zeros,
                HAS_BIAS=self.has_bias, HAS_WEIGHT=weight is not None, BS=GEMV_BS, BN=GEMV_BN, FAST4=fast4,
                STAGES=GEMV_STAGES, num_warps=GEMV_WARPS, num_stages=GEMV_STAGES)
        return out

    def _twin_row(self, xp_row: torch.Tensor, e: int) -> torch.Tensor:
        w = self.ws[e]
        idx = w.x_index.long()
        x = torch.zeros((1, w.k), dtype=xp_row.dtype, device=xp_row.device)
        keep = idx >= 0
        x[:, idx[keep]] = xp_row[: idx.numel()][keep][None]
        return matmul_torch(x, w)[0]


def routed_matmul_torch(x: torch.Tensor, sel: torch.Tensor, ws: Sequence[QuantWeight], row_div: int = 1
                        ) -> torch.Tensor:
    """The reference: slot s is x[s // row_div] times ws[sel[s]] (`[S, N]`)."""
    return torch.stack([matmul_torch(x[i // row_div][None], ws[int(e)])[0] for i, e in enumerate(sel.tolist())])
