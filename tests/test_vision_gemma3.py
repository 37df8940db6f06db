"""The Gemma 3 vision encoder (exl2.models.vision.gemma3) against transformers 5: a tiny
Gemma3ForConditionalGeneration (SigLIP tower, 8×8 patches average-pooled to 4×4 soft tokens) with random weights,
saved with its Gemma3Processor. Preprocessing equals Gemma3ImageProcessor's (PIL backend) output, features equal
get_image_features', the token layout is what Gemma3Processor writes for one image, the published, transformers 5
and EXL2-quantized checkpoint forms load, and other models have no Gemma 3 vision encoder."""
import json
from pathlib import Path

import PIL.Image
import pytest
import torch
from safetensors.torch import load_file
from test_vision import (_assert_close, _build, _copy_with, _mistral3_config, _noise, half_precision_tracks_float32,
                         holding, quantize_linear)

from exl2.errors import ConfigError
from exl2.generation.tokenizer import Tokenizer
from exl2.models.vision import Gemma3ImageProcessing, Gemma3Vision, Gemma3VisionSpec

IMAGE, PATCH, TOKENS = 64, 8, 16        # 8×8 patches, pooled 2×2 → 4×4 soft tokens
BOI, EOI, SOFT, NEWLINES, NEWLINES4 = 5, 6, 7, 8, 9   # <start_of_image>, <end_of_image>, <image_soft_token>, "\n\n",
                                                      # "\n\n\n\n" (Gemma's tokenizer has such newline runs)
SIZES = [(45, 70), (100, 33), (301, 199)]   # PIL (width, height)
MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]

GEMMA_3_4B = {  # google/gemma-3-4b-it (text_config shortened)
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}
GEMMA_3_PREPROCESSOR = {  # google/gemma-3-4b-it's preprocessor_config.json: unset keys are null
    "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None, "processor_class": "Gemma3Processor", "resample": 2,
    "rescale_factor": 0.00392156862745098, "size": {"height": 896, "width": 896},
}


def _config():
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=24, vocab_size=256)
    # layer_norm_eps 1e-3: the projector's RMSNorm must take the vision eps, not Gemma's usual 1e-6
    vision = SiglipVisionConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                image_size=IMAGE, patch_size=PATCH, layer_norm_eps=1e-3, vision_use_head=False)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS, boi_token_index=BOI,
                        eoi_token_index=EOI, image_token_index=SOFT)


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight redrawn: LayerNorm weights 1 + 0.1·N(0, 1), Gemma norms (x·(1 + w)) and biases 0.1·N(0, 1),
    matrices scaled by fan-in."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith(".bias") or (p.ndim == 1 and "vision_tower" not in name):
            p.copy_(0.1 * noise)
        elif p.ndim == 1:
            p.copy_(1.0 + 0.1 * noise)
        else:
            p.copy_(noise * p[0].numel() ** -0.5)


def _tokenizer():
    """A word-level tokenizer with Gemma 3's image tokens (at the tiny config's ids), and "\\n\\n" and "\\n\\n\\n\\n"
    as one token each."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    named = {BOI: "<start_of_image>", EOI: "<end_of_image>", SOFT: "<image_soft_token>", NEWLINES: "\n\n",
             NEWLINES4: "\n\n\n\n"}
    special = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", **named}
    tok = HFTokenizer(models.WordLevel({special.get(i, f"w{i}"): i for i in range(256)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(named[i], normalized=False) for i in (BOI, EOI, SOFT)])
    tok.add_tokens([AddedToken(named[i], normalized=False) for i in (NEWLINES4, NEWLINES)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": named[BOI], "eoi_token": named[EOI], "image_token": named[SOFT]})


def _save_processor(out: Path, **image_kw) -> None:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    images = Gemma3ImageProcessorPil(size={"height": IMAGE, "width": IMAGE}, **image_kw)
    Gemma3Processor(image_processor=images, tokenizer=_tokenizer(), image_seq_length=TOKENS).save_pretrained(out)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """The tiny model, its processor (bicubic, own mean/std: the config must be read) and tokenizer."""
    from transformers import Gemma3ForConditionalGeneration

    out = tmp_path_factory.mktemp("gemma3")
    model = Gemma3ForConditionalGeneration._from_config(_config(), attn_implementation="eager", dtype=torch.float32)
    _randomize(model, seed=1)
    model.eval()
    model.save_pretrained(out)
    _save_processor(out, resample=PIL.Image.Resampling.BICUBIC, image_mean=MEAN, image_std=STD)
    return out, model


def _hf_pixels(model_dir: Path, image: PIL.Image.Image) -> torch.Tensor:
    """Gemma3ImageProcessor's PIL backend, as AutoProcessor picks it without torchvision."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil.from_pretrained(model_dir)(image, return_tensors="pt")["pixel_values"]


