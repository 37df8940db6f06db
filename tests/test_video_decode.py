"""Video decoding for the video-reading vision models: containers through PyAV, animated images through Pillow,
frames sampled before decoding finishes."""
import io
import sys

import numpy as np
import PIL.Image
import pytest

from exl2.errors import ConfigError
from exl2.models.vision import video as video_module
from exl2.models.vision.video import Video, decode_video, uniform_indices, video_from_frames

WIDTH, HEIGHT, COUNT, FPS = 64, 48, 30, 10


def colour(i: int) -> tuple[int, int, int]:
    return (8 * i, 100, 255 - 8 * i)


def mean_colour(image: PIL.Image.Image) -> np.ndarray:
    return np.asarray(image, dtype=np.float64).reshape(-1, 3).mean(0)


def encode(container_format: str, codec: str, pix_fmt: str, count: int = COUNT) -> bytes:
    """`count` flat-coloured 64x48 frames at 10 fps, frame i in colour(i)."""
    av = pytest.importorskip("av")
    if codec not in av.codecs_available:
        pytest.skip(f"this PyAV build has no {codec} encoder")
    out = io.BytesIO()
    with av.open(out, "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, pix_fmt
        for i in range(count):
            pixels = np.full((HEIGHT, WIDTH, 3), colour(i), np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()


def animated(fmt: str, count: int = 5, duration: int = 100, mode: str = "RGB") -> bytes:
    frames = [PIL.Image.new(mode, (WIDTH, HEIGHT), colour(i)) for i in range(count)]
    out = io.BytesIO()
    extra = {"lossless": True} if fmt == "WEBP" else {}
    frames[0].save(out, fmt, save_all=True, append_images=frames[1:], duration=duration, loop=0, **extra)
    return out.getvalue()


def pick(*indices):
    calls = []

    def sample(total, fps):
        calls.append((total, fps))
        return list(indices)

    sample.calls = calls
    return sample


@pytest.fixture
def no_av(monkeypatch):
    """`import av` raises ImportError, as where PyAV is not installed."""
    monkeypatch.setitem(sys.modules, "av", None)


CONTAINERS = [("matroska", "ffv1", "bgr0", 1),  # lossless; Matroska gives no frame count, so packets are counted
              ("mov", "png", "rgb24", 1),  # lossless, with a frame count in the header
              ("mp4", "mpeg4", "yuv420p", 8)]  # lossy


@pytest.mark.parametrize("container_format, codec, pix_fmt, tolerance", CONTAINERS)
def test_container_frames_are_sampled(container_format, codec, pix_fmt, tolerance):
    sample = pick(0, 7, 29)
    video = decode_video(encode(container_format, codec, pix_fmt), sample)
    assert isinstance(video, Video)
    assert sample.calls == [(COUNT, pytest.approx(FPS))]
    assert video.indices == (0, 7, 29)
    assert video.total == COUNT
    assert video.fps == pytest.approx(FPS)
    assert len(video.frames) == 3
    for index, frame in zip(video.indices, video.frames):
        assert frame.mode == "RGB" and frame.size == (WIDTH, HEIGHT)
        np.testing.assert_allclose(mean_colour(frame), colour(index), atol=tolerance)


def test_uniform_sampler_on_a_container():
    video = decode_video(encode("matroska", "ffv1", "bgr0"), lambda total, fps: uniform_indices(total, 4))
    assert video.indices == (0, 10, 19, 29)
    for index, frame in zip(video.indices, video.frames):
        np.testing.assert_allclose(mean_colour(frame), colour(index), atol=1)


class _Counting:
    """Wraps a PyAV container: its video stream claims `frames` frames, and frames decoded are counted."""

    def __init__(self, container, frames, log):
        self._container, self._frames, self._log = container, frames, log
        real = container.streams.video[0]
        claimed = frames

        class Stream:
            def __getattr__(self, name):
                return getattr(real, name)

            def __setattr__(self, name, value):
                setattr(real, name, value)

            frames = claimed

        self._stream, self._real = Stream(), real
        self.streams = type("Streams", (), {"video": [self._stream]})()

    def __getattr__(self, name):
        return getattr(self._container, name)

    def demux(self, *streams):
        return self._container.demux(self._real)

    def decode(self, *streams):
        for frame in self._container.decode(self._real):
            self._log.append(frame)
            yield frame


def _counting_open(monkeypatch, claimed):
    av = pytest.importorskip("av")
    real_open, decoded = av.open, []
    monkeypatch.setattr(av, "open", lambda *a, **k: _Counting(real_open(*a, **k), claimed, decoded))
    return decoded


def test_decoding_stops_after_the_last_wanted_frame(monkeypatch):
    data = encode("mov", "png", "rgb24")
    decoded = _counting_open(monkeypatch, COUNT)
    video = decode_video(data, pick(2, 5))
    assert video.indices == (2, 5)
    assert len(decoded) == 6


def test_frames_past_the_real_end_are_dropped(monkeypatch):
    data = encode("mov", "png", "rgb24")
    _counting_open(monkeypatch, COUNT + 10)
    sample = pick(3, 29, 35)
    video = decode_video(data, sample)
    assert sample.calls == [(COUNT + 10, pytest.approx(FPS))]
    assert video.indices == (3, 29) and len(video.frames) == 2 and video.total == COUNT + 10
    np.testing.assert_allclose(mean_colour(video.frames[1]), colour(29), atol=1)


def test_no_frame_decoded_is_an_error(monkeypatch):
    data = encode("mov", "png", "rgb24")
    _counting_open(monkeypatch, COUNT + 10)
    with pytest.raises(ConfigError, match="no frames"):
        decode_video(data, pick(35))


def test_too_many_pixels_is_refused_before_decoding(monkeypatch):
    data = encode("mov", "png", "rgb24")
    decoded = _counting_open(monkeypatch, COUNT)
    monkeypatch.setattr(video_module, "MAX_VIDEO_PIXELS", WIDTH * HEIGHT * 2)
    assert len(decode_video(data, pick(0, 1)).frames) == 2
    decoded.clear()
    with pytest.raises(ConfigError, match="sampled frames"):
        decode_video(data, pick(0, 1, 2))
    assert decoded == []


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "PNG"])
@pytest.mark.parametrize("blocked", [False, True], ids=["with-av", "without-av"])
def test_animated_images(fmt, blocked, monkeypatch):
    if blocked:
        monkeypatch.setitem(sys.modules, "av", None)
    sample = pick(0, 2, 4)
    video = decode_video(animated(fmt), sample)
    assert sample.calls == [(5, pytest.approx(10))]
    assert video.fps == pytest.approx(10) and video.total == 5 and video.indices == (0, 2, 4)
    for index, frame in zip(video.indices, video.frames):
        assert frame.mode == "RGB" and frame.size == (WIDTH, HEIGHT)
        np.testing.assert_allclose(mean_colour(frame), colour(index), atol=1)


