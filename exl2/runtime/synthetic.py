"""Fabricated EXL2 models: random but valid tensors with real shapes, for benchmarks without a model download."""
from __future__ import annotations

import torch

from exl2.formats.exl2 import group_layout, pack

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": 128001,
}

# Qwen3-30B-A3B's shapes (48 layers of 128 experts, 8 a token): the mixture-of-experts benchmark's model.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu",
}

# (bits, proportion, group size) per option: 4.0 bpw body (4-bit, group 128) and exllamav2's -hb 6 head.
BODY_OPTION = ([4], [1.0], [128])
# A body like a real 4.0 bpw file's: most groups 4-bit, some 5- and 3-bit in every matrix (≈ 4.0 bpw with scales).
MIXED_BODY_OPTION = ([5, 4, 3], [0.1, 0.7, 0.2], [128, 128, 128])
HEAD_OPTION = ([8, 6], [0.15, 0.85], [128, 128])
BODIES = ("4bit", "543", "table")  # `synthetic_model(body=...)`: BODY_OPTION, MIXED_BODY_OPTION, `table_options`


def _option(q) -> tuple[list[int], list[float], list[int]]:
    """A `quantize.qparams.QParams` as this module's (bits, proportion, group size) option."""
    return list(q.bits), list(q.bits_prop), [q.sizes[b] for b in q.bits]


def projection_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of a decoder layer of the Llama-shaped `cfg`, in the order the
    fabricated checkpoint draws them."""
    h = cfg["hidden_size"]
    i = cfg.get("moe_intermediate_size") if cfg.get("num_experts") else cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


def table_options(cfg: dict, target_bpw: float = 4.0, spread: float = 0.6) -> list[dict[str, tuple]]:
    """Per layer, each projection's option from exllamav2's option tables (`quantize.qparams`), roughly as a
    `target_bpw` conversion leaves them: layer l takes, for its attention and its MLP, the table row whose storage on
    this model's shapes is nearest target + spread·cos(π·l / (layers − 1)) bits a weight (the first and last layers
    get more, as the optimizer tends to give them; the average stays near the target). Real files mix widths
    differently in q/k/v, o, gate/up and down and from layer to layer, so their kernels meet several width
    combinations, not one."""
    import math

    from exl2.quantize.qparams import roles, table

    shapes = projection_shapes(cfg)
    layers = cfg["num_hidden_layers"]
    per_layer: list[dict[str, tuple]] = [{} for _ in range(layers)]
    for kind in ("attn", "mlp"):
        names = roles(kind)
        weights = sum(shapes[r][0] * shapes[r][1] for r in names)
        bpw = [sum(q.total_bits(*shapes[r]) for q, r in zip(row, names)) / weights for row in table(kind)]
        for layer in range(layers):
            want = target_bpw + spread * math.cos(math.pi * layer / max(1, layers - 1))
            row = table(kind)[min(range(len(bpw)), key=lambda j: abs(bpw[j] - want))]
            per_layer[layer].update({r: _option(q) for q, r in zip(row, names)})
    return per_layer


def random_exl2_layer(k: int, n: int, option=BODY_OPTION, device="cpu", generator=None,
                      perm: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """On-disk EXL2 tensors of a random layer [K in, N out] with weights of a realistic magnitude; `perm` the
    act-order permutation (None: a random one, drawn after the codes and scales)."""
    bits, prop, gs = option
    groups = group_layout(k, bits, prop, gs)
    codes = torch.empty(k, n, dtype=torch.uint8, device=device)
    row = 0
    for b, rows in groups:
        codes[row:row + rows] = torch.randint(0, 2 ** b, (rows, n), dtype=torch.uint8, generator=generator,
                                              device=device)
        row += rows
    scale_codes = torch.randint(8, 17, (len(groups), n), generator=generator, device=device)
    scale_max = torch.tensor([0.02 / 2.0 ** (b - 1) for b, _ in groups], dtype=torch.float16, device=device)
    if perm is None:
        perm = torch.randperm(k, generator=generator, device=device)
    return {key: t.to(device) for key, t in pack(codes, groups, scale_codes, scale_max, perm).items()}


def llama_exl2_tensors(cfg: dict = LLAMA3_8B, device="cpu", seed: int = 0, body=BODY_OPTION) -> dict[str, torch.Tensor]:
    """All tensors of a Llama-shaped EXL2 model (`body` option for the decoder layers, or a list of per-layer
    {projection: option} as `table_options` gives; 6-bit head), keyed like an EXL2 checkpoint."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    shapes = projection_shapes(cfg)
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (torch.randn(v, h, generator=g, device=device) * 0.02).half(),
        "model.norm.weight": torch.ones(h, dtype=torch.float16, device=device),
    }

    def add(prefix, k, n, option, perm=None):
        for key, t in random_exl2_layer(k, n, option, device, g, perm).items():
            out[f"{prefix}.{key}"] = t

    def shared_perm(prefix):
        """The permutation `add` drew for `prefix` (q_invperm is its inverse)."""
        return torch.argsort(out[f"{prefix}.q_invperm"].long())

    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.float16, device=device)
        out[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.float16, device=device)
        # exllamav2 gives the matrices that read one input one act-order permutation: q_invperm is equal within
        # q/k/v and within gate/up in every layer of ../shared/testdata/exl2-golden/*; k/v and up reuse q's and
        # gate's (drawn as before, so the rest of the generator sequence only loses those draws)
        o = body[layer] if isinstance(body, list) else dict.fromkeys(shapes, body)
        add(f"{p}.self_attn.q_proj", *shapes["q_proj"], o["q_proj"])
        qkv_perm = shared_perm(f"{p}.self_attn.q_proj")
        add(f"{p}.self_attn.k_proj", *shapes["k_proj"], o["k_proj"], qkv_perm)
        add(f"{p}.self_attn.v_proj", *shapes["v_proj"], o["v_proj"], qkv_perm)
        add(f"{p}.self_attn.o_proj", *shapes["o_proj"], o["o_proj"])
        experts = cfg.get("num_experts") or 0
        if experts:   # Qwen3-MoE: q/k norms, a router, `experts` gate/up/down triples
            hd = shapes["k_proj"][1] // cfg["num_key_value_heads"]
            for norm in ("q_norm", "k_norm"):
                out[f"{p}.self_attn.{norm}.weight"] = torch.ones(hd, dtype=torch.float16, device=device)
            out[f"{p}.mlp.gate.weight"] = (torch.randn(experts, h, generator=g, device=device) * 0.02).half()
        for mlp in [f"{p}.mlp.experts.{e}" for e in range(experts)] or [f"{p}.mlp"]:
            add(f"{mlp}.gate_proj", *shapes["gate_proj"], o["gate_proj"])
            add(f"{mlp}.up_proj", *shapes["up_proj"], o["up_proj"], shared_perm(f"{mlp}.gate_proj"))
            add(f"{mlp}.down_proj", *shapes["down_proj"], o["down_proj"])
    add("lm_head", h, v, HEAD_OPTION)
    return out


