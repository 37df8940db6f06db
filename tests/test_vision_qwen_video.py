"""Videos for the Qwen vision models (Qwen2-VL, Qwen2.5-VL with windows, Qwen3-VL with DeepStack) against
transformers 5 on CPU: patches equal Qwen3VLVideoProcessor.patchify's, frame sampling and Qwen3-VL's sizes and
timestamps equal its video processor's and processor's, the tower's features equal get_video_features', and whole
prompts (token layout, M-RoPE time positions, Qwen3-VL's per-frame timestamps) give transformers' logits (max |Δ| ≤
1e-4 · max |logit|) and greedy replies. Transformers 5.17 places the text after a video max(h, w) on, where the
Qwen releases place it one past the video's largest position; the end-to-end videos are short enough that both
agree, and the rule itself is checked on its own."""
import io
import json
import types

import pytest
import torch
from test_vision import _noise
from test_vision_chat import set_template
from test_vision_qwen2vl_chat import _save_tokenizer as save_word_tokenizer
from test_vision_qwen2vl import END, PAD, START, VIDEO, _qwen2_5_vl_config, _qwen2_vl_config
from test_vision_qwen2vl import MEAN, STD
from test_vision_qwen2vl import _build as _build_qwen2
from test_vision_qwen3vl import _build as _build_qwen3
from test_vision_qwen3vl import _qwen3_vl_config

from exl2.config import EngineConfig, SamplingSettings
from exl2.engine import Engine
from exl2.errors import ConfigError
from exl2.generation.dynamic import DynamicGenerator, Job
from exl2.generation.images import ImageTokens, mrope_positions, split
from exl2.models.vision import load_vision
from exl2.models.vision.qwen_patches import patchify
from exl2.models.vision.qwen_video import QwenVideoProcessing
from exl2.models.vision.video import Video
from exl2.runtime.paged_cache import paged_cache_for

GREEDY = SamplingSettings(temperature=0)
STAMPS = {200: "<0.2", 201: "<1.2", 202: "seconds>"}    # Qwen3-VL's timestamps of FRAMES at 2 fps
TEMPLATE = ("{% for m in messages %}w30 {% if m.content is string %}{{ m.content }} {% else %}"
            "{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }} {% elif p.type == 'video' %}"
            "<|vision_start|> <|video_pad|> <|vision_end|> {% else %}<|vision_start|> <|image_pad|> <|vision_end|> "
            "{% endif %}{% endfor %}{% endif %}w31 {% endfor %}{% if add_generation_prompt %}w32{% endif %}")
# 150×90 frames become 3×5 merged patches a frame in both families (28-pixel merged patches bounded per frame;
# 32-pixel ones bounded over the four frames together)
VIDEO_CONFIGS = {
    "qwen2": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 30, "image_mean": MEAN, "image_std": STD},
    "qwen3": {"size": {"shortest_edge": 32 * 32, "longest_edge": 4 * 32 * 32 * 15}, "patch_size": 16,
              "image_mean": MEAN, "image_std": STD},
}


def _frames(count: int = 4, size=(150, 90), seed: int = 20) -> list:
    return [_noise(*size, seed=seed + i) for i in range(count)]


def _save_tokenizer(out) -> None:
    """The chat tests' word-level tokenizer, with <|video_pad|> and the timestamps' words."""
    save_word_tokenizer(out, {VIDEO: "<|video_pad|>"}, STAMPS)


FAMILIES = {"qwen2_vl": (_qwen2_vl_config, _build_qwen2, "qwen2"),
            "qwen2_5_vl": (_qwen2_5_vl_config, _build_qwen2, "qwen2"),
            "qwen3_vl": (_qwen3_vl_config, _build_qwen3, "qwen3")}


@pytest.fixture(scope="module", params=list(FAMILIES))
def built(request, tmp_path_factory):
    """Two text layers (Qwen3-VL: each followed by a DeepStack level), the video processor config, the tokenizer
    and TEMPLATE."""
    config_of, build, family = FAMILIES[request.param]
    out = tmp_path_factory.mktemp(request.param + "_video")
    config = config_of()
    config.text_config.num_hidden_layers, config.text_config.layer_types = 2, ["full_attention"] * 2
    model = build(config, out, seed=7)
    (out / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIGS[family]))
    _save_tokenizer(out)
    set_template(out, TEMPLATE)
    return request.param, out, model


