"""The Pixtral vision encoder (exl2.models.vision) against transformers 5: tiny Mistral3ForConditionalGeneration and
Llava-with-Pixtral models with random weights, saved to disk. Preprocessing equals PixtralImageProcessor's output,
features equal get_image_features', the token layout is what PixtralProcessor inserts, both checkpoint layouts and
EXL2-quantized vision linears load, images decode from bytes, data URIs and paths, and text-only models have no
vision encoder."""
import ast
import base64
import contextlib
import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.torch import load_file, save_file

from exl2.errors import ConfigError
from exl2.models.vision import ImageProcessing, PixtralSpec, PixtralVision, load_image

PATCH, MERGE, LONGEST = 14, 2, 112
IMG, IMG_BREAK, IMG_END = 10, 12, 13
SIZES = [(45, 70), (100, 33), (300, 200)]   # PIL (width, height); the last is shrunk to fit LONGEST
MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]


MISTRAL_SMALL_31 = {  # mistralai/Mistral-Small-3.1-24B-Instruct-2503 (text_config shortened)
    "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
    "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "text_config": {"hidden_size": 5120, "model_type": "mistral", "rms_norm_eps": 1e-05, "vocab_size": 131072},
    "vision_config": {"attention_dropout": 0.0, "head_dim": 64, "hidden_act": "silu", "hidden_size": 1024,
                      "image_size": 1540, "initializer_range": 0.02, "intermediate_size": 4096, "model_type": "pixtral",
                      "num_attention_heads": 16, "num_channels": 3, "num_hidden_layers": 24, "patch_size": 14,
                      "rope_theta": 10000.0},
    "vision_feature_layer": -1,
}
PIXTRAL_12B = {  # after mistral-community/pixtral-12b (text_config shortened)
    "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 10, "model_type": "llava",
    "projector_hidden_act": "gelu", "text_config": {"hidden_size": 5120, "model_type": "mistral"},
    "vision_config": {"head_dim": 64, "hidden_act": "silu", "image_size": 1024, "model_type": "pixtral",
                      "patch_size": 16, "rope_theta": 10000.0},
    "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
}


def _noise(width: int, height: int, seed: int = 0, mode: str = "RGB") -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return PIL.Image.fromarray(data[..., 0] if channels == 1 else data, mode)


def _vision_config(**kw):
    from transformers import PixtralVisionConfig

    return PixtralVisionConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                               image_size=LONGEST, patch_size=PATCH, hidden_act="silu",
                               rope_parameters={"rope_type": "axial", "rope_theta": 1000.0}, **kw)


def _text_config():
    from transformers import MistralConfig

    # rms_norm_eps 1e-3: the projector's norm must take the text model's eps, not the tower's 1e-5
    return MistralConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=24, vocab_size=256, rms_norm_eps=1e-3, sliding_window=None)


def _mistral3_config(feature_layer=-1):
    from transformers import Mistral3Config

    return Mistral3Config(text_config=_text_config(), vision_config=_vision_config(), image_token_index=IMG,
                          spatial_merge_size=MERGE, multimodal_projector_bias=True, vision_feature_layer=feature_layer)


def _llava_config():
    from transformers import LlavaConfig

    return LlavaConfig(text_config=_text_config(), vision_config=_vision_config(), image_token_index=IMG,
                       vision_feature_layer=[0, -1], vision_feature_select_strategy="full")


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight redrawn: norm weights 1 + 0.1·N(0, 1), biases 0.1·N(0, 1), matrices scaled by fan-in."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith(".bias"):
            p.copy_(0.1 * noise)
        elif p.ndim == 1:
            p.copy_(1.0 + 0.1 * noise)
        else:
            p.copy_(noise * p[0].numel() ** -0.5)


def _save_tokenizer(out: Path) -> None:
    """A word-level tokenizer whose special tokens sit at Mistral's ids ([IMG] 10, [IMG_BREAK] 12, [IMG_END] 13)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {0: "<unk>", 1: "<s>", 2: "</s>", IMG: "[IMG]", IMG_BREAK: "[IMG_BREAK]", IMG_END: "[IMG_END]"}
    vocab = {special.get(i, f"w{i}"): i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    fast.save_pretrained(out)


def _build(config, out: Path, seed: int):
    """The tiny model saved with its preprocessor config (small longest_edge, own mean/std) and tokenizer."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    model = AutoModelForImageTextToText.from_config(config, attn_implementation="eager", dtype=torch.float32)
    _randomize(model, seed)
    model.eval()
    model.save_pretrained(out)
    PixtralImageProcessorPil(patch_size=PATCH, size={"longest_edge": LONGEST}, image_mean=MEAN,
                             image_std=STD).save_pretrained(out)
    _save_tokenizer(out)
    return model


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    out = tmp_path_factory.mktemp("mistral3")
    return out, _build(_mistral3_config(), out, seed=1)


