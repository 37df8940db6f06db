"""The Qwen3-VL vision encoder (exl2.models.vision.qwen3vl) against transformers 5: tiny Qwen3VLForConditionalGeneration
and Qwen3VLMoeForConditionalGeneration models with random weights (position tables smaller and larger than the image
grids, so the resampling matters), saved with a Qwen2VLImageProcessor config of 16-pixel patches. Preprocessing equals
the processor's PIL backend, the features and every DeepStack feature equal get_image_features', the token layout is
what Qwen3VLProcessor expands <|image_pad|> into, both checkpoint layouts and an EXL2 merger linear load, and other
models have no Qwen3-VL vision encoder."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_vision import _assert_close, _copy_with, _noise, _randomize, holding, quantize_linear
from test_vision_qwen2vl import END, PAD, START, _text, _tokenizer, _tokens

from exl2.errors import ConfigError
from exl2.models.vision import Qwen3Vision, Qwen3VisionSpec, QwenVisionSpec, load_vision, qwen3vl
from exl2.models.vision.qwen2vl import merge_order

PATCH, MERGE, TEXT_HIDDEN = 16, 2, 64
MIN_PIXELS, MAX_PIXELS = 64 * 64, 32 * 32 * 30
MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
# PIL (width, height): non-multiples of 32; 45×70 and 100×33 grown to MIN_PIXELS, 301×199 shrunk to MAX_PIXELS;
# grids of 6×4 to 8×12 patches against the dense model's 4×4 position table and the MoE model's 8×8
SIZES = [(45, 70), (100, 33), (150, 90), (301, 199)]

QWEN3_VL_4B = {  # Qwen/Qwen3-VL-4B-Instruct's config.json (text_config shortened)
    "architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl",
    "text_config": {"head_dim": 128, "hidden_size": 2560, "intermediate_size": 9728, "model_type": "qwen3_vl_text",
                    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                    "rope_theta": 5000000, "vocab_size": 151936},
    "tie_word_embeddings": True, "video_token_id": 151656,
    "vision_config": {"deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1024, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096,
                      "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304,
                      "out_hidden_size": 2560, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "vision_end_token_id": 151653, "vision_start_token_id": 151652,
}
QWEN3_VL_30B_A3B = {  # after Qwen/Qwen3-VL-30B-A3B-Instruct's config.json (text_config shortened)
    "architectures": ["Qwen3VLMoeForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl_moe",
    "text_config": {"hidden_size": 2048, "model_type": "qwen3_vl_moe_text", "num_experts": 128},
    "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1152, "in_channels": 3, "intermediate_size": 4304, "model_type": "qwen3_vl_moe",
                      "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
                      "spatial_merge_size": 2, "temporal_patch_size": 2},
    "vision_end_token_id": 151653, "vision_start_token_id": 151652,
}


def _text3(**kw):
    return {**_text(), "head_dim": 32, **kw}   # mrope_section [4, 6, 6] sums to half of head_dim 32


def _qwen3_vl_config():
    from transformers import Qwen3VLConfig

    # a 4×4 position table, upsampled to every test image; rope_theta 1000: the rope must read the config
    vision = dict(depth=3, hidden_size=64, num_heads=2, intermediate_size=96, out_hidden_size=TEXT_HIDDEN,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
                  rope_parameters={"rope_type": "axial", "rope_theta": 1000.0})
    return Qwen3VLConfig(text_config=_text3(), vision_config=vision, **_tokens())


def _qwen3_vl_moe_config():
    from transformers import Qwen3VLMoeConfig

    # an 8×8 table (shrunk along short sides); DeepStack indexes out of order: features come in block order
    vision = dict(depth=3, hidden_size=64, num_heads=4, intermediate_size=80, out_hidden_size=TEXT_HIDDEN,
                  num_position_embeddings=64, deepstack_visual_indexes=[2, 0])
    text = _text3(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32)
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, **_tokens())


def _processor(**kw):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**kw)


def _build(config, out: Path, seed: int):
    """The tiny model (eager attention, float32, every weight random) saved with its image processor config."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(config, attn_implementation="eager", dtype=torch.float32)
    _randomize(model, seed)
    model.eval()
    model.save_pretrained(out)
    _processor(patch_size=PATCH, size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, image_mean=MEAN,
               image_std=STD).save_pretrained(out)
    return model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_vl")
    return out, _build(_qwen3_vl_config(), out, seed=3)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_vl_moe")
    return out, _build(_qwen3_vl_moe_config(), out, seed=4)


def _hf_inputs(model_dir: Path, image) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values and image_grid_thw from Qwen2VLImageProcessorPil, which AutoImageProcessor picks for Qwen3-VL
    without torchvision."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(image, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@torch.no_grad()
