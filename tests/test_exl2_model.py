"""Quantized models end to end on CPU: the golden EXL2 files (made by exllamav2) run through exl2 exactly like a
float32 transformers forward pass over their dequantized weights."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl2.formats.exl2 import dequantize
from exl2.runtime.loader import load_model

GOLDEN = Path(__file__).parent / "fixtures" / "golden"


def dequantized_hf_dir(qdir: Path, out: Path) -> Path:
    """A plain HF directory holding the dequantized weights of an EXL2 model (the independent reference)."""
    tensors = load_file(qdir / "output.safetensors")
    dense = {}
    prefixes = {k[: -len(".q_weight")] for k in tensors if k.endswith(".q_weight")}
    for p in prefixes:
        w = dequantize(tensors, p)
        dense[f"{p}.weight"] = w.t().contiguous()
    for k, v in tensors.items():
        if not any(k.startswith(p + ".") for p in prefixes):
            dense[k] = v
    out.mkdir(parents=True, exist_ok=True)
    save_file(dense, out / "model.safetensors")
    cfg = json.loads((qdir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / f).write_bytes((qdir / f).read_bytes())
    return out


@pytest.fixture(scope="module")
def reference_ids():
    return load_file(GOLDEN / "src" / "reference_logits_fp16_hf.safetensors")["input_ids"]


@pytest.mark.parametrize("name", ["b3.0_hb6", "b4.0_hb6", "b6.0_hb6"])
def test_logits_match_transformers_on_dequantized_weights(tmp_path, reference_ids, name):
    from transformers import AutoModelForCausalLM

    ref_dir = dequantized_hf_dir(GOLDEN / name, tmp_path / "deq")
    hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    ours = load_model(GOLDEN / name, "cpu")
    with torch.no_grad():
        ref = torch.log_softmax(hf(reference_ids).logits.float(), -1)
        got = torch.log_softmax(ours(reference_ids), -1)
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    assert kl <= 1e-4, kl
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() == 1.0


@pytest.mark.parametrize("name,expected", [("b3.0_hb6", 0.036), ("b4.0_hb6", 0.0077), ("b6.0_hb6", 0.00056)])
def test_kl_to_fp16_source_matches_published_figures(reference_ids, name, expected):
    """The golden README gives the KL of each file's float32 forward from the fp16 source logits; ±10 %."""
    ref = load_file(GOLDEN / "src" / "reference_logits_fp16_hf.safetensors")["logits"].float()
    with torch.no_grad():
        got = load_model(GOLDEN / name, "cpu")(reference_ids)
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    assert abs(kl - expected) <= 0.1 * expected, kl


def test_generate_greedy_on_exl2_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from exl2.generation.tokenizer import Tokenizer

    qdir = GOLDEN / "b4.0_hb6"
    prompt = "Once upon a time"
    r = subprocess.run([sys.executable, "-m", "exl2.cli.main", "generate", "-m", str(qdir), "-p", prompt,
                        "--max-new-tokens", "16", "--temperature", "0", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    tok = Tokenizer.from_dir(qdir)
    ids = torch.tensor([tok.encode(prompt)])
    hf = AutoModelForCausalLM.from_pretrained(dequantized_hf_dir(qdir, tmp_path / "deq"), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=2)
    assert r.stdout.rstrip("\n") == tok.decode(out[0, ids.shape[1]:].tolist())


@pytest.mark.parametrize("name", ["b3.0_hb6", "b4.0_hb6", "b6.0_hb6"])
def test_info_shows_bit_mix(name):
    r = subprocess.run([sys.executable, "-m", "exl2.cli.main", "info", str(GOLDEN / name), "--layers"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "EXL2" in r.stdout and "lm_head" in r.stdout and "effective bits per weight" in r.stdout