def _hf_pixels(model_dir: Path, image: PIL.Image.Image, patch: int) -> tuple[torch.Tensor, list]:
    """PixtralImageProcessor's output as the Mistral 3 processor asks for it (patch_size × spatial_merge_size)."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    out = PixtralImageProcessorPil.from_pretrained(model_dir)(image, patch_size=patch, return_tensors="pt")
    return out["pixel_values"], [list(map(int, s)) for s in out["image_sizes"]]


@torch.no_grad()
def _hf_features(model, pixels: torch.Tensor, sizes: list) -> torch.Tensor:
    out = model.get_image_features(pixel_values=pixels, image_sizes=torch.tensor(sizes), return_dict=True)
    return out.pooler_output[0]


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours.float() - ref.float()).abs().max().item()
    assert diff <= 1e-4 * ref.abs().max().item(), diff


def test_published_configs():
    """The published configs read as transformers reads them: the top-level rope_theta of older vision configs,
    head_dim = hidden / heads, the text model's eps for the projector norm, Llava's bias default and no merger."""
    s = PixtralSpec.from_config(MISTRAL_SMALL_31)
    assert (s.hidden, s.intermediate, s.heads, s.head_dim, s.layers, s.patch, s.act) == (1024, 4096, 16, 64, 24, 14,
                                                                                         "silu")
    assert (s.rope_theta, s.text_hidden, s.merge, s.norm_eps, s.projector_bias) == (10000.0, 5120, 2, 1e-5, False)
    assert (s.feature_layers, s.image_token_id, s.projector_act) == ((24,), 10, "gelu")
    p = PixtralSpec.from_config(PIXTRAL_12B)
    assert (p.hidden, p.layers, p.patch, p.merge, p.norm_eps, p.projector_bias) == (1024, 24, 16, 1, None, True)
    assert PixtralSpec.from_config({**PIXTRAL_12B, "vision_config": {"model_type": "clip_vision_model"}}) is None
    with pytest.raises(ConfigError, match="vision_feature_select_strategy"):
        PixtralSpec.from_config({**PIXTRAL_12B, "vision_feature_select_strategy": "default"})
    with pytest.raises(ConfigError, match="vision_feature_layer"):
        PixtralSpec.from_config({**MISTRAL_SMALL_31, "vision_feature_layer": -26})


@pytest.mark.parametrize("size", SIZES + [(57, 57)])
def test_preprocess_is_pixtral_image_processor(mistral3, size):
    """Resize (longest edge, then up to whole 28-pixel merged patches), rescale and normalize: bit for bit."""
    d, _ = mistral3
    vision = PixtralVision.from_dir(d, dtype=torch.float32)
    image = _noise(*size, seed=sum(size))
    ours = vision.preprocess(image)
    ref, sizes = _hf_pixels(d, image, PATCH * MERGE)
    assert ours.dtype == torch.float32 and list(ours.shape[1:]) == sizes[0]
    assert ours.shape[1] % (PATCH * MERGE) == 0 and ours.shape[2] % (PATCH * MERGE) == 0
    assert max(ours.shape[1:]) <= LONGEST
    assert torch.allclose(ours, ref[0], rtol=0, atol=1e-6)


def test_preprocess_defaults_and_modes(tmp_path, mistral3):
    """Without a preprocessor config, transformers' defaults (longest edge 1024, CLIP mean/std); grayscale and RGBA
    images become RGB as transformers' convert_to_rgb makes them."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    image = _noise(1500, 40, seed=3)
    ours = ImageProcessing.from_dir(tmp_path, 28)(image)
    ref = PixtralImageProcessorPil()(image, patch_size=28, return_tensors="pt")["pixel_values"][0]
    assert ours.shape == ref.shape == (3, 28, 1036)   # 1024 rounds up to whole patches
    assert torch.allclose(ours, ref, rtol=0, atol=1e-6)
    d, _ = mistral3
    for mode in ("L", "RGBA"):
        image = _noise(60, 50, seed=4, mode=mode)
        ref = _hf_pixels(d, image, PATCH * MERGE)[0][0]
        assert torch.allclose(PixtralVision.from_dir(d, dtype=torch.float32).preprocess(image), ref, rtol=0,
                              atol=1e-6)


@pytest.mark.parametrize("size", SIZES)
def test_features_match_get_image_features(mistral3, size):
    d, model = mistral3
    vision = PixtralVision.from_dir(d, dtype=torch.float32)
    image = _noise(*size, seed=7 + size[0])
    emb = vision.encode(image)
    pixels, sizes = _hf_pixels(d, image, PATCH * MERGE)
    ref = _hf_features(model, pixels, sizes)
    assert ref.shape[0] >= 2
    assert emb.features.dtype == torch.float32 and emb.features.device.type == "cpu"
    _assert_close(emb.features, ref)


