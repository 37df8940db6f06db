"""Images in chat prompts, end to end on CPU: the tiny random Mistral 3 of test_vision.py (Pixtral tower,
projector, Mistral decoder, word-level tokenizer) against transformers' Mistral3ForConditionalGeneration. The
prompt's image tokens become alias ids (generation.images) whose embeddings the prefill injects; logits and greedy
replies must be transformers' (float32: max |Δlogit| ≤ 1e-4 · max |logit|), the prompt cache must tell images apart
and reuse the same image's pages, and the OpenAI server must take image_url parts."""
import asyncio
import base64
import io
import json

import pytest
import torch

from test_vision import IMG, MERGE, PATCH, _build, _hf_pixels, _mistral3_config, _noise

from exl2.config import EngineConfig, SamplingSettings
from exl2.engine import Engine
from exl2.errors import ConfigError
from exl2.generation.dynamic import DynamicGenerator, Job
from exl2.generation.images import split

GREEDY = SamplingSettings(temperature=0)
# renders text parts as their words and each image part as one [IMG], which the engine expands
TEMPLATE = ("{{ bos_token }}{% for m in messages %}w3 {% if m.content is string %}{{ m.content }} {% else %}"
            "{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }} {% else %}[IMG] {% endif %}{% endfor %}"
            "{% endif %}w4 {% endfor %}{% if add_generation_prompt %}w5{% endif %}")


def set_template(model_dir, template: str = TEMPLATE) -> None:
    """Give a tiny model's tokenizer_config.json a chat template."""
    path = model_dir / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": template}))


def _built(config, out, seed: int):
    """The tiny model `config` describes, saved with its processor, tokenizer and TEMPLATE."""
    config.tie_word_embeddings = False    # as the published Mistral Small 3.1/3.2: lm_head in the files
    model = _build(config, out, seed=seed)
    set_template(out)
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("mistral3_chat")
    return out, _built(_mistral3_config(), out, seed=3)


@pytest.fixture(scope="module")
def engine(built):
    return Engine(EngineConfig(model_dir=built[0], device="cpu", max_seq_len=512, vision=True))


def _messages(image, text="w30 w31"):
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image", "image": image},
                                         {"type": "text", "text": "w40"}]}]


def _hf_ids(ids: list[int], vocab: int) -> torch.Tensor:
    return torch.tensor([[IMG if t >= vocab else t for t in ids]])


