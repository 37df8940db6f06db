"""The Qwen2-VL and Qwen2.5-VL vision encoders (exl2.models.vision.qwen2vl) against transformers 5: tiny
Qwen2VLForConditionalGeneration and Qwen2_5_VLForConditionalGeneration models (Qwen2.5-VL with 2×2-merged-patch
windows and one full-attention block) with random weights, saved with a Qwen2VLImageProcessor config. Preprocessing
equals the processor's PIL backend (pixel_values and image_grid_thw), features equal get_image_features', the
token layout is what Qwen2VLProcessor expands <|image_pad|> into, both checkpoint layouts and an EXL2 vision linear
load, and other models have no Qwen vision encoder."""
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_vision import _assert_close, _copy_with, _noise, _randomize, holding, quantize_linear

from exl2.errors import ConfigError
from exl2.models.vision import QwenImageProcessing, QwenVision, QwenVisionSpec, load_vision
from exl2.models.vision.qwen2vl import smart_resize, window_order

START, END, PAD, VIDEO = 5, 6, 7, 8     # <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>
PATCH, MERGE, TEXT_HIDDEN = 14, 2, 64
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 30
MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
# PIL (width, height): non-multiples of 28, one shrunk to fit MAX_PIXELS, one grown to MIN_PIXELS; 150×90 is 3×5
# merged patches, which 2×2 windows cover with partial windows at the bottom and the right
SIZES = [(45, 70), (100, 33), (150, 90), (301, 199)]

QWEN2_VL_7B = {  # Qwen/Qwen2-VL-7B-Instruct's config.json (text keys shortened): text keys flat at the top level
    "architectures": ["Qwen2VLForConditionalGeneration"], "bos_token_id": 151643, "eos_token_id": 151645,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
    "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 3584,
    "intermediate_size": 18944, "model_type": "qwen2_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "vocab_size": 152064,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2},
}
QWEN2_5_VL_7B = {  # Qwen/Qwen2.5-VL-7B-Instruct's config.json (text keys shortened)
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "bos_token_id": 151643, "eos_token_id": 151645,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
    "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 3584,
    "intermediate_size": 18944, "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "vocab_size": 152064,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
}
QWEN2_5_VL_PREPROCESSOR = {  # Qwen/Qwen2.5-VL-7B-Instruct's preprocessor_config.json: bounds at the top level
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
}


def _text():
    # mrope_section sums to the text head's half (16)
    return dict(hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=256, bos_token_id=1, eos_token_id=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})


def _tokens():
    return dict(image_token_id=PAD, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)


def _qwen2_vl_config():
    from transformers import Qwen2VLConfig

    # rope_theta 1000: the vision rope must read the config, not assume 10000
    vision = dict(depth=3, embed_dim=64, num_heads=4, mlp_ratio=2, hidden_size=TEXT_HIDDEN,
                  rope_parameters={"rope_type": "axial", "rope_theta": 1000.0})
    return Qwen2VLConfig(text_config=_text(), vision_config=vision, **_tokens())


def _qwen2_5_vl_config():
    from transformers import Qwen2_5_VLConfig

    # 56-pixel windows: 2×2 merged patches each; block 1 sees the whole image
    vision = dict(depth=3, hidden_size=64, num_heads=2, intermediate_size=96, out_hidden_size=TEXT_HIDDEN,
                  window_size=56, fullatt_block_indexes=[1], hidden_act="silu")
    return Qwen2_5_VLConfig(text_config=_text(), vision_config=vision, **_tokens())


def _processor(**kw):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**kw)


@pytest.fixture
def intact_processor_defaults(monkeypatch):
    """Qwen2VLImageProcessor's __init__ writes min_pixels / max_pixels into its class-level `size` dict; a copy keeps
    the class defaults intact for other tests."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    monkeypatch.setattr(Qwen2VLImageProcessorPil, "size", dict(Qwen2VLImageProcessorPil.size))


def _build(config, out: Path, seed: int):
    """The tiny model (eager attention, float32, every weight random) saved with its image processor config (own
    area bounds, mean and std)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(config, attn_implementation="eager", dtype=torch.float32)
    _randomize(model, seed)
    model.eval()
    model.save_pretrained(out)
    _processor(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, image_mean=MEAN,
               image_std=STD).save_pretrained(out)
    return model


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    config = _qwen2_vl_config() if request.param == "qwen2_vl" else _qwen2_5_vl_config()
    return out, _build(config, out, seed=1 if request.param == "qwen2_vl" else 2)


def _hf_inputs(model_dir: Path, image) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values and image_grid_thw from Qwen2VLImageProcessor's PIL backend, as AutoProcessor picks it without
    torchvision."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(image, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@torch.no_grad()