@pytest.fixture(scope="module")
def engine(built):
    return Engine(EngineConfig(model_dir=built[1], device="cpu", max_seq_len=512, vision=True))


def _messages(video, text="w42"):
    return [{"role": "user", "content": [{"type": "text", "text": "w40 w41"}, {"type": "video", "video": video},
                                         {"type": "text", "text": text}]}]


def _hf_video(kind: str, model, tower, frames) -> dict:
    """The video inputs transformers' model takes, from our processor's patches (transformers resizes videos with
    torchvision, which these machines lack)."""
    video = Video(tuple(frames), None, tuple(range(len(frames))), len(frames))
    patches, grid = tower.video_processing(video)
    inputs = dict(pixel_values_videos=patches, video_grid_thw=torch.tensor([grid]))
    if kind == "qwen2_5_vl":
        inputs["second_per_grid_ts"] = torch.tensor([tower.video_processing.group_seconds(video)])
    return inputs


def _hf_inputs(kind, model, tower, ids, vocab, frames) -> dict:
    hf_ids = torch.tensor([[VIDEO if t >= vocab else t for t in ids]])
    return dict(input_ids=hf_ids, mm_token_type_ids=2 * (hf_ids == VIDEO).int(),
                **_hf_video(kind, model, tower, frames))


def test_patches_sampling_sizes_and_timestamps_match_transformers():
    """The torchvision-free parts of transformers' Qwen video processing: patchify (an odd frame count padded with
    the last frame), Qwen3-VL's frame sampling, its whole-video resize with the per-frame cap on, and its
    timestamps."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
    from transformers.video_utils import VideoMetadata

    frames = torch.randn(5, 3, 64, 96)
    ours, grid = patchify(frames, 16, 2, 2)
    ref, *ref_grid = Qwen3VLVideoProcessor.patchify(None, frames[None], 16, 2, 2)
    assert torch.equal(ours, ref[0]) and grid == tuple(ref_grid) == (3, 4, 6)

    qwen3 = QwenVideoProcessing(min_pixels=4096, max_pixels=25165824, patch=16, temporal_patch=2, merge=2,
                                whole_video=True, max_video_tokens=768, resample=3, mean=(0.5,) * 3, std=(0.5,) * 3)
    stub = types.SimpleNamespace(fps=2, min_frames=4, max_frames=768)
    for total, fps in ((300, 30.0), (7, 25.0), (5000, 24.0), (61, 29.97)):
        want = Qwen3VLVideoProcessor.sample_frames(stub, VideoMetadata(total_num_frames=total, fps=fps))
        assert qwen3.sample(total, fps) == want.tolist()
    for frames, height, width in ((20, 1080, 1920), (4, 480, 640), (300, 720, 1280), (9, 20, 500)):
        per_frame = max(min(768 * 32 * 32, qwen3.max_pixels // frames), int(qwen3.min_pixels * 1.05))
        want = smart_resize(frames, height, width, 2, 32, qwen3.min_pixels, per_frame * frames)
        assert qwen3.frame_size(frames, height, width) == want
    video = Video(tuple(_frames(5, (32, 32))), 30.0, (0, 15, 30, 45, 60), 61)
    want = Qwen3VLProcessor._calculate_timestamps(None, list(video.indices), 30.0, 2)
    assert qwen3.seconds(video) == pytest.approx(want)


def test_qwen2_frames_stay_within_budget():
    """Qwen2-VL's rule: each frame at most max_pixels (768 merged patches), and a long video's frames shrink so
    all of them stay within 90 % of max_video_tokens."""
    from exl2.models.vision.qwen2vl import DEFAULT_VIDEO as qwen2

    for frames in (4, 64, 768):
        height, width = qwen2.frame_size(frames, 1080, 1920)
        tokens = height * width // 28 ** 2
        assert tokens <= 768 and abs(width / height - 1920 / 1080) < 0.2
        assert frames // 2 * tokens <= 0.9 * qwen2.max_video_tokens or tokens * 28 ** 2 <= 1.05 * 128 * 28 ** 2 + 784
    assert qwen2.frame_size(4, 1080, 1920)[0] * qwen2.frame_size(4, 1080, 1920)[1] > \
        4 * qwen2.frame_size(768, 1080, 1920)[0] * qwen2.frame_size(768, 1080, 1920)[1] // 4


def test_text_after_a_video_goes_on_past_its_last_time():
    """Time positions step by time_step, rounded down after multiplying (a fractional step still moves on), and
    the text after the video starts one past its largest position, which is the last time when the video is
    long."""
    features = torch.zeros(16, 4)
    for step, times in ((2.0, [0, 2, 4, 6]), (0.5, [0, 0, 1, 1])):
        video = ImageTokens(tuple(range(100, 116)), 100, features, (4, 2, 2), time_step=step)
        ids = [1, 2] + list(video.ids) + [3, 4]
        positions, shift = mrope_positions(ids, [video], 100)
        assert positions[0, 2:18].tolist() == [2 + t for t in times for _ in range(4)]
        assert positions[1, 2:6].tolist() == [2, 2, 3, 3] and positions[2, 2:6].tolist() == [2, 3, 2, 3]
        after = 2 + max(times[-1] + 1, 2)
        assert positions[:, 18].tolist() == [after] * 3 and shift == after + 2 - len(ids)


def test_video_features_match_transformers(built):
    kind, out, model = built
    tower = load_vision(out, dtype=torch.float32)
    frames = _frames(5)
    video = Video(tuple(frames), None, tuple(range(5)), 5)
    patches, grid = tower.video_processing(video)
    assert grid[0] == 3 and grid[1:] == (6, 10)
    emb = tower.encode_video(video, _Words())
    with torch.no_grad():
        ref = model.get_video_features(pixel_values_videos=patches, video_grid_thw=torch.tensor([grid]),
                                       return_dict=True)
    tol = 1e-4 * ref.pooler_output[0].abs().max().item()
    assert emb.features.shape == ref.pooler_output[0].shape == (45, 64)
    assert (emb.features - ref.pooler_output[0]).abs().max().item() <= tol
    if kind == "qwen3_vl":
        assert len(emb.deep) == 2
        for ours, theirs in zip(emb.deep, ref.deepstack_features):
            assert (ours - theirs).abs().max().item() <= 1e-4 * theirs.abs().max().item()


class _Words:
    """A stand-in tokenizer that spells the timestamp text out, for the layout alone."""

    def encode(self, text, add_bos=False):
        return [ord(c) for c in text]


def test_prompt_layout_and_logits_match_transformers(built, engine):
    """The prompt's tokens as the processor lays them out, and transformers' logits for it with the video."""
    kind, out, model = built
    frames = _frames()
    ids, images = engine.chat_input(_messages(frames))
    vocab = engine.model.spec.vocab_size
    start = ids.index(START)
    if kind == "qwen3_vl":    # per frame pair: "<t seconds>", then its own start, 15 pads and end
        frame = [START] + [VIDEO] * 15 + [END]
        want = [START, 200, 202, *frame, 201, 202, *frame, END]
        assert len(images[0].deep) == 2
    else:
        want = [START] + [VIDEO] * 30 + [END]
    assert [VIDEO if t >= vocab else t for t in ids[start:start + len(want)]] == want
    assert images[0].grid == (2, 3, 5)
    positions, shift = mrope_positions(ids, images, vocab)
    with torch.no_grad():
        ref = model(**_hf_inputs(kind, model, engine.vision.vision, ids, vocab, frames)).logits.float()
        plain, inject = split([ids], [images], vocab, engine.model.device)
        pages = -(-len(ids) // 16)
        cache = paged_cache_for(engine.model, pages + 1, 16)
        cache.bind(torch.arange(pages, dtype=torch.int32)[None])
        ours = engine.model(torch.tensor(plain), cache, 0, inject=inject, mrope=positions[:, None])
    assert (ours - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    again, images_again = engine.chat_input(_messages(frames))     # the same video: encoded once, same aliases
    assert again == ids and images_again[0] is images[0]


def test_greedy_reply_after_a_video(built, engine):
    """The reply as transformers decodes it, whole and with a prefill chunk (8) shorter than the video."""
    kind, out, model = built
    frames = _frames(seed=40)
    ids, images = engine.chat_input(_messages(frames))
    vocab = engine.model.spec.vocab_size
    seq = list(ids)
    with torch.no_grad():
        for _ in range(6):
            logits = model(**_hf_inputs(kind, model, engine.vision.vision, seq, vocab, frames)).logits[0, -1]
            seq.append(int(logits.argmax()))
    want = seq[len(ids):]
    assert engine.chat(_messages(frames), GREEDY, 6).token_ids == want
    job = Job(ids, GREEDY, 6)
    job.images = images
    generator = DynamicGenerator(engine.model, engine.tokenizer, 512, page_size=4, chunk=8)
    assert generator.generate([job])[0].token_ids == want


def test_video_sources_and_errors(built, engine, tmp_path):
    """An animated GIF file decodes (Pillow, no FFmpeg) to the same layout as its frames; a video for a tower that
    reads only images, a template without a video marker, and unreadable data are one-sentence errors."""
    kind, out, model = built
    frames = _frames()
    path = tmp_path / "clip.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=500, loop=0)
    ids, images = engine.chat_input(_messages(str(path)))
    assert images[0].grid == (2, 3, 5) and len(ids) == len(engine.chat_input(_messages(frames))[0])
    with pytest.raises(ConfigError, match="not a format|cannot|PyAV"):
        engine.chat_input(_messages(b"not a video at all"))
    with pytest.raises(ConfigError, match="no frames"):
        engine.chat_input(_messages([]))
    image_only = [{"role": "user", "content": [{"type": "video", "video": frames}]}]
    set_template(out, TEMPLATE.replace("<|video_pad|>", "<|image_pad|>"))
    try:
        plain = Engine(EngineConfig(model_dir=out, device="cpu", max_seq_len=512, vision=True))
        with pytest.raises(ConfigError, match="placed 1 image for 1 video"):
            plain.chat_input(image_only)
    finally:
        set_template(out, TEMPLATE)


def test_towers_without_video_refuse_it():
    from exl2.generation.multimodal import VideoSource, VisionPrompts

    tower = types.SimpleNamespace(spec=types.SimpleNamespace(marker_id=5))
    prompts = VisionPrompts(tower, 100)
    with pytest.raises(ConfigError, match="still images only"):
        prompts._splice([1, 5, 2], [VideoSource(b"x")], None)


def test_the_chat_console_attaches_videos(built, engine, tmp_path, monkeypatch, capsys):
    """`exl2 chat --vision`: /video FILE puts the video before the next message, whose reply is the engine's for
    the same messages; a missing file is one error line and the session goes on."""
    from exl2.cli import main

    kind, out, model = built
    if kind != "qwen2_vl":
        pytest.skip("one family is enough for the console")
    frames = _frames(seed=60)
    path = tmp_path / "clip.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=500, loop=0)
    want = engine.chat([{"role": "user", "content": [{"type": "video", "video": str(path)},
                                                     {"type": "text", "text": "w30 w31"}]}], GREEDY, 6)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/video {tmp_path / 'nothing.mp4'}\n/video {path}\nw30 w31\n"))
    args = ["chat", "-m", str(out), "--device", "cpu", "--temperature", "0", "-maxr", "6", "-l", "512", "--vision"]
    assert main.main(args) == 0
    stdout, err = capsys.readouterr()
    assert stdout.strip() == want.text.strip()
    assert "nothing.mp4" in err and "Traceback" not in err


def test_the_mcp_chat_tool_takes_videos(built, engine, tmp_path):
    """The MCP chat tool's `videos` (a data URI of an animated GIF) go before the last user message's text: the reply
    is Engine.chat's for those messages."""
    import asyncio
    import base64

    from fastmcp import Client

    from exl2.mcp.server import build_server

    kind, out, model = built
    if kind != "qwen3_vl":
        pytest.skip("one family is enough for the MCP tool")
    frames = _frames(seed=70)
    path = tmp_path / "clip.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=500, loop=0)
    uri = "data:image/gif;base64," + base64.b64encode(path.read_bytes()).decode()
    want = engine.chat([{"role": "user", "content": [{"type": "video", "video": uri},
                                                     {"type": "text", "text": "w30"}]}], GREEDY, 6)

    async def go():
        async with Client(build_server(engine)) as client:
            return await client.call_tool("chat", {"messages": [{"role": "user", "content": "w30"}],
                                                   "videos": [uri], "max_tokens": 6, "temperature": 0})

    got = asyncio.run(go()).structured_content
    assert got["text"] == want.text and got["prompt_tokens"] == want.prompt_tokens