@torch.no_grad()
def _hf_features(model, pixels: torch.Tensor) -> torch.Tensor:
    return model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output[0]


def test_published_config():
    """gemma-3-4b-it's config reads as transformers reads it (SigLIP's defaults for the keys it leaves out)."""
    s = Gemma3VisionSpec.from_config(GEMMA_3_4B)
    assert (s.hidden, s.intermediate, s.heads, s.head_dim, s.layers, s.channels) == (1152, 4304, 16, 72, 27, 3)
    assert (s.image_size, s.patch, s.patches_per_side, s.pool, s.mm_tokens_per_image) == (896, 14, 64, 4, 256)
    assert (s.act, s.eps, s.text_hidden) == ("gelu_pytorch_tanh", 1e-6, 2560)
    assert (s.image_token_id, s.marker_id, s.end_id) == (262144, 255999, 256000)
    assert Gemma3VisionSpec.from_config({**GEMMA_3_4B, "architectures": ["Gemma3ForCausalLM"]}) is None
    assert Gemma3VisionSpec.from_config({k: v for k, v in GEMMA_3_4B.items() if k != "vision_config"}) is None
    for tokens in (200, 16384):   # not a square; more tokens than patches
        with pytest.raises(ConfigError, match="mm_tokens_per_image"):
            Gemma3VisionSpec.from_config({**GEMMA_3_4B, "mm_tokens_per_image": tokens})


@pytest.mark.parametrize("size", SIZES + [(64, 64)])
def test_preprocess_is_gemma3_image_processor(gemma3, size):
    """Resize to 64×64 whatever the aspect ratio (bicubic, as the config says), rescale, normalize: bit for bit."""
    d, _ = gemma3
    vision = Gemma3Vision.from_dir(d, dtype=torch.float32)
    image = _noise(*size, seed=sum(size))
    ours = vision.preprocess(image)
    ref = _hf_pixels(d, image)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape[1:] == (3, IMAGE, IMAGE)
    assert torch.equal(ours, ref[0])