def _hf_features(model, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    return model.get_image_features(pixel_values=pixels, image_grid_thw=grid, return_dict=True).pooler_output[0]


def test_published_configs():
    """The published configs read as transformers reads them: Qwen2-VL's embed_dim × mlp_ratio tower and
    hidden_size output, Qwen2.5-VL's hidden_size tower and out_hidden_size output, the windows, the token ids."""
    s = QwenVisionSpec.from_config(QWEN2_VL_7B)
    assert (s.kind, s.hidden, s.intermediate, s.heads, s.head_dim, s.layers) == ("qwen2_vl", 1280, 5120, 16, 80, 32)
    assert (s.patch, s.temporal_patch, s.merge, s.channels, s.act, s.rope_theta) == (14, 2, 2, 3, "quick_gelu", 1e4)
    assert (s.text_hidden, s.window_size, s.window, s.full_attention) == (3584, 0, 0, ())
    assert (s.image_token_id, s.marker_id, s.vision_start_id, s.vision_end_id) == (151655, 151655, 151652, 151653)
    s = QwenVisionSpec.from_config(QWEN2_5_VL_7B)
    assert (s.kind, s.hidden, s.intermediate, s.heads, s.layers, s.act) == ("qwen2_5_vl", 1280, 3420, 16, 32, "silu")
    assert (s.text_hidden, s.window_size, s.window, s.full_attention) == (3584, 112, 4, (7, 15, 23, 31))
    assert s.marker_id == s.image_token_id == 151655
    nested = {**_qwen2_5_vl_config().to_dict(), "architectures": QWEN2_5_VL_7B["architectures"]}   # as saved
    assert QwenVisionSpec.from_config(nested).text_hidden == TEXT_HIDDEN
    assert QwenVisionSpec.from_config({**QWEN2_VL_7B, "architectures": ["Qwen2ForCausalLM"]}) is None
    assert QwenVisionSpec.from_config({k: v for k, v in QWEN2_VL_7B.items() if k != "vision_config"}) is None
    with pytest.raises(ConfigError, match="3584 features"):
        QwenVisionSpec.from_config({**QWEN2_VL_7B, "hidden_size": 1536})
    with pytest.raises(ConfigError, match="window_size"):
        QwenVisionSpec.from_config({**QWEN2_5_VL_7B, "vision_config": {**QWEN2_5_VL_7B["vision_config"],
                                                                        "window_size": 20}})
    with pytest.raises(ConfigError, match="multiple of 4"):
        QwenVisionSpec.from_config({**QWEN2_VL_7B, "vision_config": {**QWEN2_VL_7B["vision_config"],
                                                                      "embed_dim": 1160, "num_heads": 20}})


def test_smart_resize_and_windows():
    """Spot values of the resize arithmetic and the window regrouping (transformers' get_vision_window_index)."""
    assert smart_resize(70, 45, 28, MIN_PIXELS, MAX_PIXELS) == (56, 56)
    assert smart_resize(10, 12, 28, MIN_PIXELS, MAX_PIXELS) == (56, 84)          # grown past min_pixels
    assert smart_resize(199, 301, 28, MIN_PIXELS, MAX_PIXELS) == (112, 168)      # shrunk to max_pixels
    with pytest.raises(ConfigError, match="aspect ratio"):
        smart_resize(1, 201, 28, MIN_PIXELS, MAX_PIXELS)
    from transformers.vision_utils import get_vision_window_index

    for rows, cols in ((3, 5), (4, 4), (1, 7)):
        index, sizes = window_order(rows, cols, 2)
        ref, cu = get_vision_window_index(torch.tensor([[1, rows * 2, cols * 2]]), 2, 56, 14)
        assert torch.equal(index, ref) and torch.equal(torch.tensor([0, *sizes]).cumsum(0) * 4, cu.long())


@pytest.mark.parametrize("size", SIZES + [(56, 56), (10, 12)])
def test_preprocess_is_qwen2vl_image_processor(qwen, size):
    """smart_resize, bicubic resize, rescale, normalize, two frames, merge-window patch order: bit for bit, with the
    same image_grid_thw."""
    d, _ = qwen
    image = _noise(*size, seed=sum(size))
    patches, grid = QwenVision.from_dir(d, dtype=torch.float32).preprocess(image)
    ref, ref_grid = _hf_inputs(d, image)
    assert patches.dtype == torch.float32 and patches.shape == ref.shape
    assert patches.shape[1] == 3 * 2 * PATCH * PATCH and list(grid) == ref_grid[0].tolist()
    assert torch.equal(patches, ref)


def test_preprocess_configs_and_modes(tmp_path, qwen, intact_processor_defaults):
    """Without a preprocessor config, Qwen2VLImageProcessor's defaults (56² to 28²·1280 pixels, CLIP mean/std); the
    published config's top-level min_pixels / max_pixels; grayscale and RGBA images become RGB as transformers'
    convert_to_rgb makes them."""
    image = _noise(1100, 1000, seed=3)          # over the default max_pixels
    patches, grid = QwenImageProcessing.from_dir(tmp_path)(image)
    ref = _processor()(image, return_tensors="pt")
    assert grid[1] * grid[2] * PATCH * PATCH <= 28 * 28 * 1280 < 1100 * 1000
    assert torch.equal(patches, ref["pixel_values"]) and list(grid) == ref["image_grid_thw"][0].tolist()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**QWEN2_5_VL_PREPROCESSOR, "min_pixels": 20000}))
    image = _noise(123, 77, seed=4)             # grown to the config's min_pixels
    patches, grid = QwenImageProcessing.from_dir(tmp_path)(image)
    ref, ref_grid = _hf_inputs(tmp_path, image)
    assert grid[1] * grid[2] * PATCH * PATCH >= 20000
    assert torch.equal(patches, ref) and list(grid) == ref_grid[0].tolist()
    d, _ = qwen
    for mode in ("L", "RGBA"):
        image = _noise(60, 50, seed=5, mode=mode)
        assert torch.equal(QwenVision.from_dir(d, dtype=torch.float32).preprocess(image)[0], _hf_inputs(d, image)[0])


