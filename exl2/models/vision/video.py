"""Videos in, sampled RGB frames out, for the vision-language models that read videos (Qwen2-VL, Qwen3-VL).

A model sees only a handful of a video's frames, so the frames to keep are chosen from the frame count and rate
before decoding starts, and decoding stops after the last of them: a long video costs little more than a short one,
and only the kept frames are ever held. Container formats go through PyAV (FFmpeg), an optional dependency; animated
GIF, WebP and PNG are read by Pillow, so they need nothing more.
"""
from __future__ import annotations

import io
import operator
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import PIL.Image

from exl2.errors import ConfigError
from exl2.models.vision.image import to_rgb

MAX_VIDEO_PIXELS = 2**31

Sampler = Callable[[int, Optional[float]], Sequence[int]]
"""(the source's frame count, its frame rate or None when unknown) → the frame indices to keep, ascending, each in
[0, count)."""


@dataclass(frozen=True)
class Video:
    """Frames sampled from a video, with where they came from."""

    frames: tuple[PIL.Image.Image, ...]
    """RGB, all the same size."""
    fps: Optional[float]
    """The source's frame rate; None when unknown (frames handed over as images)."""
    indices: tuple[int, ...]
    """Each kept frame's index in the source (its timestamp is index / fps)."""
    total: int
    """The source's frame count."""


def uniform_indices(total: int, count: int) -> list[int]:
    """`count` indices spread evenly over [0, total - 1], first and last included, rounded; all of them when
    `count` >= `total`."""
    if count < 1:
        raise ValueError(f"Cannot sample {count} frames; at least one is needed.")
    if count >= total:
        return list(range(total))
    return [int(i) for i in np.linspace(0, total - 1, count).round()]


def _sampled(sample: Sampler, total: int, fps: Optional[float]) -> list[int]:
    """`sample(total, fps)`, checked: non-empty, strictly ascending, within [0, total)."""
    try:
        indices = [operator.index(i) for i in sample(total, fps)]
    except TypeError:
        raise ValueError("The frame sampler must return a sequence of integers.") from None
    if not indices:
        raise ValueError(f"The frame sampler chose no frames out of {total}.")
    if indices[0] < 0 or indices[-1] >= total:
        raise ValueError(f"The frame sampler chose frames outside [0, {total}): {indices}.")
    if any(a >= b for a, b in zip(indices, indices[1:])):
        raise ValueError(f"The frame sampler's indices are not strictly ascending: {indices}.")
    return indices


def _check_pixels(width: int, height: int, count: int) -> None:
    pixels = width * height * count
    if pixels > MAX_VIDEO_PIXELS:
        raise ConfigError(f"The video's {count} sampled frames of {width}x{height} would take {pixels} pixels, more "
                          f"than the limit of {MAX_VIDEO_PIXELS}.")


def video_from_frames(frames: Sequence[PIL.Image.Image], sample: Sampler, fps: Optional[float] = None) -> Video:
    """A video from frames given as images (already decoded, perhaps already sampled), with `sample` applied."""
    if fps is not None and not fps > 0:
        raise ValueError(f"A video's frame rate must be positive, not {fps}.")
    if not frames:
        raise ConfigError("The video has no frames.")
    sizes = sorted({frame.size for frame in frames})
    if len(sizes) > 1:
        shown = ", ".join(f"{w}x{h}" for w, h in sizes)
        raise ConfigError(f"The video's frames are not all the same size ({shown}).")
    indices = _sampled(sample, len(frames), fps)
    return Video(tuple(to_rgb(frames[i]) for i in indices), fps, tuple(indices), len(frames))