def test_openai_video_url_parts_reach_the_prompt():
    """vLLM's video_url content parts pass the server's message parsing (with the vision tower loaded) and become
    video sources; without the tower they are refused as unsupported content."""
    from exl2.generation.multimodal import VideoSource, split_images
    from exl2.server.errors import APIError
    from exl2.server.messages import template_messages
    from exl2.server.schemas import ChatMessage

    message = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}}, {"type": "text", "text": "hi"}]})
    messages, sources = split_images(template_messages([message], images=True))
    assert messages[0]["content"] == [{"type": "video"}, {"type": "text", "text": "hi"}]
    assert sources == [VideoSource("https://example.com/clip.mp4")]
    with pytest.raises(APIError, match="video_url"):
        template_messages([message], images=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_videos_on_the_gpu_match_transformers(tmp_path, kind):
    """fp16 on CUDA (the towers over frame pairs, M-RoPE time rows and DeepStack rows in the prefill kernels, decode
    graphs fed the RoPE shift; head_dim 64) against transformers in float32 on the CPU: prompt logits within 2 %
    of their largest, and the greedy reply's first 3 of 4 tokens (fp16 may round a near-tie the other way after)."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}
    text = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, head_dim=64,
                num_key_value_heads=1, vocab_size=256, bos_token_id=1, eos_token_id=1,
                layer_types=["full_attention"] * 2, rope_parameters=rope)
    tokens = dict(image_token_id=PAD, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if kind == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=96, out_hidden_size=128,
                      window_size=56, fullatt_block_indexes=[1], hidden_act="silu", tokens_per_second=1)
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        build, family = _build_qwen2, "qwen2"
    else:
        rope.update(mrope_section=[12, 10, 10], mrope_interleaved=True)
        vision = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=96, out_hidden_size=128,
                      num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
        config = Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
        build, family = _build_qwen3, "qwen3"
    hf = build(config, tmp_path, seed=8)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIGS[family]))
    _save_tokenizer(tmp_path)
    set_template(tmp_path, TEMPLATE)
    gpu = Engine(EngineConfig(model_dir=tmp_path, device="cuda", max_seq_len=512, vision=True))
    frames = _frames(seed=80)
    ids, images = gpu.chat_input(_messages(frames))
    vocab = gpu.model.spec.vocab_size
    positions, shift = mrope_positions(ids, images, vocab)
    assert shift < 0
    with torch.no_grad():
        ref = hf(**_hf_inputs(kind, hf, gpu.vision.vision, ids, vocab, frames)).logits.float()
        plain, inject = split([ids], [images], vocab, gpu.model.device)
        pages = -(-len(ids) // 16)
        cache = paged_cache_for(gpu.model, pages + 1, 16)
        cache.bind(torch.arange(pages, dtype=torch.int32, device="cuda")[None])
        ours = gpu.model(torch.tensor(plain, device="cuda"), cache, 0, inject=inject,
                         mrope=positions[:, None].cuda()).float().cpu()
        assert (ours - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
        seq = list(ids)
        for _ in range(4):
            seq.append(int(hf(**_hf_inputs(kind, hf, gpu.vision.vision, seq, vocab, frames)).logits[0, -1].argmax()))
    assert gpu.chat(_messages(frames), GREEDY, 4).token_ids[:3] == seq[len(ids):len(ids) + 3]