def test_logits_and_greedy_reply_are_transformers(built, engine):
    d, hf = built
    image = _noise(45, 70, seed=5)
    ids, images = engine.chat_input(_messages(image))
    vocab = engine.model.spec.vocab_size
    assert len(images) == 1 and sum(t >= vocab for t in ids) == images[0].features.shape[0] > 4
    pixels, sizes = _hf_pixels(d, image, PATCH * MERGE)
    with torch.no_grad():
        ref = hf(input_ids=_hf_ids(ids, vocab), pixel_values=pixels, image_sizes=sizes).logits.float()
        plain, inject = split([ids], [images], vocab, engine.model.device)
        ours = engine.model(torch.tensor(plain), inject=inject)
    assert (ours - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    with torch.no_grad():   # without the image's embeddings the logits are not the same: the test can fail
        assert (engine.model(torch.tensor(plain)) - ref).abs().max().item() > 1e-2 * ref.abs().max().item()

    seq = list(ids)
    with torch.no_grad():
        for _ in range(8):
            logits = hf(input_ids=_hf_ids(seq, vocab), pixel_values=pixels, image_sizes=sizes).logits
            seq.append(int(logits[0, -1].argmax()))
    assert engine.chat(_messages(image), GREEDY, 8).token_ids == seq[len(ids):]


def test_pixtral_12b_layout_is_transformers(tmp_path):
    """Pixtral-12B (LlavaForConditionalGeneration: a Pixtral tower, no patch merger, a two-layer projector, a
    Mistral decoder) loads as text plus vision, with transformers' logits for a prompt with an image."""
    from test_vision import _llava_config

    hf = _built(_llava_config(), tmp_path, seed=5)
    pixtral = Engine(EngineConfig(model_dir=tmp_path, device="cpu", max_seq_len=512, vision=True))
    image = _noise(50, 40, seed=13)
    ids, images = pixtral.chat_input(_messages(image))
    vocab = pixtral.model.spec.vocab_size
    pixels, sizes = _hf_pixels(tmp_path, image, PATCH)
    with torch.no_grad():
        ref = hf(input_ids=_hf_ids(ids, vocab), pixel_values=pixels, image_sizes=sizes).logits.float()
        plain, inject = split([ids], [images], vocab, pixtral.model.device)
        ours = pixtral.model(torch.tensor(plain), inject=inject)
    assert (ours - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_the_prompt_cache_tells_images_apart(built, engine):
    """Same text, two images: different alias ids, so the second prompt reuses only the pages before the image;
    the first image again: its aliases are the same and its pages are reused, with the same reply."""
    gen = DynamicGenerator(engine.model, engine.tokenizer, 512, page_size=4)
    a, b = _noise(45, 70, seed=5), _noise(45, 70, seed=6)
    first, first_images = engine.chat_input(_messages(a))
    other, other_images = engine.chat_input(_messages(b))
    again, again_images = engine.chat_input(_messages(a))
    assert again == first and other != first and again_images[0] is first_images[0]

    def run(ids, images):
        job = Job(ids, GREEDY, 6)
        job.images = images
        return gen.generate([job])[0]

    r1, r2, r3 = run(first, first_images), run(other, other_images), run(again, again_images)
    start = next(i for i, t in enumerate(first) if t >= engine.model.spec.vocab_size)
    assert r2.cached_tokens <= start and r3.cached_tokens >= len(first) - 4
    assert r3.token_ids == r1.token_ids == engine.chat(_messages(a), GREEDY, 6).token_ids
    assert r2.token_ids == engine.chat(_messages(b), GREEDY, 6).token_ids


def test_a_draft_model_leaves_prompts_with_images_alone(engine):
    """A draft model cannot read image tokens: a job with an image checks no draft model guesses (n-gram guesses
    it may), and its reply is plain decoding's."""
    from exl2.generation.speculative import ModelDraft, NgramDraft

    ids, images = engine.chat_input(_messages(_noise(45, 70, seed=5)))

    def reply(draft):
        gen = DynamicGenerator(engine.model, engine.tokenizer, 512, page_size=16, draft=draft, adaptive_draft=False)
        job = Job(ids, GREEDY, 12)
        job.images = images
        return gen.generate([job])[0].token_ids, job.drafted

    plain, _ = reply(None)
    assert reply(ModelDraft(engine.model, 600, page_size=16)) == (plain, 0)
    assert reply(NgramDraft())[0] == plain


def test_image_errors_are_one_sentence(built, engine, tmp_path):
    with pytest.raises(ConfigError, match="neither a data URI"):
        engine.chat_input(_messages(str(tmp_path / "missing.png")))
    text_only = Engine(EngineConfig(model_dir=built[0], device="cpu", max_seq_len=512))
    with pytest.raises(ConfigError, match="without its vision tower"):
        text_only.chat_input(_messages(_noise(30, 30)))
    assert text_only.chat_input([{"role": "user", "content": "w30"}])[1] == ()


def _data_uri(image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def test_the_server_takes_image_url_parts(built, engine):
    import openai   # here, not at the top: the GPU machine that runs this file's GPU test has no openai

    from exl2.server.app import ServerConfig, create_app

    image = _noise(100, 33, seed=7)
    want = engine.chat(_messages(image), GREEDY, 6)
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="k", max_retries=0,
                                http_client=_asgi(create_app(engine, ServerConfig(model_name="tiny"))))
    parts = [{"type": "text", "text": "w30 w31"}, {"type": "image_url", "image_url": {"url": _data_uri(image)}},
             {"type": "text", "text": "w40"}]

    async def go():
        r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                                 max_tokens=6, temperature=0)
        bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}]
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": bad}],
                                                 max_tokens=2)
        return r, e.value, (await client.get("/model", cast_to=object))["parameters"]

    r, err, parameters = asyncio.run(go())
    assert parameters["use_vision"] is True      # TabbyAPI's model card says whether images are read
    assert r.choices[0].message.content == want.text and r.usage.prompt_tokens == want.prompt_tokens
    assert "base64" in err.body["message"]


def _asgi(app):
    import httpx

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_the_chat_console_attaches_images(built, engine, tmp_path, monkeypatch, capsys):
    """`exl2 chat --vision`: /image FILE puts the picture before the next message, whose reply is the engine's for
    the same messages; later turns send it again (under the same ids); a missing file or
    /image without --vision is one error line and the session goes on."""
    from exl2.cli import main

    path = tmp_path / "picture.png"
    _noise(45, 70, seed=9).save(path)
    want = engine.chat([{"role": "user", "content": [{"type": "image", "image": str(path)},
                                                     {"type": "text", "text": "w30 w31"}]}], GREEDY, 6)
    stdin = f"/image {tmp_path / 'nothing.png'}\n/image {path}\nw30 w31\nw40\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    args = ["chat", "-m", str(built[0]), "--device", "cpu", "--temperature", "0", "-maxr", "6", "-l", "512"]
    assert main.main([*args, "--vision"]) == 0
    out, err = capsys.readouterr()
    replies = [r for r in out.split("\n\n") if r.strip()]
    assert replies[0].strip() == want.text.strip() and len(replies) == 2
    assert "nothing.png" in err and "Traceback" not in err
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/image {path}\nw30\n"))
    assert main.main(args) == 0
    assert "start exl2 chat with --vision" in capsys.readouterr().err