def _hf_features(model, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model.get_image_features(pixel_values=pixels, image_grid_thw=grid, return_dict=True)
    return out.pooler_output[0], list(out.deepstack_features)


def _assert_matches(emb, ref: torch.Tensor, ref_deep: list[torch.Tensor]) -> None:
    """Features and every DeepStack feature within 1e-4 (float32) of transformers'."""
    assert len(emb.deep) == len(ref_deep)
    for ours, theirs in ((emb.features, ref), *zip(emb.deep, ref_deep)):
        assert ours.dtype == torch.float32 and ours.shape == theirs.shape == (ref.shape[0], TEXT_HIDDEN)
        assert (ours - theirs).abs().max() < 1e-4


def test_published_configs():
    """The published configs read as transformers reads them, and inconsistent ones fail in one sentence."""
    s = Qwen3VisionSpec.from_config(QWEN3_VL_4B)
    assert (s.kind, s.hidden, s.intermediate, s.heads, s.head_dim, s.layers) == ("qwen3_vl", 1024, 4096, 16, 64, 24)
    assert (s.patch, s.temporal_patch, s.merge, s.channels, s.act) == (16, 2, 2, 3, "gelu_pytorch_tanh")
    assert (s.rope_theta, s.positions, s.side, s.deepstack, s.text_hidden) == (1e4, 2304, 48, (5, 11, 17), 2560)
    assert (s.image_token_id, s.marker_id, s.vision_start_id, s.vision_end_id) == (151655, 151655, 151652, 151653)
    s = Qwen3VisionSpec.from_config(QWEN3_VL_30B_A3B)
    assert (s.kind, s.hidden, s.intermediate, s.layers, s.deepstack, s.text_hidden) == \
        ("qwen3_vl_moe", 1152, 4304, 27, (8, 16, 24), 2048)
    saved = {**_qwen3_vl_config().to_dict(), "architectures": QWEN3_VL_4B["architectures"]}   # transformers 5's
    assert Qwen3VisionSpec.from_config(saved).rope_theta == 1000.0
    assert Qwen3VisionSpec.from_config({**QWEN3_VL_4B, "architectures": ["Qwen3ForCausalLM"]}) is None
    assert Qwen3VisionSpec.from_config({k: v for k, v in QWEN3_VL_4B.items() if k != "vision_config"}) is None
    assert QwenVisionSpec.from_config(QWEN3_VL_4B) is None and Qwen3VisionSpec.from_config(
        {**QWEN3_VL_4B, "architectures": ["Qwen2_5_VLForConditionalGeneration"]}) is None
    vision = QWEN3_VL_4B["vision_config"]
    for change, message in (({"out_hidden_size": 4096}, "4096 features"), ({"num_position_embeddings": 2300}, "square"),
                            ({"deepstack_visual_indexes": [5, 24]}, "24-block"),
                            ({"deepstack_visual_indexes": [5, 5]}, "distinct"),
                            ({"hidden_size": 1080, "num_heads": 20}, "multiple of 4"),
                            ({"hidden_act": "mish"}, "not supported")):
        with pytest.raises(ConfigError, match=message):
            Qwen3VisionSpec.from_config({**QWEN3_VL_4B, "vision_config": {**vision, **change}})


@pytest.mark.parametrize("rows, cols, side", [(6, 10, 4), (4, 4, 4), (2, 12, 8), (8, 6, 3), (2, 2, 1)])
def test_position_taps_are_corner_aligned_bilinear(rows, cols, side):
    """The blend equals F.interpolate(bilinear, align_corners=True) of the table to the patch grid, in the tower's
    merge-window row order."""
    table = torch.randn(side * side, 5, generator=torch.Generator().manual_seed(rows * cols + side))
    index, weight = qwen3vl.position_taps(rows, cols, side, MERGE)
    ours = (table[index] * weight[..., None]).sum(1)
    grid = F.interpolate(table.t().reshape(1, 5, side, side), size=(rows, cols), mode="bilinear", align_corners=True)
    ref = grid[0].flatten(1).t()[merge_order(rows, cols, MERGE)]
    assert torch.allclose(ours, ref, atol=1e-6)


@pytest.mark.parametrize("size", SIZES + [(64, 64), (10, 12)])
def test_preprocess_is_qwen2vl_image_processor(qwen3, size):
    """transformers maps qwen3_vl to Qwen2VLImageProcessor (PIL backend here); with 16-pixel patches, bit for bit
    the same patches and image_grid_thw."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    assert IMAGE_PROCESSOR_MAPPING_NAMES["qwen3_vl"]["pil"] == "Qwen2VLImageProcessorPil"
    d, _ = qwen3
    image = _noise(*size, seed=sum(size))
    patches, grid = Qwen3Vision.from_dir(d, dtype=torch.float32).preprocess(image)
    ref, ref_grid = _hf_inputs(d, image)
    assert patches.shape == ref.shape and patches.shape[1] == 3 * 2 * PATCH * PATCH
    assert list(grid) == ref_grid[0].tolist() and torch.equal(patches, ref)


def test_preprocess_defaults(qwen3, tmp_path):
    """Without a preprocessor config, Qwen3-VL's published settings (16-pixel patches, 256² to 4096² pixels, mean
    and std 0.5); a config whose patches are not the tower's fails."""
    d, _ = qwen3
    bare = _copy_with(d, tmp_path / "bare", {})
    (bare / "preprocessor_config.json").unlink()
    (bare / "model.safetensors").symlink_to(d / "model.safetensors")
    image = _noise(300, 70, seed=2)           # grown to 65536 pixels
    patches, grid = Qwen3Vision.from_dir(bare, dtype=torch.float32).preprocess(image)
    ref = _processor(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                     size={"shortest_edge": 65536, "longest_edge": 16777216})(image, return_tensors="pt")
    assert grid[1] * grid[2] * PATCH * PATCH >= 65536
    assert torch.equal(patches, ref["pixel_values"]) and list(grid) == ref["image_grid_thw"][0].tolist()
    (bare / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14, "merge_size": 2}))
    with pytest.raises(ConfigError, match="patch_size is 14"):
        Qwen3Vision.from_dir(bare)


