"""FP8 checkpoints read as plain models (exl2.formats.safetensors_io): float8 weights with block scales
(`weight_scale_inv`, DeepSeek-V3 / GLM-4.5-FP8: here config.json's 24 × 24 blocks on 64-wide matrices, whose
last blocks are 16 wide, which the grid alone would not tell)
or per-row scales (`weight_scale`, compressed-tensors, with an `input_scale` beside it) come out as weight × scale
in bfloat16, computed independently here in plain PyTorch; the scales are hidden; the model loads and gives the
dequantized model's logits exactly; a scale grid that does not tile its weight is a clear error."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_models import build_tiny

from exl2.errors import ModelLoadError
from exl2.formats.safetensors_io import TensorSource
from exl2.runtime.loader import load_model

E4M3_MAX = 448.0


def _blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, its [ceil(out/b), ceil(in/b)] scales, the dequantized weight) of `w`, block by block."""
    out, inp = w.shape
    rows, cols = -(-out // block), -(-inp // block)
    scale = torch.empty(rows, cols)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    deq = torch.empty(out, inp)
    for r in range(rows):
        for c in range(cols):
            part = w[r * block:(r + 1) * block, c * block:(c + 1) * block]
            s = part.abs().max().clamp(min=1e-8) / E4M3_MAX
            scale[r, c] = s
            q[r * block:(r + 1) * block, c * block:(c + 1) * block] = (part / s).to(torch.float8_e4m3fn)
            deq[r * block:(r + 1) * block, c * block:(c + 1) * block] = \
                q[r * block:(r + 1) * block, c * block:(c + 1) * block].float() * s
    return q, scale, deq


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The tiny Llama as FP8 (block scales on attention, per-row scales and an input scale on the MLP) and as the
    bfloat16 model those float8 weights and scales stand for."""
    root = tmp_path_factory.mktemp("fp8")
    src = build_tiny("llama", root / "src")
    fp8, plain = root / "fp8", root / "plain"
    for d in (fp8, plain):
        shutil.copytree(src, d)
        for f in d.glob("*.safetensors"):
            f.unlink()
    tensors = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight") and w.ndim == 2:
            base = name[: -len(".weight")]
            if ".self_attn." in name:
                q, scale, deq = _blocks(w.float(), 24)
                quantized[f"{base}.weight_scale_inv"] = scale
            else:
                scale = w.float().abs().amax(1, keepdim=True) / E4M3_MAX
                q = (w.float() / scale).to(torch.float8_e4m3fn)
                deq = q.float() * scale
                quantized[f"{base}.weight_scale"] = scale
                quantized[f"{base}.input_scale"] = torch.tensor(0.5)
            quantized[name] = q
            dequantized[name] = deq.to(torch.bfloat16)
        else:
            quantized[name] = dequantized[name] = w
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(dequantized, str(plain / "model.safetensors"))
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [24, 24]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    return fp8, plain, dequantized


def test_weights_read_dequantized_and_scales_hidden(dirs):
    fp8, _, dequantized = dirs
    src = TensorSource(fp8)
    names = set(src.keys())
    assert not any(n.endswith(("_scale_inv", "_scale", "input_scale")) for n in names)
    assert names == set(dequantized)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.layers.0.mlp.down_proj.weight"):
        got = src[name]
        assert got.dtype == torch.bfloat16 and src.dtype_name(name) == "BF16"
        assert torch.equal(got, dequantized[name])


def test_the_fp8_model_gives_the_dequantized_models_logits(dirs):
    fp8, plain, _ = dirs
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_model(fp8, "cpu")(ids), load_model(plain, "cpu")(ids))


def test_a_scale_grid_that_does_not_tile_is_an_error(tmp_path):
    weight = torch.zeros(64, 64).to(torch.float8_e4m3fn)
    save_file({"model.layers.0.mlp.up_proj.weight": weight,
               "model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(3, 5)}, str(tmp_path / "m.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": [16, 16]}}))
    with pytest.raises(ModelLoadError, match="does not tile"):
        TensorSource(tmp_path)["model.layers.0.mlp.up_proj.weight"]
