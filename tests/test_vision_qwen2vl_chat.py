"""Qwen2-VL / Qwen2.5-VL images end to end on CPU, against transformers' models given the same token ids, pixels and
image grids: image tokens rotate by their (t, h, w) places (M-RoPE), and the text after an image goes on from the
image's start plus max(h, w), not from its token count. float32: max |Δlogit| ≤ 1e-4 · max |logit|; greedy replies
equal, with the prefill chunked smaller than the image, and batched beside a text-only prompt (rows with and
without a RoPE shift in one decode step)."""
import pytest
import torch

from test_vision import _noise
from test_vision_chat import set_template
from test_vision_qwen2vl import END, PAD, START, _build, _qwen2_5_vl_config, _qwen2_vl_config

from exl2.config import EngineConfig, SamplingSettings
from exl2.engine import Engine
from exl2.generation.dynamic import DynamicGenerator, Job
from exl2.generation.images import mrope_positions, split
from exl2.runtime.paged_cache import paged_cache_for

GREEDY = SamplingSettings(temperature=0)
TEMPLATE = ("{% for m in messages %}w30 {% if m.content is string %}{{ m.content }} {% else %}"
            "{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }} {% else %}"
            "<|vision_start|> <|image_pad|> <|vision_end|> {% endif %}{% endfor %}{% endif %}w31 {% endfor %}"
            "{% if add_generation_prompt %}w32{% endif %}")


def _save_tokenizer(out, extra_special: dict[int, str] | None = None, words: dict[int, str] | None = None) -> None:
    """Word-level, with Qwen's vision tokens at the tiny configs' ids (and `extra_special` ones, e.g. the video
    pad), `words` in place of some of the plain ones."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {0: "<unk>", 1: "<|im_end|>", START: "<|vision_start|>", END: "<|vision_end|>", PAD: "<|image_pad|>",
               **(extra_special or {})}
    named = {**special, **(words or {})}
    tok = Tokenizer(models.WordLevel({named.get(i, f"w{i}"): i for i in range(256)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = [special[i] for i in (START, END, PAD, *(extra_special or {}))]
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                            additional_special_tokens=extra).save_pretrained(out)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def built(request, tmp_path_factory):
    """Two text layers; Qwen2.5-VL's tower with 2×2-merged-patch windows."""
    out = tmp_path_factory.mktemp(request.param + "_chat")
    config = _qwen2_vl_config() if request.param == "qwen2_vl" else _qwen2_5_vl_config()
    config.text_config.num_hidden_layers, config.text_config.layer_types = 2, ["full_attention"] * 2
    return out, chat_model(config, out, _build, seed=3)


def chat_model(config, out, build, seed: int):
    """The tiny model `config` built by `build` (its test file's, which saves its image processor) in `out`, with
    the word-level tokenizer and TEMPLATE."""
    model = build(config, out, seed=seed)
    _save_tokenizer(out)
    set_template(out, TEMPLATE)
    return model


@pytest.fixture(scope="module")
def engine(built):
    return Engine(EngineConfig(model_dir=built[0], device="cpu", max_seq_len=512, vision=True))


def _messages(image, text="w42"):
    return [{"role": "user", "content": [{"type": "text", "text": "w40 w41"}, {"type": "image", "image": image},
                                         {"type": "text", "text": text}]}]


def _hf_inputs(model_dir, ids, vocab, image) -> dict:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf_ids = torch.tensor([[PAD if t >= vocab else t for t in ids]])
    pixels = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(image, return_tensors="pt")
    return dict(input_ids=hf_ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                mm_token_type_ids=(hf_ids == PAD).int())


def _hf_greedy(built, ids, vocab, image, steps: int) -> tuple[list[int], list[float]]:
    """transformers' greedy reply and each token's log-probability."""
    seq, logprobs = list(ids), []
    with torch.no_grad():
        for _ in range(steps):
            inputs = {"input_ids": torch.tensor([seq])} if image is None else _hf_inputs(built[0], seq, vocab, image)
            scores = built[1](**inputs).logits[0, -1].float().log_softmax(-1)
            seq.append(int(scores.argmax()))
            logprobs.append(float(scores.max()))
    return seq[len(ids):], logprobs


def _assert_reply(result, want: tuple[list[int], list[float]]) -> None:
    """Same tokens, and log-probabilities within 1e-4: greedy tokens alone can survive a wrong position."""
    assert result.token_ids == want[0]
    assert max(abs(r.logprob - w) for r, w in zip(result.logprobs, want[1])) <= 1e-4