@pytest.mark.parametrize("size", SIZES)
def test_features_match_get_image_features(qwen3, size):
    d, model = qwen3
    vision = Qwen3Vision.from_dir(d, dtype=torch.float32)
    image = _noise(*size, seed=7 + size[0])
    emb = vision.encode(image)
    assert emb.features.device.type == "cpu" and len(emb.deep) == 2
    _assert_matches(emb, *_hf_features(model, *_hf_inputs(d, image)))


def test_moe_features_match_get_image_features(qwen3_moe):
    """Qwen3-VL-MoE's tower is the same; DeepStack indexes [2, 0] give block 0's merger-1 rows first, as
    transformers orders them."""
    d, model = qwen3_moe
    vision = Qwen3Vision.from_dir(d, dtype=torch.float32)
    assert vision.spec.kind == "qwen3_vl_moe" and vision.spec.deepstack == (2, 0) and vision.spec.side == 8
    for size in ((150, 90), (45, 70)):
        image = _noise(*size, seed=size[1])
        _assert_matches(vision.encode(image), *_hf_features(model, *_hf_inputs(d, image)))


def test_position_embedding_matters(qwen3, monkeypatch):
    """The resampled position table moves the features far beyond the 1e-4 tolerance: without it, with the table
    transposed, or resampled by nearest neighbour instead of bilinearly, the features differ."""
    d, _ = qwen3
    vision = Qwen3Vision.from_dir(d, dtype=torch.float32)
    image = _noise(150, 90, seed=8)
    emb = vision.encode(image)
    table = vision.pos_embed

    def moved() -> float:
        other = vision.encode(image)
        return min((a - b).abs().max().item() for a, b in zip((other.features, *other.deep), (emb.features, *emb.deep)))

    vision.pos_embed = torch.zeros_like(table)
    assert moved() > 1e-1
    vision.pos_embed = table.view(4, 4, -1).transpose(0, 1).reshape(16, -1)
    assert moved() > 1e-2
    vision.pos_embed = table
    bilinear = qwen3vl.position_taps

    def nearest(rows, cols, side, merge):
        index, weight = bilinear(rows, cols, side, merge)
        return index.gather(1, weight.argmax(1, keepdim=True)).expand(-1, 4), torch.full(weight.shape, 0.25)

    monkeypatch.setattr(qwen3vl, "position_taps", nearest)
    assert moved() > 1e-2


