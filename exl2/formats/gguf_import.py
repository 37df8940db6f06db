"""`exl2 import-gguf`: turn a llama.cpp GGUF file into a Hugging Face fp16 directory.

Tensors are dequantized with the `gguf` package and renamed to HF names; llama.cpp's permutation of Q/K rows
(its RoPE pairs adjacent dims, HF's rotate_half pairs halves) is undone; config.json, tokenizer.json,
tokenizer_config.json and generation_config.json are rebuilt from the metadata. Everything is written to a
temporary directory that is renamed into place at the end, so a failed import leaves nothing half-written.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from exl2.errors import ConfigError, FormatError, ModelLoadError
from exl2.formats.writer import replace_dir
from exl2.models.rope import llama3_inv_freq

# Bump when the output of the importer changes, so cached imports (see models/default_model.py) are redone.
IMPORTER_VERSION = 1
MARKER_FILE = "exl2_import.json"
_SHARD_BYTES = 4 << 30

# GGUF architecture -> (HF class, model_type, whether llama.cpp permuted Q/K rows).
# llama.cpp stores Mistral models under the llama architecture.
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp derives from metadata or stores for its own kernels; HF recomputes them.
_ROPE_FREQS = "rope_freqs.weight"   # llama.cpp's per-frequency RoPE divisors (Llama 3.1+): become rope_scaling
_SKIPPED = {_ROPE_FREQS}
# Llama 3.x's published llama3 RoPE settings, tried in this order to explain a rope_freqs tensor.
_LLAMA3_LOW, _LLAMA3_HIGH, _LLAMA3_ORIG = (1.0, 2.0), (4.0, 2.0, 8.0), (8192, 4096, 16384, 32768, 131072)
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# Pre-tokenizer regexes of the BPE vocabularies llama.cpp names in tokenizer.ggml.pre.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_KINDS = {
    "default": "gpt2", "gpt-2": "gpt2", "gpt2": "gpt2", "phi-2": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits",
    "llama-bpe": "llama3", "llama3": "llama3", "smaug-bpe": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2",
}

# gguf.TokenType values
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


# ---- reading ---------------------------------------------------------------------------------------------------

def _open(gguf_path: Path):
    from gguf import GGUFReader

    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file {gguf_path} does not exist.")
    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise FormatError(f"{gguf_path} is not a GGUF file (it does not start with the GGUF magic bytes).")
    try:
        return GGUFReader(str(gguf_path), "r")
    except Exception as e:  # the reader raises ValueError/struct errors on corrupt files
        raise FormatError(f"{gguf_path} is a corrupt or unsupported GGUF file ({e}).") from None


def _metadata(reader) -> dict[str, Any]:
    """All key/value fields as plain Python values (strings decoded, arrays as lists)."""
    from gguf import GGUFValueType

    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if not field.types or not field.data:
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            item = field.types[-1]
            if item == GGUFValueType.STRING:
                out[name] = [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
            elif len(field.types) == 2:
                out[name] = [field.parts[i].tolist()[0] for i in field.data]
        elif kind == GGUFValueType.STRING:
            out[name] = bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
        else:
            out[name] = field.parts[field.data[0]].tolist()[0]
    return out


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert permute: per head, rows [0,2,4,…,1,3,5,…] go back to HF's half split."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise FormatError(f"Attention tensor with {rows} rows cannot be split into {n_head} heads.")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> Optional[str]:
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _dequantize(t) -> torch.Tensor:
    from gguf.quants import dequantize

    try:
        arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise FormatError(f"GGUF tensor {t.name} uses quantization type {t.tensor_type.name}, "
                          "which the gguf package cannot dequantize.") from None
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    return torch.from_numpy(arr if arr.flags.writeable and arr.flags.c_contiguous else arr.copy())


# ---- config ----------------------------------------------------------------------------------------------------

def _hparams(meta: dict, arch: str, n_vocab: int, tied: bool, has_qkv_bias: bool, special: dict) -> dict:
    def get(key: str, default=None, required=False):
        v = meta.get(f"{arch}.{key}", default)
        if v is None and required:
            raise FormatError(f"The GGUF metadata lacks {arch}.{key}.")
        if isinstance(v, list):  # per-layer values (some hybrids); only uniform lists are supported
            if len(set(v)) != 1:
                raise FormatError(f"The GGUF metadata {arch}.{key} varies per layer, which is not supported.")
            v = v[0]
        return v

    hf_class, model_type, _ = _ARCHS[arch]
    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    rope_dim = get("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise FormatError(f"Partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported.")
    cfg: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "vocab_size": n_vocab,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "torch_dtype": "float16",
    }
    if model_type == "llama":
        cfg["attention_bias"] = has_qkv_bias
        cfg["mlp_bias"] = False
    elif model_type == "qwen3":
        cfg["attention_bias"] = has_qkv_bias
    if model_type in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
    scaling = get("rope.scaling.type")
    factor = get("rope.scaling.factor")
    if scaling in ("linear", "yarn") and factor:
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(factor)}
        orig = get("rope.scaling.original_context_length")
        if scaling == "yarn" and orig:
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(orig)
    elif scaling not in (None, "none"):
        raise FormatError(f"RoPE scaling type {scaling!r} in the GGUF metadata is not supported.")
    for name in ("bos", "eos", "pad"):
        if special.get(name) is not None:
            cfg[f"{name}_token_id"] = special[name]
    return cfg


def llama3_scaling(freq_factors: torch.Tensor, theta: float, head_dim: int) -> dict:
    """The llama3 `rope_scaling` whose frequency divisors equal llama.cpp's `rope_freqs` tensor (rel. 1e-3)."""
    f = freq_factors.double().flatten()
    if f.numel() != head_dim // 2:
        raise FormatError(f"The GGUF rope_freqs tensor has {f.numel()} values; {head_dim // 2} were expected.")
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    factor = float(f.max())
    for orig in _LLAMA3_ORIG:
        for lo in _LLAMA3_LOW:
            for hi in _LLAMA3_HIGH:
                p = {"rope_type": "llama3", "factor": factor, "low_freq_factor": lo, "high_freq_factor": hi,
                     "original_max_position_embeddings": orig}
                if torch.allclose(inv / llama3_inv_freq(inv, p), f, rtol=1e-3, atol=0):
                    return p
    raise FormatError("The GGUF's RoPE frequency factors (rope_freqs) match no llama3 RoPE scaling, so this model "
                      "cannot be imported faithfully.")