def test_preprocessor_patches_must_be_the_towers(qwen, tmp_path):
    d, _ = qwen
    other = _copy_with(d, tmp_path / "p", {})
    (other / "model.safetensors").symlink_to(d / "model.safetensors")
    (other / "preprocessor_config.json").write_text(json.dumps({**QWEN2_5_VL_PREPROCESSOR, "patch_size": 16}))
    with pytest.raises(ConfigError, match="patch_size is 16"):
        QwenVision.from_dir(other)


@pytest.mark.parametrize("size", SIZES)
def test_features_match_get_image_features(qwen, size):
    d, model = qwen
    vision = QwenVision.from_dir(d, dtype=torch.float32)
    image = _noise(*size, seed=7 + size[0])
    emb = vision.encode(image)
    ref = _hf_features(model, *_hf_inputs(d, image))
    assert emb.features.dtype == torch.float32 and emb.features.device.type == "cpu"
    assert emb.features.shape == (ref.shape[0], TEXT_HIDDEN)
    _assert_close(emb.features, ref)
    assert (emb.features - ref).abs().max() < 1e-4


@pytest.mark.parametrize("qwen", ["qwen2_5_vl"], indirect=True)
def test_windows_matter(qwen):
    """Qwen2.5-VL's windowed blocks see only their window: attending to the whole image instead changes the
    features (so the parity above covers the windows)."""
    d, _ = qwen
    vision = QwenVision.from_dir(d, dtype=torch.float32)
    assert vision.spec.window == 2 and vision.spec.full_attention == (1,)
    image = _noise(150, 90, seed=8)
    emb = vision.encode(image)
    vision.spec = dataclasses.replace(vision.spec, full_attention=(0, 1, 2))
    assert (vision.encode(image).features - emb.features).abs().max() > 1e-3


def _replace_image_token(kind: str):
    """Qwen2VLProcessor / Qwen2_5_VLProcessor.replace_image_token, called unbound: building either processor needs
    its video processor, which imports torchvision, which the test environment does not install."""
    if kind == "qwen2_vl":
        from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor as Processor
    else:
        from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor as Processor
    return Processor.replace_image_token


