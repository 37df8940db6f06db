"""The `exl2` command as a user meets it: output of generate/info, and one-sentence errors with exit code 2."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SRC = Path(__file__).parent / "fixtures" / "golden" / "src"


def exl2(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "exl2.cli.main", *args], capture_output=True, text=True,
                          input=stdin, timeout=300)


def assert_user_error(r, *words):
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_generate_greedy_matches_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The quick brown fox"
    r = exl2("generate", "-m", str(SRC), "-p", prompt, "--max-new-tokens", "20", "--temperature", "0",
             "--device", "cpu")
    assert r.returncode == 0, r.stderr
    tok = AutoTokenizer.from_pretrained(SRC)
    model = AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.float32).eval()
    from exl2.generation.tokenizer import Tokenizer

    # Same prompt ids for both (the model's tokenizer_config asks for a BOS, which exl2 adds).
    ids = torch.tensor([Tokenizer.from_dir(SRC).encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                             eos_token_id=None, pad_token_id=2)
    expected = tok.decode(out[0, ids.shape[1]:])
    assert r.stdout.rstrip("\n") == expected


def test_info_dense():
    r = exl2("info", str(SRC))
    assert r.returncode == 0, r.stderr
    assert "LlamaForCausalLM" in r.stdout and "fp16" in r.stdout and "2048" in r.stdout


def test_missing_directory(tmp_path):
    assert_user_error(exl2("generate", "-m", str(tmp_path / "nope"), "-p", "x"), "does not exist")


def test_directory_without_config(tmp_path):
    assert_user_error(exl2("info", str(tmp_path)), "config.json")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    assert_user_error(exl2("info", str(tmp_path)), "FalconForCausalLM", "LlamaForCausalLM", "Gemma2ForCausalLM")


def test_truncated_safetensors(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(SRC, d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_user_error(exl2("generate", "-m", str(d), "-p", "hi", "--device", "cpu"), "truncated")


def test_prompt_longer_than_context():
    r = exl2("generate", "-m", str(SRC), "-p", "word " * 3000, "--device", "cpu", "-l", "1024")
    assert_user_error(r, "context")


def test_invalid_sampling_value():
    assert_user_error(exl2("generate", "-m", str(SRC), "-p", "x", "--top-p", "0"), "top_p")


def test_help_documents_flags():
    r = exl2("generate", "--help")
    assert r.returncode == 0
    for flag in ("--prompt", "--max-new-tokens", "--temperature", "--top-p", "--seed", "--device"):
        assert flag in r.stdout


def test_chat_piped(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(SRC, d)
    r = exl2("chat", "-m", str(d), "--temperature", "0", "-maxr", "8", "--device", "cpu", stdin="hello\n/clear\nagain\n")
    assert r.returncode == 0, r.stderr
    replies = [b for b in r.stdout.split("\n\n") if b.strip()]
    assert len(replies) == 2


def test_quantized_cache_needs_head_dim_64():
    # the golden model has head_dim 64: q4 works; a model with head_dim 16 gets one clear sentence
    assert exl2("generate", "-m", str(SRC), "-p", "x", "-n", "2", "-cm", "q4", "--device", "cpu").returncode == 0


def test_quantized_cache_rejects_small_heads(tmp_path):
    from tiny_models import build_tiny
    d = build_tiny("llama", tmp_path / "m")
    shutil.copy(SRC / "tokenizer.json", d)
    shutil.copy(SRC / "tokenizer_config.json", d)
    assert_user_error(exl2("generate", "-m", str(d), "-p", "x", "-cm", "q4", "--device", "cpu"), "divisible by 64")


@pytest.mark.parametrize("args,word", [(["--modes", "q5"], "--modes"), (["--contexts", "12x"], "--contexts"),
                                       (["--batch", "0"], "--batch"), (["--breakdown-batch", "3"], "--breakdown-batch"),
                                       (["--breakdown-mode", "q5"], "--breakdown-mode")])
def test_bench_rejects_bad_options_in_one_sentence(args, word):
    """Checked before anything touches the GPU, so the same on machines with and without one."""
    assert_user_error(exl2("bench", *args), word)