def _open_image(data: bytes) -> Optional[PIL.Image.Image]:
    """The data as an image Pillow decodes (its first frame loaded), or None when Pillow cannot."""
    try:
        image = PIL.Image.open(io.BytesIO(data))
        image.load()
        return image
    except PIL.Image.DecompressionBombError:
        raise ConfigError("The video's frames are too large to decode safely.") from None
    except (PIL.UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
        return None


def _decode_image(image: PIL.Image.Image, sample: Sampler) -> Video:
    """The frames of a still or animated image; fps from the mean duration of the frames that give one."""
    pillow_errors = (OSError, ValueError, SyntaxError, EOFError)
    durations: list[float] = []
    try:
        total = getattr(image, "n_frames", 1)
        for i in range(total):
            image.seek(i)
            image.load()
            durations.append(image.info.get("duration") or 0)
    except pillow_errors as e:
        raise ConfigError(f"The {image.format} image's frame {len(durations)} cannot be decoded ({e}).") from None
    timed = [d for d in durations if d > 0]
    fps = 1000 * len(timed) / sum(timed) if timed else None
    indices = _sampled(sample, total, fps)
    _check_pixels(*image.size, len(indices))
    frames = []
    try:
        for i in indices:
            image.seek(i)
            frame = to_rgb(image)
            frames.append(frame.copy() if frame is image else frame)
    except pillow_errors as e:
        raise ConfigError(f"The {image.format} image's frame {i} cannot be decoded ({e}).") from None
    return Video(tuple(frames), fps, tuple(indices), total)


def _decode_av(av, data: bytes, sample: Sampler) -> Video:
    """The sampled frames of the first video stream in a container FFmpeg reads."""
    def open_container():
        try:
            container = av.open(io.BytesIO(data), mode="r")
        except (av.FFmpegError, OSError, ValueError, EOFError):
            raise ConfigError(f"The video data ({len(data)} bytes) is not a format FFmpeg can decode.") from None
        if not container.streams.video:
            container.close()
            raise ConfigError(f"The video data ({len(data)} bytes) holds no video stream.")
        return container, container.streams.video[0]

    container, stream = open_container()
    try:
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate and rate > 0 else None
        total = stream.frames
        if total <= 0:
            try:
                total = sum(1 for packet in container.demux(stream) if packet.size > 0)
            except (av.FFmpegError, OSError, ValueError, EOFError):
                raise ConfigError(f"The video data ({len(data)} bytes) is corrupt.") from None
            container.close()
            container, stream = open_container()
        if total <= 0:
            raise ConfigError("The video has no frames.")
        indices = _sampled(sample, total, fps)
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_pixels(width, height, len(indices))
        stream.thread_type = "AUTO"
        wanted, last = set(indices), indices[-1]
        kept: list[int] = []
        frames: list[PIL.Image.Image] = []
        try:
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    if not frames and not width * height:
                        _check_pixels(frame.width, frame.height, len(indices))
                    image = to_rgb(frame.to_image())
                    if frames and image.size != frames[0].size:
                        image = image.resize(frames[0].size, PIL.Image.Resampling.BICUBIC)
                    frames.append(image)
                    kept.append(i)
                if i >= last:
                    break
        except (av.FFmpegError, OSError, ValueError, EOFError):
            if not frames:
                raise ConfigError(f"The video data ({len(data)} bytes) is corrupt: no frame decodes.") from None
    finally:
        container.close()
    if not frames:
        raise ConfigError(f"The video data ({len(data)} bytes) decodes to no frames.")
    return Video(tuple(frames), fps, tuple(kept), total)


def decode_video(data: bytes, sample: Sampler) -> Video:
    """The frames `sample` chooses from a video's bytes: animated (or still) images through Pillow, containers
    (MP4, MKV, WebM, AVI, MOV ...) through PyAV. Only the chosen frames are kept, and decoding stops after the last."""
    image = _open_image(data)
    if image is not None:
        with image:
            return _decode_image(image, sample)
    try:
        import av
    except ImportError:
        raise ConfigError("Reading this video needs PyAV: pip install 'exl2[video]' (animated GIF, WebP and PNG need "
                          "nothing more).") from None
    return _decode_av(av, data, sample)