def _replace_image_token():
    """PixtralProcessor.replace_image_token, taken from transformers' source: the processor module imports
    torchvision, which the test environment does not install."""
    import transformers.models.pixtral as pixtral

    path = Path(pixtral.__file__).with_name("processing_pixtral.py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PixtralProcessor")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "replace_image_token")
    scope: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), scope)
    return scope["replace_image_token"]


@pytest.mark.parametrize("size", SIZES)
def test_token_ids_are_the_processors(mistral3, size):
    """The [IMG]/[IMG_BREAK]/[IMG_END] layout PixtralProcessor writes for the image, tokenized by the model's
    tokenizer; transformers' forward accepts it with the pixels (one [IMG] per feature row)."""
    from transformers import AutoTokenizer

    d, model = mistral3
    vision = PixtralVision.from_dir(d, dtype=torch.float32)
    image = _noise(*size, seed=11)
    emb = vision.encode(image)
    pixels, sizes = _hf_pixels(d, image, PATCH * MERGE)
    processor = SimpleNamespace(patch_size=PATCH, spatial_merge_size=MERGE, image_token="[IMG]",
                                image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]")
    text = _replace_image_token()(processor, {"image_sizes": sizes}, 0)
    expected = AutoTokenizer.from_pretrained(d)(text, add_special_tokens=False)["input_ids"]
    assert emb.token_ids == expected and emb.image_token_id == IMG
    rows, cols = sizes[0][0] // (PATCH * MERGE), sizes[0][1] // (PATCH * MERGE)
    assert rows >= 2 and expected.count(IMG_BREAK) == rows - 1 and expected[-1] == IMG_END
    assert expected.count(IMG) == rows * cols == emb.features.shape[0]
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, *emb.token_ids, 5]]), pixel_values=pixels, image_sizes=torch.tensor(sizes))


def _copy_with(src: Path, dst: Path, shards: dict[str, dict]) -> Path:
    """`src`'s configs and tokenizer, with other weights: {file name: tensors}."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    for name, tensors in shards.items():
        save_file(tensors, str(dst / name))
    return dst


def test_both_checkpoint_layouts(mistral3, tmp_path):
    """transformers 5's in-memory names (model.vision_tower.*, model.multi_modal_projector.*), sharded, give the
    same features as the stored vision_tower.* / multi_modal_projector.*."""
    d, _ = mistral3
    tensors = load_file(d / "model.safetensors")
    assert any(k.startswith("vision_tower.") for k in tensors)
    renamed = {("model." + k if k.startswith(("vision_tower.", "multi_modal_projector.")) else k): v
               for k, v in tensors.items()}
    names = sorted(renamed)
    other = _copy_with(d, tmp_path / "v5", {f"model-0000{i + 1}-of-00002.safetensors": {k: renamed[k] for k in part}
                                            for i, part in enumerate((names[::2], names[1::2]))})
    image = _noise(90, 60, seed=5)
    ref = PixtralVision.from_dir(d, dtype=torch.float32).encode(image)
    got = PixtralVision.from_dir(other, dtype=torch.float32).encode(image)
    assert torch.equal(ref.features, got.features) and ref.token_ids == got.token_ids


def half_precision_tracks_float32(vision_class, model_dir) -> None:
    """bf16 and fp16 encodings of a noise image stay within 5 % of the float32 one's largest value."""
    image = _noise(70, 90, seed=6)
    ref = vision_class.from_dir(model_dir, dtype=torch.float32).encode(image).features
    for dtype in (torch.bfloat16, torch.float16):
        got = vision_class.from_dir(model_dir, dtype=dtype).encode(image).features
        assert got.dtype == dtype
        assert (got.float() - ref).abs().max() <= 0.05 * ref.abs().max()


def test_half_precision_tracks_float32(mistral3):
    half_precision_tracks_float32(PixtralVision, mistral3[0])


def test_other_feature_layer(tmp_path):
    """vision_feature_layer -2 feeds the projector the first of two layers' outputs (the last layer never runs)."""
    model = _build(_mistral3_config(feature_layer=-2), tmp_path, seed=2)
    vision = PixtralVision.from_dir(tmp_path, dtype=torch.float32)
    assert len(vision.layers) == 1
    image = _noise(80, 64, seed=8)
    _assert_close(vision.encode(image).features, _hf_features(model, *_hf_pixels(tmp_path, image, PATCH * MERGE)))