def test_transparent_animated_image_is_composited_onto_white(no_av):
    frames = [PIL.Image.new("RGBA", (8, 8), (255, 0, 0, 0)), PIL.Image.new("RGBA", (8, 8), (0, 0, 255, 255))]
    out = io.BytesIO()
    frames[0].save(out, "PNG", save_all=True, append_images=frames[1:], duration=50)
    video = decode_video(out.getvalue(), lambda total, fps: range(total))
    assert video.fps == pytest.approx(20)
    assert [frame.mode for frame in video.frames] == ["RGB", "RGB"]
    np.testing.assert_allclose(mean_colour(video.frames[0]), (255, 255, 255))
    np.testing.assert_allclose(mean_colour(video.frames[1]), (0, 0, 255))


def test_still_image_is_a_one_frame_video(no_av):
    out = io.BytesIO()
    PIL.Image.new("L", (10, 6), 77).save(out, "PNG")
    sample = pick(0)
    video = decode_video(out.getvalue(), sample)
    assert sample.calls == [(1, None)]
    assert video.fps is None and video.total == 1 and video.indices == (0,)
    assert video.frames[0].mode == "RGB" and video.frames[0].getpixel((0, 0)) == (77, 77, 77)


def test_animated_image_over_the_pixel_limit(no_av, monkeypatch):
    monkeypatch.setattr(video_module, "MAX_VIDEO_PIXELS", WIDTH * HEIGHT * 2)
    with pytest.raises(ConfigError, match="sampled frames"):
        decode_video(animated("GIF"), pick(0, 1, 2))


