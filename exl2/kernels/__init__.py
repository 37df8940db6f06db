"""Triton kernels and their plain-PyTorch twins (same signatures); they know nothing of models.

Modules: `backend` (dispatch: Triton on CUDA, twins on CPU, `force_triton()` for the interpreter in tests),
`norm`, `rotary`, `activation`, `qweight` + `quant_matmul` (quantized matmul core), `exl2_matmul`, `gptq_matmul`,
`attention` (paged decode / chunked prefill, prefill), `kv_quant` (quantized KV cache). Import the submodules
directly; this package imports nothing so that `import exl2.kernels` stays cheap.
"""