def test_llava_pixtral(tmp_path):
    """Pixtral-12B's layout: no merger (one token per 14-pixel patch), a two-layer projector, and here two feature
    layers concatenated."""
    model = _build(_llava_config(), tmp_path, seed=3)
    vision = PixtralVision.from_dir(tmp_path, dtype=torch.float32)
    image = _noise(50, 40, seed=9)
    emb = vision.encode(image)
    pixels, sizes = _hf_pixels(tmp_path, image, PATCH)
    _assert_close(emb.features, _hf_features(model, pixels, sizes))
    rows, cols = sizes[0][0] // PATCH, sizes[0][1] // PATCH
    assert emb.token_ids == ([IMG] * cols + [IMG_BREAK]) * (rows - 1) + [IMG] * cols + [IMG_END]


def test_exl2_quantized_vision_linear(mistral3, tmp_path):
    """An EXL2 projector linear_1 (padded to 32 columns, with bias) loads through the decoder's weight loader:
    the features are those of the HF model holding the dequantized weight."""
    d, model = mistral3
    tensors = load_file(d / "model.safetensors")
    weight, bias = quantize_linear(tensors, "multi_modal_projector.linear_1")
    quant = _copy_with(d, tmp_path / "q", {"model.safetensors": tensors})
    image = _noise(60, 80, seed=10)
    vision = PixtralVision.from_dir(quant, dtype=torch.float32)
    assert vision.projector.linear_1.info["format"] == "exl2"
    emb = vision.encode(image)
    with holding(model.model.multi_modal_projector.linear_1, weight, bias):
        _assert_close(emb.features, _hf_features(model, *_hf_pixels(d, image, PATCH * MERGE)))


def quantize_linear(tensors: dict, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace the dense linear `prefix` (weight [n, k] and bias) in `tensors` by EXL2 tensors (6-bit then 4-bit
    groups, a random act order, the bias kept); (its dequantized weight [n, k], bias) for the HF model."""
    from exl2.formats.exl2 import dequantize, pack

    n, k = tensors[f"{prefix}.weight"].shape
    gen = torch.Generator().manual_seed(12)
    groups = [(6, 32), (4, k - 32)]
    codes = torch.cat([torch.randint(0, 1 << b, (rows, n), generator=gen) for b, rows in groups])
    packed = pack(codes, groups, torch.randint(8, 17, (2, n), generator=gen), torch.tensor([0.004, 0.02]),
                  torch.randperm(k, generator=gen), bias=0.1 * torch.randn(n, generator=gen))
    del tensors[f"{prefix}.weight"], tensors[f"{prefix}.bias"]
    tensors.update({f"{prefix}.{name}": t for name, t in packed.items()})
    return dequantize(tensors, prefix).t()[:n].float(), tensors[f"{prefix}.bias"][:n].float()


@contextlib.contextmanager
def holding(linear: torch.nn.Linear, weight: torch.Tensor, bias: torch.Tensor):
    """An HF linear layer holding `weight` and `bias` inside the block, its own again after."""
    saved = linear.weight.detach().clone(), linear.bias.detach().clone()
    try:
        with torch.no_grad():
            linear.weight.copy_(weight)
            linear.bias.copy_(bias)
        yield
    finally:
        with torch.no_grad():
            linear.weight.copy_(saved[0])
            linear.bias.copy_(saved[1])


def _png(image: PIL.Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_load_image(tmp_path):
    image = _noise(21, 13, seed=1)
    data = _png(image)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    for source in (data, uri, path, str(path)):
        got = load_image(source)
        assert got.mode == "RGB" and got.size == (21, 13)
        assert np.array_equal(np.asarray(got), np.asarray(image))
    rgba = PIL.Image.new("RGBA", (4, 4), (10, 20, 30, 0))   # fully transparent: white, not the hidden colour
    assert np.asarray(load_image(_png(rgba))).min() == 255
    assert load_image(_png(_noise(5, 6, mode="L"))).mode == "RGB"
    for garbage in (b"not an image", b"", "data:image/png;base64,bm90IGFuIGltYWdl", "data:image/png",
                    tmp_path / "missing.png", _png(image)[:40]):
        with pytest.raises(ConfigError):
            load_image(garbage)


def test_no_vision_encoder(fixtures, mistral3, tmp_path):
    """A text-only model, and a Mistral 3 export whose files hold only the text decoder, have no vision encoder."""
    assert PixtralVision.from_dir(fixtures / "golden" / "b4.0_hb6") is None
    d, _ = mistral3
    text_only = {k: v for k, v in load_file(d / "model.safetensors").items() if k.startswith("language_model.")}
    assert PixtralVision.from_dir(_copy_with(d, tmp_path / "text", {"model.safetensors": text_only})) is None
    assert json.loads((d / "config.json").read_text())["architectures"] == ["Mistral3ForConditionalGeneration"]