def test_bytes_ffmpeg_cannot_read():
    pytest.importorskip("av")
    with pytest.raises(ConfigError, match="not a format FFmpeg can decode") as info:
        decode_video(b"not a video", pick(0))
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_container_without_video_stream():
    av = pytest.importorskip("av")
    out = io.BytesIO()
    with av.open(out, "w", format="matroska") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    with pytest.raises(ConfigError, match="no video stream"):
        decode_video(out.getvalue(), pick(0))


def test_without_pyav_non_image_bytes_ask_for_it(no_av):
    with pytest.raises(ConfigError, match="needs PyAV") as info:
        decode_video(b"not a video", pick(0))
    assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.parametrize("indices", [[0, 5], [-1, 0], [], [2, 1], [1, 1], [0.5]],
                         ids=["past-end", "negative", "empty", "descending", "repeated", "not-int"])
def test_bad_sampler_results_are_programming_errors(indices, no_av):
    frames = [PIL.Image.new("RGB", (4, 4))] * 5
    with pytest.raises(ValueError):
        video_from_frames(frames, lambda total, fps: indices)
    with pytest.raises(ValueError):
        decode_video(animated("GIF"), lambda total, fps: indices)


def test_container_sampler_out_of_range():
    data = encode("matroska", "ffv1", "bgr0")
    with pytest.raises(ValueError):
        decode_video(data, pick(0, COUNT))


def test_frames_sampled():
    frames = [PIL.Image.new("RGB", (WIDTH, HEIGHT), colour(i)) for i in range(6)]
    sample = pick(1, 4)
    video = video_from_frames(frames, sample, fps=2.0)
    assert sample.calls == [(6, 2.0)]
    assert video.indices == (1, 4) and video.total == 6 and video.fps == 2.0
    assert [frame.getpixel((0, 0)) for frame in video.frames] == [colour(1), colour(4)]


def test_frames_without_rate():
    sample = pick(0)
    video = video_from_frames([PIL.Image.new("RGB", (4, 4))] * 3, sample)
    assert sample.calls == [(3, None)] and video.fps is None


def test_rgba_frames_come_out_rgb():
    frames = [PIL.Image.new("RGBA", (4, 4), (255, 0, 0, 0)), PIL.Image.new("RGBA", (4, 4), (0, 255, 0, 255))]
    video = video_from_frames(frames, lambda total, fps: range(total))
    assert [frame.mode for frame in video.frames] == ["RGB", "RGB"]
    assert [frame.getpixel((0, 0)) for frame in video.frames] == [(255, 255, 255), (0, 255, 0)]


def test_frames_of_different_sizes():
    frames = [PIL.Image.new("RGB", (4, 4)), PIL.Image.new("RGB", (4, 5))]
    with pytest.raises(ConfigError, match="not all the same size"):
        video_from_frames(frames, pick(0))


def test_no_frames():
    with pytest.raises(ConfigError):
        video_from_frames([], pick(0))


@pytest.mark.parametrize("total, count, expected", [
    (30, 4, [0, 10, 19, 29]),
    (3, 8, [0, 1, 2]),
    (5, 5, [0, 1, 2, 3, 4]),
    (100, 1, [0]),
    (10, 2, [0, 9]),
    (11, 3, [0, 5, 10]),
])
def test_uniform_indices(total, count, expected):
    assert uniform_indices(total, count) == expected
