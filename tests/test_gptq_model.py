"""A whole GPTQ model directory (built here by RTN from the golden fp16 model) runs through exl2 exactly like a
float32 transformers forward over the weights the GPTQ tensors encode."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl2.formats.gptq import dequantize_gptq, pack_gptq
from exl2.runtime.loader import load_model

from test_exl2_model import GOLDEN


def rtn_gptq(w: torch.Tensor, group: int, bits: int, act_order: bool, gen: torch.Generator, fmt: str):
    """Asymmetric round-to-nearest codes for W [K, N] (natural order), optionally with a shuffled g_idx."""
    k, n = w.shape
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    groups = k // group
    maxq = 2 ** bits - 1
    lo = torch.stack([w[g_idx == g].min(0).values for g in range(groups)]).clamp(max=0)
    hi = torch.stack([w[g_idx == g].max(0).values for g in range(groups)]).clamp(min=0)
    scales = ((hi - lo) / maxq).clamp(min=1e-5).half()
    zeros = (-lo / scales.float()).round().clamp(1, maxq)
    codes = (w / scales.float()[g_idx] + zeros[g_idx]).round().clamp(0, maxq)
    return pack_gptq(codes.long(), zeros.long(), scales, g_idx if act_order else None, bits, fmt)


@pytest.mark.parametrize("act_order,fmt", [(False, "gptq"), (True, "gptq"), (True, "gptq_v2")])
def test_gptq_directory_matches_transformers(tmp_path, act_order, fmt):
    from transformers import AutoModelForCausalLM

    src = load_file(GOLDEN / "src" / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    qdir, ddir = tmp_path / "gptq", tmp_path / "dense"
    qdir.mkdir()
    shutil.copytree(GOLDEN / "src", ddir, ignore=shutil.ignore_patterns("*.safetensors"))
    qt, dense = {}, {}
    for name, t in src.items():
        layer = name[: -len(".weight")]
        if t.dim() == 2 and ("proj" in name or name.startswith("lm_head")):
            packed = rtn_gptq(t.float().t().contiguous(), 32, 4, act_order, gen, fmt)
            qt.update({f"{layer}.{k}": v for k, v in packed.items()})
            dense[name] = dequantize_gptq(qt, layer, fmt).t().contiguous()
        else:
            qt[name] = dense[name] = t
    save_file(qt, qdir / "model.safetensors")
    save_file(dense, ddir / "model.safetensors")
    cfg = json.loads((GOLDEN / "src" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": act_order,
                                  "checkpoint_format": fmt}
    (qdir / "config.json").write_text(json.dumps(cfg))
    ids = load_file(GOLDEN / "src" / "reference_logits_fp16_hf.safetensors")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    ours = load_model(qdir, "cpu")
    assert ours.layers[0].self_attn.q_proj.info["format"] == "gptq"
    with torch.no_grad():
        p = torch.log_softmax(hf(ids).logits.float(), -1)
        q = torch.log_softmax(ours(ids), -1)
    assert (p.exp() * (p - q)).sum(-1).mean().item() <= 1e-6
