"""Triton kernels and their plain-PyTorch twins (same signatures); they know nothing of models.

Modules: `backend` (dispatch: Triton on CUDA, twins on CPU, `force_triton()` for the interpreter in tests),
`norm`, `rotary`, `activation`; the quantized matmul: `qweight` (the kernels' weight layout and the twin),
`quant_matmul` (the dispatcher) over `gemv`, `mma_dot` (Gluon), `dot`, `dequant` and `fp8_prefill` (opt-in e4m3
prompt matmuls), with `permute` (permuted inputs), `matmul_launch`, `packed_tiles` and `split_sum` beneath them,
and the format loaders `exl2_matmul`, `gptq_matmul`; `attention` (paged decode / chunked prefill, prefill),
`kv_quant` (quantized KV cache). Import the submodules directly; this package imports nothing so that
`import exl2.kernels` stays cheap.
"""