def test_image_tokens_rotate_by_their_place(built, engine):
    image = _noise(150, 90, seed=5)      # 3 × 5 merged patches: the text after it starts 5 positions on, not 15
    ids, images = engine.chat_input(_messages(image))
    vocab = engine.model.spec.vocab_size
    assert images[0].grid == (1, 3, 5) and sum(t >= vocab for t in ids) == 15
    assert ids[ids.index(START) + 16] == END
    positions, shift = mrope_positions(ids, images, vocab)
    assert shift == 5 - 15
    with torch.no_grad():
        ref = built[1](**_hf_inputs(built[0], ids, vocab, image)).logits.float()
        plain, inject = split([ids], [images], vocab, engine.model.device)
        pages = -(-len(ids) // 16)
        cache = paged_cache_for(engine.model, pages + 1, 16)

        def ours(**kw):
            cache.bind(torch.arange(pages, dtype=torch.int32)[None])
            return engine.model(torch.tensor(plain), cache, 0, inject=inject, **kw)

        placed = ours(mrope=positions[:, None])
        in_line = ours()
    tol = 1e-4 * ref.abs().max().item()
    assert (placed - ref).abs().max().item() <= tol
    assert (in_line - ref).abs().max().item() > 100 * tol    # positions in a line are not Qwen2-VL's


def test_greedy_replies_whole_chunked_and_batched(built, engine):
    """The reply after an image, as transformers decodes it (every decode step shifted back by the image), beside
    a text-only prompt in the same decode steps (rows with and without a shift), also with a prefill chunk (8)
    shorter than the image."""
    image = _noise(120, 110, seed=6)
    ids, images = engine.chat_input(_messages(image))
    vocab = engine.model.spec.vocab_size
    assert mrope_positions(ids, images, vocab)[1] < 0
    want = _hf_greedy(built, ids, vocab, image, 8)
    assert engine.chat(_messages(image), GREEDY, 8).token_ids == want[0]
    text_ids = engine.tokenizer.encode("w30 w40 w41 w42 w43 w31 w32", add_bos=False)
    generators = (DynamicGenerator(engine.model, engine.tokenizer, 512),
                  DynamicGenerator(engine.model, engine.tokenizer, 512, page_size=4, chunk=8))
    for generator in generators:
        job, text_job = Job(ids, GREEDY, 8, logprobs=0), Job(text_ids, GREEDY, 8, logprobs=0)
        job.images = images
        out = generator.generate([job, text_job])
        _assert_reply(out[0], want)
        _assert_reply(out[1], _hf_greedy(built, text_ids, vocab, None, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_images_on_the_gpu_match_transformers(tmp_path):
    """fp16 on CUDA (the tower, M-RoPE rows in the prefill's RoPE-and-cache-write kernel, decode graphs fed each
    row's shift; head_dim 64, which the GPU attention kernels take) against transformers in float32 on the CPU:
    prompt logits within 2 % of their largest, the same greedy reply for at least its first 6 of 8 tokens (fp16
    may round a near-tie the other way) and their log-probabilities within 0.05."""
    from transformers import Qwen2_5_VLConfig

    text = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=256, bos_token_id=1, eos_token_id=1,
                layer_types=["full_attention"] * 2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]})
    vision = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=96, out_hidden_size=128, window_size=56,
                  fullatt_block_indexes=[1], hidden_act="silu")
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=PAD, video_token_id=8,
                              vision_start_token_id=START, vision_end_token_id=END)
    assert_gpu_matches(config, tmp_path, _noise(120, 110, seed=12), _build)


def assert_gpu_matches(config, model_dir, image, build, deep: int = 0) -> None:
    """The tiny model `config` saved in `model_dir` (`build`: its test file's, with its image processor), in fp16
    on CUDA against transformers in float32 on the CPU (an image whose M-RoPE shift is negative, with `deep`
    DeepStack levels): prompt logits within 2 % of their largest, the same greedy reply for at least its first 6 of
    8 tokens and their log-probabilities within 0.05."""
    hf = chat_model(config, model_dir, build, seed=4)
    gpu = Engine(EngineConfig(model_dir=model_dir, device="cuda", max_seq_len=512, vision=True))
    ids, images = gpu.chat_input(_messages(image))
    vocab = gpu.model.spec.vocab_size
    positions, shift = mrope_positions(ids, images, vocab)
    assert shift < 0 and len(images[0].deep) == deep
    with torch.no_grad():
        ref = hf(**_hf_inputs(model_dir, ids, vocab, image)).logits.float()
        plain, inject = split([ids], [images], vocab, gpu.model.device)
        pages = -(-len(ids) // 16)
        cache = paged_cache_for(gpu.model, pages + 1, 16)
        cache.bind(torch.arange(pages, dtype=torch.int32, device="cuda")[None])
        ours = gpu.model(torch.tensor(plain, device="cuda"), cache, 0, inject=inject,
                         mrope=positions[:, None].cuda()).float().cpu()
    assert (ours - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    want = _hf_greedy((model_dir, hf), ids, vocab, image, 8)
    job = Job(ids, GREEDY, 8, logprobs=0)
    job.images = images
    generator = DynamicGenerator(gpu.model, gpu.tokenizer, 512)
    assert generator.graphs is not None and generator.graphs.shifted
    got = generator.generate([job])[0]
    agree = next((i for i, (a, b) in enumerate(zip(got.token_ids, want[0])) if a != b), 8)
    assert agree >= 6     # the steps before the first disagreement saw the same text
    assert max(abs(r.logprob - w) for r, w in zip(got.logprobs[:agree], want[1][:agree])) <= 0.05


def test_converted_model_keeps_its_tower(built, tmp_path):
    """exl2 convert quantizes the text decoder (q/k/v biases and all) and carries the tower's tensors over, so the
    EXL2 model reads images with the same features as its source."""
    from exl2.models.vision import load_vision
    from exl2.quantize import pipeline
    from exl2.quantize.progress import Reporter

    out = tmp_path / "out"
    pipeline.convert(pipeline.ConvertSettings(in_dir=str(built[0]), out_dir=str(tmp_path / "work"),
                                              compile_full=str(out), bits=4.0, rows=4, length=64, measurement_rows=4,
                                              measurement_length=64), Reporter(quiet=True))
    image = _noise(120, 110, seed=8)
    source, converted = (load_vision(d, "cpu", torch.float32).encode(image) for d in (built[0], out))
    assert torch.allclose(source.features, converted.features, rtol=1e-3, atol=1e-3)
    assert source.grid == converted.grid and source.token_ids == converted.token_ids
    engine = Engine(EngineConfig(model_dir=out, device="cpu", max_seq_len=512, vision=True))
    assert engine.model.layers[0].self_attn.q_proj.info["format"] == "exl2"
    assert len(engine.chat(_messages(image), GREEDY, 4).token_ids) == 4