def test_preprocess_defaults_and_modes(tmp_path, gemma3):
    """Without a preprocessor config, Gemma3ImageProcessor's defaults (bilinear, mean = std = 0.5) at the tower's
    size; published configs' nulls mean the defaults too; grayscale and RGBA images become RGB as transformers'
    convert_to_rgb makes them."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    image = _noise(90, 41, seed=3)
    ours = Gemma3ImageProcessing.from_dir(tmp_path, IMAGE)(image)
    ref = Gemma3ImageProcessorPil(size={"height": IMAGE, "width": IMAGE})(image, return_tensors="pt")
    assert torch.equal(ours, ref["pixel_values"][0])
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(GEMMA_3_PREPROCESSOR))
    ours = Gemma3ImageProcessing.from_dir(tmp_path, 896)(image)
    assert torch.equal(ours, _hf_pixels(tmp_path, image)[0])
    d, _ = gemma3
    vision = Gemma3Vision.from_dir(d, dtype=torch.float32)
    for mode in ("L", "RGBA"):
        image = _noise(60, 50, seed=4, mode=mode)
        assert torch.equal(vision.preprocess(image), _hf_pixels(d, image)[0])


def test_preprocessor_size_must_be_the_towers(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(GEMMA_3_PREPROCESSOR))
    with pytest.raises(ConfigError, match="896"):
        Gemma3ImageProcessing.from_dir(tmp_path, IMAGE)


@pytest.mark.parametrize("size", SIZES)
def test_features_match_get_image_features(gemma3, size):
    d, model = gemma3
    vision = Gemma3Vision.from_dir(d, dtype=torch.float32)
    image = _noise(*size, seed=7 + size[0])
    emb = vision.encode(image)
    ref = _hf_features(model, _hf_pixels(d, image))
    assert ref.shape == (TOKENS, 48)
    assert emb.features.dtype == torch.float32 and emb.features.device.type == "cpu"
    _assert_close(emb.features, ref)


@pytest.mark.parametrize("text", ["<start_of_image>", "w40\n\n<start_of_image>\n\nw41", "<start_of_image>w42"])
def test_token_ids_are_the_processors(gemma3, text):
    """The tokens Gemma3Processor writes for a prompt with one <start_of_image>, whether the tokenizer is passed in
    or read from the directory: its "\\n\\n"s merge with the prompt's own newlines as in the processor, which
    expands the text before tokenizing it; transformers' forward accepts them with the pixels (one soft token per
    feature row)."""
    from transformers import AutoProcessor

    from exl2.generation.multimodal import VisionPrompts

    d, model = gemma3
    image = _noise(70, 50, seed=11)
    processor = AutoProcessor.from_pretrained(d)
    inputs = processor(images=[image], text=[text], return_tensors="pt")
    expected = inputs["input_ids"][0].tolist()
    if text == "<start_of_image>":
        assert expected == [NEWLINES, BOI, *[SOFT] * TOKENS, EOI, NEWLINES]
    else:
        assert expected.count(NEWLINES4) == 2 * ("\n\n" in text)
    tokenizer = Tokenizer.from_dir(d)
    for given in (None, tokenizer):
        vision = Gemma3Vision.from_dir(d, dtype=torch.float32, tokenizer=given)
        emb = vision.encode(image)
        assert emb.token_ids == [BOI, *[SOFT] * TOKENS, EOI] and emb.image_token_id == SOFT
        assert emb.token_ids.count(SOFT) == emb.features.shape[0]
        ids, _ = VisionPrompts(vision, 256).prompt(text, tokenizer, [image])
        assert [SOFT if t >= 256 else t for t in ids] == expected
    assert Gemma3Vision.from_dir(d).spec.marker_id == BOI
    with torch.no_grad():
        model(**inputs)


def _published(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The names of the published Gemma 3 files: SigLIP under vision_tower.vision_model.*."""
    return {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
            for k, v in tensors.items()}


def test_checkpoint_layouts(gemma3, tmp_path):
    """transformers 5's save (vision_tower.*), the published files (vision_tower.vision_model.*, which transformers
    reads as the same model), and those with the in-memory `model.` prefix, sharded, give the same features."""
    from transformers import Gemma3ForConditionalGeneration

    d, model = gemma3
    tensors = load_file(d / "model.safetensors")
    assert "vision_tower.post_layernorm.weight" in tensors     # transformers 5 saves SigLIP without vision_model
    published = _published(tensors)
    prefixed = {("model." + k if k.startswith(("vision_tower.", "multi_modal_projector.")) else k): v
                for k, v in published.items()}
    names = sorted(prefixed)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": {k: prefixed[k] for k in part}
              for i, part in enumerate((names[::2], names[1::2]))}
    dirs = [_copy_with(d, tmp_path / "published", {"model.safetensors": published}),
            _copy_with(d, tmp_path / "prefixed", shards)]
    image = _noise(90, 60, seed=5)
    ref = Gemma3Vision.from_dir(d, dtype=torch.float32).encode(image)
    for other in dirs:
        got = Gemma3Vision.from_dir(other, dtype=torch.float32).encode(image)
        assert torch.equal(ref.features, got.features) and ref.token_ids == got.token_ids
    reloaded = Gemma3ForConditionalGeneration.from_pretrained(dirs[0], dtype=torch.float32).eval()
    _assert_close(ref.features, _hf_features(reloaded, _hf_pixels(d, image)))
    _assert_close(ref.features, _hf_features(model, _hf_pixels(d, image)))