class DictSource(dict):
    """A dict of tensors that quacks like TensorSource for WeightLoader."""

    def shape(self, name: str) -> list[int]:
        return list(self[name].shape)


def synthetic_model(device: torch.device, layers: int | None = None, body: str = "4bit", shape: dict | None = None,
                    use_kernels: bool | None = None):
    """(model, tensor source) of the fabricated Llama-3-8B-shaped EXL2 model (`exl2 bench` without -m), or of
    the config `shape` (`QWEN3_30B_A3B`); `body` one of `BODIES`: 4-bit groups, 5/4/3-bit groups in every
    matrix, or exllamav2's option tables at 4.0 bpw. `use_kernels`: as `WeightLoader`'s (tests set it on CPU)."""
    from exl2.models.decoder import DecoderModel
    from exl2.models.registry import spec_from_config
    from exl2.runtime.weights import WeightLoader

    cfg = dict(shape or LLAMA3_8B)
    if layers:
        cfg["num_hidden_layers"] = layers
    if body not in BODIES:
        raise ValueError(f"body must be one of {', '.join(BODIES)}, not {body!r}.")
    option = {"4bit": BODY_OPTION, "543": MIXED_BODY_OPTION}.get(body) or table_options(cfg)
    source = DictSource(llama_exl2_tensors(cfg, device=device, body=option))
    with torch.inference_mode():
        model = DecoderModel(spec_from_config(cfg), WeightLoader(source, device, torch.float16,
                                                                          use_kernels=use_kernels)).eval()
    return model, source


def synthetic_tokenizer(directory=None, vocab_size: int = LLAMA3_8B["vocab_size"]):
    """A word-level tokenizer with one made-up word per id and no end token, written to `directory` (None: a
    temporary one), so the generators can run the fabricated model to a fixed length."""
    import json
    import tempfile
    from pathlib import Path

    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    from exl2.generation.tokenizer import Tokenizer

    if directory is None:
        with tempfile.TemporaryDirectory() as d:
            return synthetic_tokenizer(d, vocab_size)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    return Tokenizer.from_dir(d)
