"""Gemma 3 images end to end on CPU, against transformers' Gemma3ForConditionalGeneration given the same token ids
and token_type_ids: a prompt's image tokens attend to the whole image (both ways, within the sliding window on
local layers) while everything else stays causal. float32: max |Δlogit| ≤ 1e-4 · max |logit|; greedy replies
equal, also when the prefill is chunked smaller than the image (the chunk is stretched over it)."""
import io

import pytest
import torch

from test_vision import _noise
from test_vision_chat import set_template
from test_vision_gemma3 import BOI, SOFT, TOKENS, _config, _randomize, _save_processor

from exl2.config import EngineConfig, SamplingSettings
from exl2.engine import Engine
from exl2.generation.dynamic import DynamicGenerator, Job
from exl2.generation.images import image_limits, split
from exl2.runtime.paged_cache import paged_cache_for

GREEDY = SamplingSettings(temperature=0)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}w30 {% if m.content is string %}{{ m.content }} {% else %}"
            "{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }} {% else %}<start_of_image> {% endif %}"
            "{% endfor %}{% endif %}w31 {% endfor %}{% if add_generation_prompt %}w32{% endif %}")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Two text layers, the first sliding with a window of 8 (shorter than the image's 16 tokens), untied head."""
    from transformers import Gemma3ForConditionalGeneration

    out = tmp_path_factory.mktemp("gemma3_chat")
    config = _config()
    text = config.text_config
    text.num_hidden_layers, text.sliding_window = 2, 8
    text.layer_types = ["sliding_attention", "full_attention"]
    config.tie_word_embeddings = False
    model = Gemma3ForConditionalGeneration._from_config(config, attn_implementation="eager", dtype=torch.float32)
    _randomize(model, seed=2)
    model.eval()
    model.save_pretrained(out)
    _save_processor(out)
    set_template(out, TEMPLATE)
    return out, model


@pytest.fixture(scope="module")
def engine(built):
    return Engine(EngineConfig(model_dir=built[0], device="cpu", max_seq_len=512, vision=True))


def _messages(image):
    return [{"role": "user", "content": [{"type": "text", "text": "w40 w41"}, {"type": "image", "image": image},
                                         {"type": "text", "text": "w42"}]}]


def _hf_inputs(built, ids, vocab, image):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    hf_ids = torch.tensor([[SOFT if t >= vocab else t for t in ids]])
    pixels = Gemma3ImageProcessorPil.from_pretrained(built[0])(image, return_tensors="pt")["pixel_values"]
    return dict(input_ids=hf_ids, pixel_values=pixels, token_type_ids=(hf_ids == SOFT).long())


def test_image_tokens_see_their_whole_image(built, engine):
    hf = built[1]
    image = _noise(45, 70, seed=5)
    ids, images = engine.chat_input(_messages(image))
    vocab = engine.model.spec.vocab_size
    assert engine.model.spec.image_blocks and sum(t >= vocab for t in ids) == TOKENS and BOI in ids
    with torch.no_grad():
        ref = hf(**_hf_inputs(built, ids, vocab, image)).logits.float()
        plain, inject = split([ids], [images], vocab, engine.model.device)
        pages = -(-len(ids) // 16)
        cache = paged_cache_for(engine.model, pages + 1, 16)

        def ours(limits):
            cache.bind(torch.arange(pages, dtype=torch.int32)[None])
            cache.limits = limits
            return engine.model(torch.tensor(plain), cache, 0, inject=inject)

        both_ways = ours(image_limits([ids], [0], vocab, engine.model.device))
        causal = ours(None)
    tol = 1e-4 * ref.abs().max().item()
    assert (both_ways - ref).abs().max().item() <= tol
    assert (causal - ref).abs().max().item() > 100 * tol    # causal attention inside the image is not Gemma 3's


def test_greedy_replies_match_whole_and_chunked(built, engine):
    """The reply after an image, as transformers decodes it; a generator whose prefill chunk (8) is shorter than
    the image stretches that chunk over it and replies the same."""
    hf = built[1]
    image = _noise(100, 33, seed=6)
    ids, images = engine.chat_input(_messages(image))
    vocab = engine.model.spec.vocab_size
    seq = list(ids)
    with torch.no_grad():
        for _ in range(8):
            inputs = _hf_inputs(built, seq, vocab, image)
            seq.append(int(hf(**inputs).logits[0, -1].argmax()))
    want = seq[len(ids):]
    assert engine.chat(_messages(image), GREEDY, 8).token_ids == want
    small = DynamicGenerator(engine.model, engine.tokenizer, 512, page_size=4, chunk=8)
    job = Job(ids, GREEDY, 8)
    job.images = images
    assert small.generate([job])[0].token_ids == want


def test_the_chat_console_reads_images_as_the_engine(built, engine, tmp_path, monkeypatch, capsys):
    """`exl2 chat --vision` builds Gemma 3's image prompt as the engine does, newlines around the image included:
    the same greedy reply."""
    from exl2.cli import main

    path = tmp_path / "picture.png"
    _noise(45, 70, seed=9).save(path)
    want = engine.chat([{"role": "user", "content": [{"type": "image", "image": str(path)},
                                                     {"type": "text", "text": "w40 w41"}]}], GREEDY, 8)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/image {path}\nw40 w41\n"))
    args = ["chat", "-m", str(built[0]), "--device", "cpu", "--temperature", "0", "-maxr", "8", "-l", "512"]
    assert main.main([*args, "--vision"]) == 0
    assert capsys.readouterr().out.strip() == want.text.strip()


def test_pan_and_scan_prompts_match_transformers(built):
    """EngineConfig(pan_and_scan=True): a 3:1 image is read whole and as 3 crops (transformers' processor with
    do_pan_and_scan gives the same pixels for the model), each crop's tokens attending to their own crop; the
    logits are transformers'. A model without Gemma 3's tower refuses the setting in one sentence."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    hf = built[1]
    engine = Engine(EngineConfig(model_dir=built[0], device="cpu", max_seq_len=512, vision=True, pan_and_scan=True))
    image = _noise(900, 300, seed=14)
    ids, images = engine.chat_input(_messages(image))
    vocab = engine.model.spec.vocab_size
    assert len(images) == 4 and sum(t >= vocab for t in ids) == 4 * TOKENS and ids.count(BOI) == 4
    pixels = Gemma3ImageProcessorPil.from_pretrained(built[0])(
        image, return_tensors="pt", do_pan_and_scan=True, pan_and_scan_min_crop_size=256,
        pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2)["pixel_values"]
    hf_ids = torch.tensor([[SOFT if t >= vocab else t for t in ids]])
    with torch.no_grad():
        ref = hf(input_ids=hf_ids, pixel_values=pixels, token_type_ids=(hf_ids == SOFT).long()).logits.float()
        plain, inject = split([ids], [images], vocab, engine.model.device)
        pages = -(-len(ids) // 16)
        cache = paged_cache_for(engine.model, pages + 1, 16)
        cache.bind(torch.arange(pages, dtype=torch.int32)[None])
        cache.limits = image_limits([ids], [0], vocab, engine.model.device)
        ours = engine.model(torch.tensor(plain), cache, 0, inject=inject)
    assert (ours - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_pan_and_scan_needs_gemma3(tmp_path):
    from exl2.errors import ConfigError
    from exl2.generation.multimodal import VisionPrompts
    from test_vision_qwen2vl import _build, _qwen2_vl_config

    _build(_qwen2_vl_config(), tmp_path, seed=1)
    model = type("M", (), {"device": torch.device("cpu"), "dtype": torch.float32,
                           "spec": type("S", (), {"vocab_size": 256})()})()
    with pytest.raises(ConfigError, match="Pan-and-scan is Gemma 3's"):
        VisionPrompts.load(tmp_path, model, pan_and_scan=True)