def test_half_precision_tracks_float32(gemma3):
    half_precision_tracks_float32(Gemma3Vision, gemma3[0])


def test_exl2_quantized_vision_linear(gemma3, tmp_path):
    """An EXL2 fc1 in the first SigLIP layer (with bias, published names) loads through the decoder's weight loader:
    the features are those of the HF model holding the dequantized weight."""
    d, model = gemma3
    tensors = _published(load_file(d / "model.safetensors"))
    prefix = "vision_tower.vision_model.encoder.layers.0.mlp.fc1"
    weight, bias = quantize_linear(tensors, prefix)
    quant = _copy_with(d, tmp_path / "q", {"model.safetensors": tensors})
    vision = Gemma3Vision.from_dir(quant, dtype=torch.float32)
    assert vision.layers[0].fc1.info["format"] == "exl2"
    image = _noise(60, 80, seed=10)
    emb = vision.encode(image)
    with holding(model.model.vision_tower.encoder.layers[0].mlp.fc1, weight, bias):
        _assert_close(emb.features, _hf_features(model, _hf_pixels(d, image)))


def test_no_vision_encoder(fixtures, gemma3, tmp_path):
    """A text-only model, a Mistral 3 model (a vision tower of another kind) and a Gemma 3 export whose files hold
    only the text decoder have no Gemma 3 vision encoder."""
    assert Gemma3Vision.from_dir(fixtures / "golden" / "b4.0_hb6") is None
    mistral3 = tmp_path / "mistral3"
    mistral3.mkdir()
    _build(_mistral3_config(), mistral3, seed=1)
    assert any(k.startswith("vision_tower.") for k in load_file(mistral3 / "model.safetensors"))
    assert Gemma3Vision.from_dir(mistral3) is None
    d, _ = gemma3
    text_only = {k: v for k, v in load_file(d / "model.safetensors").items() if k.startswith("language_model.")}
    assert Gemma3Vision.from_dir(_copy_with(d, tmp_path / "text", {"model.safetensors": text_only})) is None
    assert json.loads((d / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]


@pytest.mark.parametrize("size", [(900, 300), (120, 500), (300, 290), (330, 300)])
def test_pan_and_scan_is_the_processors(gemma3, size):
    """With pan-and-scan on: the crops (3 side by side, 4 stacked with a short last one, none for near-square
    images) and their pixels are Gemma3ImageProcessor's, and the prompt's tokens are what Gemma3Processor writes
    for the whole image and its crops."""
    import dataclasses

    from transformers import AutoProcessor

    from exl2.generation.multimodal import VisionPrompts

    d, model = gemma3
    image = _noise(*size, seed=13)
    vision = Gemma3Vision.from_dir(d, dtype=torch.float32)
    assert vision.crops(image) == []          # off, as the saved processor says
    vision.processing = dataclasses.replace(vision.processing, pan_and_scan=True, min_crop=100)
    hf = AutoProcessor.from_pretrained(d)
    kw = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=100, pan_and_scan_max_num_crops=4,
              pan_and_scan_min_ratio_to_activate=1.2)
    ref = hf.image_processor(image, return_tensors="pt", **kw)
    crops = vision.crops(image)
    assert len(crops) == int(ref["num_crops"][0]) == {(900, 300): 3, (120, 500): 4}.get(size, 0)
    pixels = torch.stack([vision.preprocess(p) for p in [image, *crops]])
    assert torch.equal(pixels, ref["pixel_values"])
    text = "w40 <start_of_image> w41"
    want = hf(images=[image], text=[text], return_tensors="pt", **kw)["input_ids"][0].tolist()
    ids, images = VisionPrompts(vision, 256).prompt(text, Tokenizer.from_dir(d), [image])
    assert [SOFT if t >= 256 else t for t in ids] == want and len(images) == 1 + len(crops)