def _tokenizer():
    """A word-level tokenizer with Qwen's vision tokens at the tiny configs' ids."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    named = {START: "<|vision_start|>", END: "<|vision_end|>", PAD: "<|image_pad|>", VIDEO: "<|video_pad|>"}
    special = {0: "<unk>", 1: "<|endoftext|>", **named}
    tok = HFTokenizer(models.WordLevel({special.get(i, f"w{i}"): i for i in range(256)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in named.values()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>")


@pytest.mark.parametrize("size", [(150, 90), (10, 12)])
def test_token_ids_are_the_processors(qwen, size):
    """<|image_pad|> × t·h·w / merge², as the processor expands the template's one <|image_pad|>; the merged grid;
    transformers' forward accepts the tokens with the pixels (one <|image_pad|> per feature row)."""
    d, model = qwen
    vision = QwenVision.from_dir(d, dtype=torch.float32)
    assert vision.spec.marker_id == PAD
    image = _noise(*size, seed=11)
    emb = vision.encode(image)
    pixels, grid = _hf_inputs(d, image)
    processor = SimpleNamespace(image_processor=SimpleNamespace(merge_size=MERGE), image_token="<|image_pad|>")
    text = "<|vision_start|>" + _replace_image_token(vision.spec.kind)(processor, {"image_grid_thw": grid}, 0) \
        + "<|vision_end|>"
    expected = _tokenizer()(text, add_special_tokens=False)["input_ids"]
    assert expected == [START, *emb.token_ids, END] and emb.image_token_id == PAD
    t, h, w = grid[0].tolist()
    assert emb.token_ids.count(PAD) == t * h * w // MERGE ** 2 == emb.features.shape[0]
    assert emb.grid == (t, h // MERGE, w // MERGE)
    ids = torch.tensor([[1, *expected, 9]])
    with torch.no_grad():   # mm_token_type_ids as the processor returns them: 1 marks an image token
        model(input_ids=ids, mm_token_type_ids=(ids == PAD).long(), pixel_values=pixels, image_grid_thw=grid)


def test_checkpoint_layouts(qwen, tmp_path):
    """The stored visual.* and the in-memory model.visual.* names (sharded) give the same features; transformers
    reads the latter as the same model."""
    from transformers import AutoModelForImageTextToText

    d, model = qwen
    tensors = load_file(d / "model.safetensors")
    assert "visual.patch_embed.proj.weight" in tensors
    prefixed = {("model." + k if k.startswith("visual.") else k): v for k, v in tensors.items()}
    names = sorted(prefixed)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": {k: prefixed[k] for k in part}
              for i, part in enumerate((names[::2], names[1::2]))}
    other = _copy_with(d, tmp_path / "v5", shards)
    index = {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}
    (other / "model.safetensors.index.json").write_text(json.dumps(index))
    image = _noise(90, 60, seed=5)
    ref = QwenVision.from_dir(d, dtype=torch.float32).encode(image)
    got = QwenVision.from_dir(other, dtype=torch.float32).encode(image)
    assert torch.equal(ref.features, got.features) and ref.token_ids == got.token_ids and ref.grid == got.grid
    reloaded = AutoModelForImageTextToText.from_pretrained(other, dtype=torch.float32).eval()
    _assert_close(ref.features, _hf_features(reloaded, *_hf_inputs(d, image)))
    assert isinstance(load_vision(other, dtype=torch.float32), QwenVision)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 0.01), (torch.bfloat16, 0.04)])
def test_half_precision_tracks_float32(qwen, dtype, tolerance):
    """fp16 and bf16 towers stay within 1 % and 4 % of the float32 features' largest value (about 0.15 % and 1.2 %
    here), and return the rows in their own dtype."""
    image = _noise(150, 90, seed=6)
    ref = QwenVision.from_dir(qwen[0], dtype=torch.float32).encode(image).features
    got = QwenVision.from_dir(qwen[0], dtype=dtype).encode(image).features
    assert got.dtype == dtype and got.shape == ref.shape
    assert (got.float() - ref).abs().max() <= tolerance * ref.abs().max()


def test_exl2_quantized_vision_linear(qwen, tmp_path):
    """An EXL2 fused attn.qkv in the first block (with bias) loads through the decoder's weight loader: the features
    are those of the HF model holding the dequantized weight."""
    d, model = qwen
    tensors = load_file(d / "model.safetensors")
    weight, bias = quantize_linear(tensors, "visual.blocks.0.attn.qkv")
    quant = _copy_with(d, tmp_path / "q", {"model.safetensors": tensors})
    vision = QwenVision.from_dir(quant, dtype=torch.float32)
    assert vision.blocks[0].qkv.info["format"] == "exl2"
    image = _noise(60, 80, seed=10)
    emb = vision.encode(image)
    with holding(model.model.visual.blocks[0].attn.qkv, weight, bias):
        _assert_close(emb.features, _hf_features(model, *_hf_inputs(d, image)))


def test_no_vision_encoder(fixtures, qwen, tmp_path):
    """A text-only model and a Qwen export whose files hold only the text decoder have no Qwen vision encoder."""
    assert QwenVision.from_dir(fixtures / "golden" / "b4.0_hb6") is None
    d, _ = qwen
    text_only = {k: v for k, v in load_file(d / "model.safetensors").items() if not k.startswith("visual.")}
    assert text_only and QwenVision.from_dir(_copy_with(d, tmp_path / "text", {"model.safetensors": text_only})) is None
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"][0] in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
    other = _copy_with(d, tmp_path / "other", {"model.safetensors": load_file(d / "model.safetensors")})
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForCausalLM"]}))
    assert QwenVision.from_dir(other) is None and load_vision(other) is None
