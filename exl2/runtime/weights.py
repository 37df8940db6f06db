"""Turn the tensors of a model directory into decoder modules: picks the format of each linear layer by which
tensors exist (`q_weight` → EXL2, `qweight` → GPTQ, `weight` → dense), like exllamav2."""
from __future__ import annotations

from typing import Optional

import torch

from exl2.errors import FormatError, ModelLoadError
from exl2.formats.safetensors_io import TensorSource
from exl2.runtime.linear import Linear


class WeightLoader:
    """Implements exl2.models.decoder.WeightProvider over a TensorSource."""

    def __init__(self, source: TensorSource, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 checkpoint_format: str = "gptq", gptq_bits: int = 4, use_kernels: Optional[bool] = None):
        self.src = source
        self.device = torch.device(device)
        self.dtype = dtype
        self.checkpoint_format = checkpoint_format
        self.gptq_bits = gptq_bits
        self.use_kernels = (self.device.type == "cuda") if use_kernels is None else use_kernels

    def has(self, name: str) -> bool:
        return name in self.src

    def embedding_only(self) -> bool:
        """Whether the files are a base model without an output head (an embedding model, e.g. Qwen3-Embedding)."""
        only = getattr(self.src, "embedding_only", None)   # TensorSource's; a DictSource never is
        return bool(only and only())

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.src:
            raise ModelLoadError(f"The model files lack the tensor {name!r}.")
        return self.src[name].to(device=self.device, dtype=self.dtype)

    def _bias(self, prefix: str, out: int, bias: bool) -> Optional[torch.Tensor]:
        name = f"{prefix}.bias"
        if name not in self.src:
            if bias:
                raise ModelLoadError(f"The model files lack the tensor {name!r}.")
            return None
        return self.src[name][:out].to(device=self.device, dtype=self.dtype)

    def _dense_matrix(self, prefix: str) -> tuple[torch.Tensor, dict]:
        """[out, in] weight of any format, in compute dtype, plus format info."""
        if f"{prefix}.q_weight" in self.src:
            from exl2.formats.exl2 import bit_mix, dequantize
            w = dequantize(self.src, prefix).t()
            return w, {"format": "exl2", "bits": bit_mix(self.src, prefix)}
        if f"{prefix}.qweight" in self.src:
            from exl2.formats.gptq import dequantize_gptq
            w = dequantize_gptq(self.src, prefix, self.checkpoint_format, self.gptq_bits).t()
            return w, {"format": "gptq"}
        if f"{prefix}.weight" in self.src:
            return self.src[f"{prefix}.weight"], {"format": "dense"}
        raise ModelLoadError(f"The model files lack the weights of layer {prefix!r}.")

    def _kernel(self, prefix: str):
        """A GPU kernel object for a quantized layer, or None to use the dense path."""
        if not self.use_kernels:
            return None
        try:
            if f"{prefix}.q_weight" in self.src:
                from exl2.kernels.exl2_matmul import Exl2Weight
                return Exl2Weight.from_tensors(self.src, prefix, self.device)
            if f"{prefix}.qweight" in self.src:
                from exl2.kernels.gptq_matmul import GptqWeight
                return GptqWeight.from_tensors(self.src, prefix, self.device, self.checkpoint_format,
                                               self.gptq_bits)
        except ImportError:
            return None
        return None

    def linear(self, prefix: str, in_features: int, out_features: int, bias: bool) -> Linear:
        kernel = self._kernel(prefix)
        if kernel is not None:  # the kernel weight carries the bias
            if bias and kernel.bias is None:
                raise ModelLoadError(f"The model files lack the tensor {prefix + '.bias'!r}.")
            if kernel.k != in_features or kernel.n < out_features:
                raise FormatError(f"Layer {prefix!r} holds a {kernel.k}×{kernel.n} matrix, expected "
                                  f"{in_features}×{out_features}.")
            info = {"format": "exl2" if f"{prefix}.q_weight" in self.src else "gptq"}
            return Linear(in_features, out_features, None, None, kernel, info, source=(prefix, 0, out_features))
        b = self._bias(prefix, out_features, bias)
        w, info = self._dense_matrix(prefix)
        w = w[:out_features]
        if tuple(w.shape) != (out_features, in_features):
            raise FormatError(f"Layer {prefix!r} has shape {tuple(w.shape)}, expected {(out_features, in_features)}.")
        return Linear(in_features, out_features, w.to(device=self.device, dtype=self.dtype).contiguous(), b,
                      info=info, source=(prefix, 0, out_features))

    def linears_split(self, prefix: str, in_features: int, sizes: list[int], bias: bool) -> list[Linear]:
        """Split a fused dense projection (Phi-3 qkv_proj, gate_up_proj) into separate linears."""
        w, info = self._dense_matrix(prefix)
        if w.shape[0] < sum(sizes) or w.shape[1] != in_features:
            raise FormatError(f"Fused layer {prefix!r} has shape {tuple(w.shape)}, expected ({sum(sizes)}, {in_features}).")
        b = self._bias(prefix, sum(sizes), bias)
        out, start = [], 0
        for n in sizes:
            part = w[start:start + n].to(device=self.device, dtype=self.dtype).contiguous()
            out.append(Linear(in_features, n, part, None if b is None else b[start:start + n].contiguous(),
                              info=info, source=(prefix, start, start + n)))
            start += n
        return out

    def expert_linears(self, prefix: str, num: int, hidden: int, dim: int, interleaved: bool = False,
                       bias: bool = False) -> list[tuple[Linear, Linear, Linear]]:
        """(gate, up, down) per expert, from per-expert tensors (Mixtral w1/w3/w2 or gate/up/down_proj) or from
        fused 3-D tensors (`experts.gate_up_proj` [E, H, 2I] and `experts.down_proj` [E, I, H]). gpt-oss
        (`interleaved`, `bias`): gate and up alternate in the fused columns, and `gate_up_proj_bias` [E, 2I] and
        `down_proj_bias` [E, H] go with them."""
        fused = f"{prefix}.gate_up_proj"
        if fused in self.src or f"{fused}.weight" in self.src:
            gu = self.src[fused] if fused in self.src else self.src[f"{fused}.weight"]
            dn = self.src.get(f"{prefix}.down_proj")
            if dn is None:
                dn = self.src[f"{prefix}.down_proj.weight"]
            # [E, in, out] (Llama 4's files) or [E, out, in] (transformers 5's Qwen3-VL-MoE): both tensors alike,
            # told by whichever has unequal sides (2I = H makes gate_up alone ambiguous)
            in_out = dn.shape[1] == dim if dim != hidden else gu.shape[1] == hidden
            gu_b = self.src.get(f"{prefix}.gate_up_proj_bias") if bias else None
            dn_b = self.src.get(f"{prefix}.down_proj_bias") if bias else None

            def mk(m, i, o, b=None):
                put = lambda t: t.to(device=self.device, dtype=self.dtype).contiguous()  # noqa: E731
                return Linear(i, o, put(m), None if b is None else put(b), info={"format": "dense"})

            out = []
            for e in range(num):
                w = gu[e].t() if in_out else gu[e]           # [2I, H]
                g, u = (w[0::2], w[1::2]) if interleaved else w.chunk(2, dim=0)
                gb = ub = None
                if gu_b is not None:
                    gb, ub = (gu_b[e][0::2], gu_b[e][1::2]) if interleaved else gu_b[e].chunk(2)
                d = dn[e].t() if in_out else dn[e]
                out.append((mk(g, hidden, dim, gb), mk(u, hidden, dim, ub),
                            mk(d, dim, hidden, None if dn_b is None else dn_b[e])))
            return out
        names = ("w1", "w3", "w2") if f"{prefix}.0.w1.weight" in self.src or f"{prefix}.0.w1.q_weight" in self.src \
            else ("gate_proj", "up_proj", "down_proj")
        return [(self.linear(f"{prefix}.{e}.{names[0]}", hidden, dim, bias),
                 self.linear(f"{prefix}.{e}.{names[1]}", hidden, dim, bias),
                 self.linear(f"{prefix}.{e}.{names[2]}", dim, hidden, bias)) for e in range(num)]