def _replace_image_token():
    """Qwen3VLProcessor.replace_image_token, called unbound: building the processor needs its video processor,
    which imports torchvision, which the test environment does not install."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    return Qwen3VLProcessor.replace_image_token


@pytest.mark.parametrize("size", [(150, 90), (10, 12)])
def test_token_ids_are_the_processors(qwen3, size):
    """<|image_pad|> × t·h·w / merge², as the processor expands the template's one <|image_pad|>; the merged grid;
    transformers' forward accepts the tokens with the pixels (one <|image_pad|> per feature row)."""
    d, model = qwen3
    vision = Qwen3Vision.from_dir(d, dtype=torch.float32)
    assert vision.spec.marker_id == PAD
    image = _noise(*size, seed=11)
    emb = vision.encode(image)
    pixels, grid = _hf_inputs(d, image)
    processor = SimpleNamespace(image_processor=SimpleNamespace(merge_size=MERGE), image_token="<|image_pad|>")
    text = "<|vision_start|>" + _replace_image_token()(processor, {"image_grid_thw": grid}, 0) + "<|vision_end|>"
    expected = _tokenizer()(text, add_special_tokens=False)["input_ids"]
    assert expected == [START, *emb.token_ids, END] and emb.image_token_id == PAD
    t, h, w = grid[0].tolist()
    assert emb.token_ids.count(PAD) == t * h * w // MERGE ** 2 == emb.features.shape[0] == emb.deep[0].shape[0]
    assert emb.grid == (t, h // MERGE, w // MERGE)
    ids = torch.tensor([[1, *expected, 9]])
    with torch.no_grad():
        model(input_ids=ids, mm_token_type_ids=(ids == PAD).long(), pixel_values=pixels, image_grid_thw=grid)


def test_checkpoint_layouts(qwen3, tmp_path):
    """transformers 5 saves model.visual.*; published-style visual.* names (sharded) give the same rows."""
    d, _ = qwen3
    tensors = load_file(d / "model.safetensors")
    assert "model.visual.patch_embed.proj.weight" in tensors and "model.visual.pos_embed.weight" in tensors
    bare = {(k[len("model."):] if k.startswith("model.visual.") else k): v for k, v in tensors.items()}
    names = sorted(bare)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": {k: bare[k] for k in part}
              for i, part in enumerate((names[::2], names[1::2]))}
    other = _copy_with(d, tmp_path / "bare", shards)
    index = {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}
    (other / "model.safetensors.index.json").write_text(json.dumps(index))
    image = _noise(90, 60, seed=5)
    ref = Qwen3Vision.from_dir(d, dtype=torch.float32).encode(image)
    got = Qwen3Vision.from_dir(other, dtype=torch.float32).encode(image)
    assert torch.equal(ref.features, got.features) and all(map(torch.equal, ref.deep, got.deep))
    assert ref.token_ids == got.token_ids and ref.grid == got.grid
    assert isinstance(load_vision(other, dtype=torch.float32), Qwen3Vision)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 0.01), (torch.bfloat16, 0.04)])
def test_half_precision_tracks_float32(qwen3, dtype, tolerance):
    """fp16 and bf16 towers stay within 1 % and 4 % of each float32 output's largest value (about 0.1 % and 1 %
    here), and return the rows in their own dtype."""
    image = _noise(150, 90, seed=6)
    ref = Qwen3Vision.from_dir(qwen3[0], dtype=torch.float32).encode(image)
    got = Qwen3Vision.from_dir(qwen3[0], dtype=dtype).encode(image)
    for ours, theirs in ((got.features, ref.features), *zip(got.deep, ref.deep)):
        assert ours.dtype == dtype and ours.shape == theirs.shape
        assert (ours.float() - theirs).abs().max() <= tolerance * theirs.abs().max()


def test_exl2_quantized_vision_linear(qwen3, tmp_path):
    """An EXL2 DeepStack merger linear_fc1 (with bias) loads through the decoder's weight loader: the DeepStack rows
    are those of the HF model holding the dequantized weight."""
    d, model = qwen3
    tensors = load_file(d / "model.safetensors")
    weight, bias = quantize_linear(tensors, "model.visual.deepstack_merger_list.1.linear_fc1")
    vision = Qwen3Vision.from_dir(_copy_with(d, tmp_path / "q", {"model.safetensors": tensors}), dtype=torch.float32)
    assert vision.deep_mergers[1].fc1.info["format"] == "exl2"
    image = _noise(60, 80, seed=10)
    emb = vision.encode(image)
    with holding(model.model.visual.deepstack_merger_list[1].linear_fc1, weight, bias):
        ref, ref_deep = _hf_features(model, *_hf_inputs(d, image))
    _assert_close(emb.features, ref)
    _assert_close(emb.deep[1], ref_deep[1])


def test_no_vision_encoder(fixtures, qwen3, tmp_path):
    """A text-only model and a Qwen3-VL export whose files hold only the text decoder have no Qwen3-VL vision
    encoder, nor has a Qwen2-VL model."""
    assert Qwen3Vision.from_dir(fixtures / "golden" / "b4.0_hb6") is None
    d, _ = qwen3
    tensors = load_file(d / "model.safetensors")
    text_only = {k: v for k, v in tensors.items() if not k.startswith("model.visual.")}
    assert text_only
    assert Qwen3Vision.from_dir(_copy_with(d, tmp_path / "text", {"model.safetensors": text_only})) is None
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    other = _copy_with(d, tmp_path / "other", {"model.safetensors": tensors})
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    assert Qwen3Vision.from_dir(other) is None and load_vision(other) is None
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2VLForConditionalGeneration"]}))
    assert Qwen3Vision.from_dir(other) is None
