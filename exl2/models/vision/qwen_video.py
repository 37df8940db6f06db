"""Videos for the Qwen vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): which frames to keep, how large, and where
they sit in time.

A video is sampled to `fps` frames a second (between min_frames and max_frames) before decoding finishes, every
frame resized to one size that keeps the aspect ratio, and consecutive frame pairs (temporal_patch) become one grid
of patches, as transformers' Qwen video processors do with their per-frame pixel cap on (qwen-vl-utils' rule, which
transformers makes the default in 5.22): the frames share a token budget, so a long video costs little more than a
short one. Qwen2-VL and Qwen2.5-VL bound each frame's area; Qwen3-VL bounds the whole video's. Frames are resized
with PIL (transformers resizes video tensors with torchvision, so pixels may differ by a rounding step).

The text model places a video in time: Qwen2.5-VL by M-RoPE time positions tokens_per_second apart a second, Qwen2-VL
one a frame group, Qwen3-VL by a "<t seconds>" text before each frame group. Frames handed over without a frame rate
are taken to be sampled at `fps` already.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from exl2.errors import ConfigError
from exl2.generation.tokenizer import read_json
from exl2.models.vision.image import PixelSettings, setting
from exl2.models.vision.qwen_patches import patchify, smart_resize, whole_video_resize
from exl2.models.vision.video import Video, uniform_indices

TOKEN_SHARE = 0.9    # Qwen2-VL's whole-video budget: this share of max_video_tokens


@dataclass(frozen=True)
class QwenVideoProcessing(PixelSettings):
    """A Qwen video processor's settings (video_preprocessor_config.json, transformers' names)."""

    min_pixels: int
    max_pixels: int
    patch: int
    temporal_patch: int
    merge: int
    whole_video: bool         # Qwen3-VL: max_pixels bounds all frames together, not each
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    max_video_tokens: int = 128000

    @classmethod
    def from_dir(cls, model_dir: Path | str, defaults: "QwenVideoProcessing") -> "QwenVideoProcessing":
        """video_preprocessor_config.json (or processor_config.json's video_processor section), with `defaults`
        (the model family's published settings) for what it leaves out; the image processor's settings are not
        used: their area bounds are a still image's."""
        d = Path(model_dir)
        cfg = read_json(d / "video_preprocessor_config.json")
        if not cfg:
            nested = read_json(d / "processor_config.json").get("video_processor")
            cfg = nested if isinstance(nested, dict) else {}
        size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
        pixels = PixelSettings.read(cfg, defaults.resample, defaults.mean, defaults.std)
        return cls(min_pixels=int(setting(cfg, "min_pixels", setting(size, "shortest_edge", defaults.min_pixels))),
                   max_pixels=int(setting(cfg, "max_pixels", setting(size, "longest_edge", defaults.max_pixels))),
                   patch=int(setting(cfg, "patch_size", defaults.patch)),
                   temporal_patch=int(setting(cfg, "temporal_patch_size", defaults.temporal_patch)),
                   merge=int(setting(cfg, "merge_size", defaults.merge)), whole_video=defaults.whole_video,
                   fps=float(setting(cfg, "fps", defaults.fps)),
                   min_frames=int(setting(cfg, "min_frames", defaults.min_frames)),
                   max_frames=int(setting(cfg, "max_frames", defaults.max_frames)),
                   max_video_tokens=int(setting(cfg, "max_video_tokens", defaults.max_video_tokens)), **pixels)

    def check(self, spec) -> None:
        """The patches must be the tower's, and the frame bounds sensible."""
        for what, ours, tower in (("patch_size", self.patch, spec.patch), ("merge_size", self.merge, spec.merge),
                                  ("temporal_patch_size", self.temporal_patch, spec.temporal_patch)):
            if ours != tower:
                raise ConfigError(f"The video processor's {what} is {ours} but the vision tower's is {tower}.")
        if not 1 <= self.min_frames <= self.max_frames or self.fps <= 0:
            raise ConfigError(f"The video processor's frame bounds (fps {self.fps}, {self.min_frames} to "
                              f"{self.max_frames} frames) are not usable.")

    def sample(self, total: int, fps: Optional[float]) -> list[int]:
        """The frames of a `total`-frame video at `fps` (None: already sampled) to keep: `self.fps` a second, at
        least min_frames and at most max_frames (and the video's own), spread evenly from first to last."""
        count = int(total / (fps or self.fps) * self.fps)
        return uniform_indices(total, min(max(count, self.min_frames), self.max_frames, total))

    def frame_size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) every one of `frames` sampled frames is resized to (whole merged patches)."""
        factor = self.patch * self.merge
        floor = int(self.min_pixels * 1.05)
        if self.whole_video:
            frames = max(frames, self.temporal_patch)
            per_frame = max(min(self.max_video_tokens * factor ** 2, self.max_pixels // frames), floor)
            return whole_video_resize(frames, height, width, self.temporal_patch, factor, self.min_pixels,
                                      per_frame * frames)
        budget = int(self.max_video_tokens * factor ** 2 * TOKEN_SHARE)
        return smart_resize(height, width, factor, self.min_pixels,
                            max(min(self.max_pixels, budget * self.temporal_patch // frames), floor))

    def __call__(self, video: Video) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(patches [t·h·w, C·temporal_patch·patch²] float32, grid (t, h, w) in patches), as the video processor
        returns pixel_values_videos and video_grid_thw."""
        first = video.frames[0]
        height, width = self.frame_size(len(video.frames), first.height, first.width)
        frames = torch.stack([self.pixels(f, height, width) for f in video.frames])
        return patchify(frames, self.patch, self.merge, self.temporal_patch)

    def seconds(self, video: Video) -> list[float]:
        """Each frame group's time in seconds (Qwen3-VL's timestamps): the mean of its first and last frame's, the
        last frame repeated to fill the final group as the patches do."""
        rate = video.fps or self.fps
        times = [i / rate for i in video.indices]
        times += times[-1:] * (-len(times) % self.temporal_patch)
        step = self.temporal_patch
        return [(times[i] + times[i + step - 1]) / 2 for i in range(0, len(times), step)]

    def group_seconds(self, video: Video) -> float:
        """Seconds between consecutive frame groups at the rate the frames were sampled (Qwen2.5-VL's
        second_per_grid_t)."""
        rate = (video.fps or self.fps) * len(video.indices) / max(video.total, 1)
        return self.temporal_patch / rate