def test_the_mcp_chat_tool_takes_images(engine):
    """The MCP chat tool's `images` go before the last user message's text: the reply is Engine.chat's for those
    messages; images with a last message that is not the user's are a tool error."""
    from fastmcp import Client
    from fastmcp.exceptions import ToolError

    from exl2.mcp.server import build_server

    image = _noise(60, 40, seed=11)
    want = engine.chat([{"role": "user", "content": [{"type": "image", "image": image},
                                                     {"type": "text", "text": "w30"}]}], GREEDY, 6)

    async def go():
        async with Client(build_server(engine)) as client:
            out = await client.call_tool("chat", {"messages": [{"role": "user", "content": "w30"}],
                                                  "images": [_data_uri(image)], "max_tokens": 6, "temperature": 0})
            with pytest.raises(ToolError, match="last message"):
                await client.call_tool("chat", {"messages": [{"role": "assistant", "content": "w30"}],
                                                "images": [_data_uri(image)], "max_tokens": 2})
            return out

    out = asyncio.run(go())
    assert out.structured_content["text"] == want.text
    assert out.structured_content["prompt_tokens"] == want.prompt_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_images_on_the_gpu_match_transformers(tmp_path):
    """fp16 on CUDA (vision tower, the prefill's injected rows, the Triton kernels; head_dim 64, which the GPU
    attention kernels take) against transformers in float32 on the CPU: logits within 2 % of their largest, and the
    same greedy reply for at least 6 of 8 tokens (fp16 may round a near-tie the other way)."""
    from transformers import Mistral3Config, MistralConfig

    from test_vision import _vision_config

    text = MistralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=64, vocab_size=256, rms_norm_eps=1e-5, sliding_window=None)
    config = Mistral3Config(text_config=text, vision_config=_vision_config(), image_token_index=IMG,
                            spatial_merge_size=MERGE, multimodal_projector_bias=True)
    hf = _built(config, tmp_path, seed=4)
    gpu = Engine(EngineConfig(model_dir=tmp_path, device="cuda", max_seq_len=512, vision=True))
    image = _noise(100, 33, seed=12)
    ids, images = gpu.chat_input(_messages(image))
    vocab = gpu.model.spec.vocab_size
    pixels, sizes = _hf_pixels(tmp_path, image, PATCH * MERGE)
    with torch.no_grad():
        ref = hf(input_ids=_hf_ids(ids, vocab), pixel_values=pixels, image_sizes=sizes).logits.float()
        plain, inject = split([ids], [images], vocab, gpu.model.device)
        ours = gpu.model(torch.tensor(plain, device="cuda"), inject=inject).float().cpu()
    assert (ours - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    seq = list(ids)
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(hf(input_ids=_hf_ids(seq, vocab), pixel_values=pixels, image_sizes=sizes).logits[0, -1]
                           .argmax()))
    got = gpu.chat(_messages(image), GREEDY, 8).token_ids
    assert sum(a == b for a, b in zip(got, seq[len(ids):])) >= 6


def test_other_llava_models_are_refused_in_one_sentence():
    from exl2.models.registry import spec_from_config

    cfg = {"architectures": ["LlavaForConditionalGeneration"], "vision_config": {"model_type": "clip_vision_model"},
           "text_config": {"model_type": "llama", "hidden_size": 64}}
    with pytest.raises(ConfigError, match="Pixtral vision tower on a Mistral text model"):
        spec_from_config(cfg)


def test_image_blocks_stay_whole_and_see_themselves():
    """Gemma 3's rule, in the helpers the generator uses: a prefill chunk never ends inside an image's run of
    aliases (cut back before it, or stretched over it when it starts the chunk), and each image token's last
    visible key is its run's last; the attention mask then lets it see its image and nothing past it."""
    from exl2.generation.images import image_limits, image_runs, whole_images
    from exl2.models.layers import attention_mask

    V = 100
    ids = [1, 2, 100, 101, 102, 103, 5, 6, 104, 105, 7]   # two runs (one image's rows, split by break token 5, 6)
    assert image_runs(ids, V) == [(2, 6), (8, 10)]
    assert whole_images(ids, 0, 4, V) == 2          # ends inside the first run: cut back to where it begins
    assert whole_images(ids, 2, 2, V) == 4          # the run begins the chunk: stretched to its end
    assert whole_images(ids, 0, 7, V) == 7 and whole_images(ids, 0, 11, V) == 11
    limits = image_limits([ids[2:]], [2], V, torch.device("cpu"))
    assert limits[0].tolist() == [5, 5, 5, 5, 6, 7, 9, 9, 10]
    assert image_limits([[1, 2, 3]], [0], V, torch.device("cpu")) is None
    q_pos = torch.arange(2, 11)[None]
    mask = attention_mask(q_pos, 11, limit=limits)[0]
    assert mask[0, :6].all() and not mask[0, 6:].any()        # the first image token sees its whole run
    assert mask[4, :7].all() and not mask[4, 7:].any()        # a text token after it: causal
    windowed = attention_mask(q_pos, 11, window=2, limit=limits)[0, 0]   # the window still cuts the past off
    assert windowed.tolist() == [False, True, True, True, True, True] + [False] * 5