# ---- tokenizer -------------------------------------------------------------------------------------------------

def _special_ids(meta: dict) -> dict[str, Optional[int]]:
    keys = {n: f"tokenizer.ggml.{n}_token_id" for n in ("bos", "eos", "unknown", "eot", "eom")}
    keys["pad"] = "tokenizer.ggml.padding_token_id"
    ids = {n: meta.get(key) for n, key in keys.items()}
    return {k: (int(v) if isinstance(v, int) else None) for k, v in ids.items()}


def _added_tokens(tokens: list[str], types: list[int]):
    from tokenizers import AddedToken

    out = []
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind in (_CONTROL, _UNKNOWN):
            out.append(AddedToken(tok, special=True, normalized=False))
        elif kind == _USER_DEFINED:
            out.append(AddedToken(tok, special=False, normalized=False))
    return out


def _bpe_tokenizer(meta: dict, tokens: list[str], types: list[int]):
    """GPT-2 style byte-level BPE (tokenizer.ggml.model == 'gpt2')."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    kind = _PRE_KINDS.get(pre)
    if kind is None:
        raise FormatError(f"The GGUF tokenizer pre-tokenizer {pre!r} is not supported.")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}  # first id wins for duplicated strings
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=(kind == "llama3")))
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif kind == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        regex = _LLAMA3_REGEX if kind == "llama3" else _QWEN2_REGEX
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        if kind == "qwen2":
            tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sp_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary: a piece is made from any two pieces that spell it,
    and pieces with higher scores are merged first (how sentencepiece's BPE picks)."""
    ids = {t: i for i, t in reversed(list(enumerate(tokens)))}
    found = []
    for i, piece in enumerate(tokens):
        if types[i] not in (_NORMAL, _USER_DEFINED) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                found.append((-scores[i], ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _sp_tokenizer(meta: dict, tokens: list[str], types: list[int], special: dict):
    """Llama/sentencepiece style BPE with byte fallback (tokenizer.ggml.model == 'llama')."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise FormatError("The GGUF sentencepiece tokenizer has no scores for its tokens.")
    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}
    unk = tokens[special["unknown"]] if special.get("unknown") is not None else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_sp_merges(tokens, scores, types), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # Like sentencepiece (and llama.cpp): always prepend one "▁", even before text that starts with spaces.
    replace = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if prefix else replace
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _tokenizer_files(meta: dict, context: int) -> tuple[str, dict, dict]:
    """(tokenizer.json text, tokenizer_config dict, special ids) from the tokenizer.* metadata."""
    from tokenizers import processors

    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise FormatError("The GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens).")
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    special = _special_ids(meta)
    if model == "gpt2":
        tok = _bpe_tokenizer(meta, tokens, types)
        default_bos = False
    elif model == "llama":
        tok = _sp_tokenizer(meta, tokens, types, special)
        default_bos = True
    else:
        raise FormatError(f"The GGUF tokenizer model {model!r} is not supported (only gpt2 BPE and llama).")
    tok.add_tokens(_added_tokens(tokens, types))

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)) and special["bos"] is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and special["eos"] is not None
    name = {k: (tokens[v] if v is not None and 0 <= v < len(tokens) else None) for k, v in special.items()}
    if add_bos or add_eos:
        def seq(piece: str, type_id: int) -> list[str]:
            return ([f"{name['bos']}:{type_id}"] if add_bos else []) + [f"{piece}:{type_id}"] + (
                [f"{name['eos']}:{type_id}"] if add_eos else [])

        pairs = [(name[k], special[k]) for k, on in (("bos", add_bos), ("eos", add_eos)) if on]
        tok.post_processor = processors.TemplateProcessing(single=seq("$A", 0), pair=seq("$A", 0) + seq("$B", 1),
                                                           special_tokens=pairs)
    elif model == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
    }
    for key, k in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "pad"), ("unk_token", "unknown")):
        if name[k] is not None:
            config[key] = name[k]
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return tok.to_str(), config, special


# ---- writing ---------------------------------------------------------------------------------------------------

def _write_weights(tensors: list[tuple[str, Any]], load, tmp: Path, dtype: torch.dtype) -> None:
    """Dequantize tensor by tensor into safetensors shards of at most _SHARD_BYTES (one file for small models)."""
    from safetensors.torch import save_file

    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [int(np.prod(t.shape.tolist())) * itemsize for _, t in tensors]
    groups: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if groups[-1] and used + size > _SHARD_BYTES:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += size
    weight_map = {}
    for g, members in enumerate(groups):
        fname = "model.safetensors" if len(groups) == 1 else f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for i in members:
            hf, t = tensors[i]
            shard[hf] = load(hf, t).to(dtype).contiguous()
            weight_map[hf] = fname
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        del shard
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def import_gguf(gguf_path: Path | str, out_dir: Path | str, dtype: torch.dtype = torch.float16,
                overwrite: bool = False) -> Path:
    """Convert a GGUF file (llama, mistral, qwen2, qwen3 architectures) to an HF directory; returns out_dir."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ConfigError(f"import-gguf writes float16, bfloat16 or float32 tensors, not {dtype}.")
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not overwrite)):
        raise ConfigError(f"Output directory {out_dir} already exists and is not empty.")
    reader = _open(gguf_path)
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise FormatError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHS)}).")
    permuted = _ARCHS[arch][2]

    tensors: list[tuple[str, Any]] = []
    for t in reader.tensors:
        if t.name in _SKIPPED:
            continue
        hf = _hf_name(t.name)
        if hf is None:
            raise FormatError(f"GGUF tensor {t.name} has no counterpart in the {arch} architecture.")
        tensors.append((hf, t))
    names = {hf for hf, _ in tensors}
    if "model.embed_tokens.weight" not in names:
        raise FormatError(f"{gguf_path} has no token embedding tensor (token_embd.weight).")
    tied = "lm_head.weight" not in names
    embd = next(t for hf, t in tensors if hf == "model.embed_tokens.weight")
    n_vocab = int(embd.shape.tolist()[-1])

    special_ids = _special_ids(meta)
    config = _hparams(meta, arch, n_vocab, tied, any(n.endswith("q_proj.bias") for n in names), special_ids)
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is not None:
        if "rope_scaling" in config:
            raise FormatError("The GGUF has both RoPE scaling metadata and a rope_freqs tensor; not supported.")
        config["rope_scaling"] = llama3_scaling(_dequantize(freqs), config["rope_theta"], config["head_dim"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    def load(hf: str, t) -> torch.Tensor:
        w = _dequantize(t)
        if permuted and ".self_attn.q_proj." in hf:
            w = _unpermute(w, heads)
        elif permuted and ".self_attn.k_proj." in hf:
            w = _unpermute(w, kv_heads)
        return w

    tok_json, tok_config, special = _tokenizer_files(meta, config["max_position_embeddings"])
    eos = list(dict.fromkeys(i for i in (special["eos"], special["eot"], special["eom"]) if i is not None))
    gen = {"bos_token_id": special["bos"], "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
           "pad_token_id": special["pad"]}
    gen = {k: v for k, v in gen.items() if v is not None}

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.importing-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_weights(tensors, load, tmp, dtype)
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        _write_json(tmp / "config.json", config)
        (tmp / "tokenizer.json").write_text(tok_json, encoding="utf-8")
        _write_json(tmp / "tokenizer_config.json", tok_config)
        _write_json(tmp / "generation_config.json", gen)
        _write_json(tmp / MARKER_FILE, {"source": gguf_path.name, "importer_version": IMPORTER_VERSION})
        for f in tmp.iterdir():
            f.chmod(0o644)  # safetensors writes 0600; the import is as readable as any other download
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
