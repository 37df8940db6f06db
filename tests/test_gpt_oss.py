"""gpt-oss beyond the parity fixture (test_decoder_parity `gpt_oss`): MXFP4 experts dequantize exactly as
transformers' converter does and a checkpoint holding them gives the bf16 model's logits, the clamped SwiGLU
equals GptOssExperts' gate (torch and Triton twins, values past the clamp), and the dynamic generator (paged cache,
attention sinks over the pages read back, chunked prefill) decodes transformers' greedy tokens."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl2.formats.safetensors_io import TensorSource, dequantize_mxfp4
from exl2.kernels.activation import glu, glu_torch
from exl2.runtime.loader import load_model
from tiny_models import build_tiny, reference_decode


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))


def test_mxfp4_dequantizes_as_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 136, (3, 40, 4), generator=g, dtype=torch.uint8)
    assert torch.equal(dequantize_mxfp4(blocks, scales), convert_moe_packed_tensors(blocks.clone(), scales.clone()))


def test_an_mxfp4_checkpoint_is_its_bf16_model(tiny, tmp_path):
    """Experts stored as MXFP4 blocks and scales (random codes) read as the bf16 experts they stand for: the same
    tensor, and the same logits as a checkpoint holding those bf16 values."""
    g = torch.Generator().manual_seed(1)
    tensors = load_file(tiny / "model.safetensors")
    packed, plain = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, h, out = t.shape                             # [E, in, out]
            blocks = torch.randint(0, 256, (e, out, h // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(122, 128, (e, out, h // 32), generator=g, dtype=torch.uint8)
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            plain[name] = dequantize_mxfp4(blocks, scales).float()
        else:
            packed[name] = plain[name] = t
    dirs = []
    for label, content in (("mxfp4", packed), ("plain", plain)):
        d = tmp_path / label
        shutil.copytree(tiny, d)
        save_file(content, str(d / "model.safetensors"))
        dirs.append(d)
    src = TensorSource(dirs[0])
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert name in src and not any(k.endswith(("_blocks", "_scales")) for k in src.keys())
    assert src.dtype_name(name) == "BF16" and src.shape(name) == list(plain[name].shape)
    assert torch.equal(src[name].float(), plain[name])
    ids = torch.randint(0, 256, (1, 20), generator=g)
    with torch.no_grad():
        assert torch.equal(load_model(dirs[0], "cpu")(ids), load_model(dirs[1], "cpu")(ids))


def test_clamped_swiglu_is_gpt_oss_gate():
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    g = torch.Generator().manual_seed(2)
    fused = torch.randn(5, 64, generator=g) * 6          # past the ±7 clamp often
    want = GptOssExperts._apply_gate(SimpleNamespace(alpha=1.702, limit=7.0), fused)
    gate, up = fused[:, 0::2].contiguous(), fused[:, 1::2].contiguous()
    for fn in (glu, glu_torch):
        assert torch.allclose(fn(gate, up, "gptoss"), want, atol=1e-5, rtol=1e-5)


def test_dynamic_generator_decodes_transformers_tokens(tiny):
    """Sinks in the paged cache's read-back attention, prefill chunks of 8 over pages of 4: transformers' greedy."""
    from exl2.config import SamplingSettings
    from exl2.generation.dynamic import DynamicGenerator, Job
    from exl2.generation.tokenizer import Tokenizer

    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(3))
    _, _, want = reference_decode(tiny, ids, 10)
    model = load_model(tiny, "cpu")
    tok = Tokenizer.from_dir(__import__("test_cli").SRC)          # any tokenizer: the job is token ids
    for kw in ({}, {"page_size": 4, "chunk": 8}):
        gen = DynamicGenerator(model, tok, 256, **kw)
        job = Job(ids.tolist(), SamplingSettings(temperature=0), 10, ignore_eos=True)
        assert gen.generate([job])[0].token_ids == want.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpt_oss_on_the_gpu_matches_transformers(tmp_path):
    """fp16 on CUDA (sinks in the paged kernel's one-split and merged paths, the clamped SwiGLU in the GLU kernel,
    biased experts, YaRN) against transformers in float32 on the CPU: prompt logits within 2 % of their largest,
    and the greedy tokens of the dynamic generator for at least 8 of 10 steps (fp16 may round a near-tie)."""
    from exl2.config import SamplingSettings
    from exl2.generation.dynamic import DynamicGenerator, Job
    from exl2.generation.tokenizer import Tokenizer

    d = build_tiny("gpt_oss", tmp_path)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5))
    ref, _, want = reference_decode(d, ids, 10)
    model = load_model(d, "cuda")
    with torch.no_grad():
        ours = model(ids[None].cuda()).float().cpu()[0]
    assert (ours - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    tok = Tokenizer.from_dir(__import__("test_cli").SRC)
    for splits in (None, 1):
        gen = DynamicGenerator(model, tok, 256)
        gen.cache.decode_splits = splits
        got = gen.generate([Job(ids.tolist(), SamplingSettings(temperature=0), 10, ignore_eos=True)])[0].token_ids
        agree = next((i for i, (a, b) in enumerate(zip(got, want.tolist())) if a != b), 10)
        assert agree >= 8, (got, want.tolist())
