"""Qwen3-VL (dense and MoE) images end to end on CPU, against transformers given the same token ids, pixels and
image grids: image tokens rotate by their interleaved (t, h, w) M-RoPE places, the tower's DeepStack rows are added
to their hidden states after the first decoder layers, and the text after an image goes on from its start plus
max(h, w). float32: max |Δlogit| ≤ 1e-4 · max |logit|; greedy replies and their log-probabilities equal, with the
prefill chunked smaller than the image and beside a text-only prompt."""
import pytest
import torch

from test_vision import _noise
from test_vision_qwen2vl import PAD
from test_vision_qwen2vl_chat import _assert_reply, _hf_greedy, _messages, chat_model
from test_vision_qwen3vl import _build, _qwen3_vl_config, _qwen3_vl_moe_config

from exl2.config import EngineConfig, SamplingSettings
from exl2.engine import Engine
from exl2.generation.dynamic import DynamicGenerator, Job
from exl2.generation.images import mrope_positions, split
from exl2.runtime.paged_cache import paged_cache_for

GREEDY = SamplingSettings(temperature=0)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def built(request, tmp_path_factory):
    """Two text layers, each followed by a DeepStack level."""
    out = tmp_path_factory.mktemp(request.param + "_chat")
    config = _qwen3_vl_config() if request.param == "qwen3_vl" else _qwen3_vl_moe_config()
    config.text_config.num_hidden_layers, config.text_config.layer_types = 2, ["full_attention"] * 2
    return out, chat_model(config, out, _build, seed=5)


@pytest.fixture(scope="module")
def engine(built):
    return Engine(EngineConfig(model_dir=built[0], device="cpu", max_seq_len=512, vision=True))


def test_image_tokens_take_their_place_and_deepstack(built, engine):
    from test_vision_qwen2vl_chat import _hf_inputs

    image = _noise(150, 90, seed=5)
    ids, images = engine.chat_input(_messages(image))
    vocab = engine.model.spec.vocab_size
    assert engine.model.spec.mrope_interleaved and len(images[0].deep) == 2
    positions, shift = mrope_positions(ids, images, vocab)
    assert shift < 0
    with torch.no_grad():
        ref = built[1](**_hf_inputs(built[0], ids, vocab, image)).logits.float()
        plain, inject = split([ids], [images], vocab, engine.model.device)
        assert len(inject) == 3
        pages = -(-len(ids) // 16)
        cache = paged_cache_for(engine.model, pages + 1, 16)

        def ours(inject, **kw):
            cache.bind(torch.arange(pages, dtype=torch.int32)[None])
            return engine.model(torch.tensor(plain), cache, 0, inject=inject, **kw)

        placed = ours(inject, mrope=positions[:, None])
        shallow = ours(inject[:2], mrope=positions[:, None])
        in_line = ours(inject)
    tol = 1e-4 * ref.abs().max().item()
    assert (placed - ref).abs().max().item() <= tol
    assert (shallow - ref).abs().max().item() > 100 * tol   # without the DeepStack rows
    assert (in_line - ref).abs().max().item() > 100 * tol   # positions in a line


def test_greedy_replies_whole_chunked_and_batched(built, engine):
    image = _noise(120, 110, seed=6)
    ids, images = engine.chat_input(_messages(image))
    vocab = engine.model.spec.vocab_size
    want = _hf_greedy(built, ids, vocab, image, 8)
    assert engine.chat(_messages(image), GREEDY, 8).token_ids == want[0]
    text_ids = engine.tokenizer.encode("w30 w40 w41 w42 w43 w31 w32", add_bos=False)
    text_want = _hf_greedy(built, text_ids, vocab, None, 8)
    for generator in (DynamicGenerator(engine.model, engine.tokenizer, 512),
                      DynamicGenerator(engine.model, engine.tokenizer, 512, page_size=4, chunk=8)):
        job, text_job = Job(ids, GREEDY, 8, logprobs=0), Job(text_ids, GREEDY, 8, logprobs=0)
        job.images = images
        out = generator.generate([job, text_job])
        _assert_reply(out[0], want)
        _assert_reply(out[1], text_want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_images_on_the_gpu_match_transformers(tmp_path):
    """fp16 on CUDA (the tower, interleaved M-RoPE rows and DeepStack rows in the prefill, decode graphs fed each
    row's shift; head_dim 64) against transformers in float32 on the CPU: prompt logits within 2 % of their
    largest, the same greedy reply for at least its first 6 of 8 tokens and their log-probabilities within 0.05."""
    from transformers import Qwen3VLConfig

    from test_vision_qwen2vl import END, START
    from test_vision_qwen2vl_chat import assert_gpu_matches

    text = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, head_dim=64,
                num_key_value_heads=1, vocab_size=256, bos_token_id=1, eos_token_id=1,
                layer_types=["full_attention"] * 2,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [12, 10, 10],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=96, out_hidden_size=128,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=PAD, video_token_id=8,
                           vision_start_token_id=START, vision_end_token_id=END)
    assert_gpu_matches(config, tmp_path, _noise(150, 90, seed=12), _build, deep=2)
