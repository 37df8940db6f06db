"""Qwen's patch grids (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; images and videos alike): the sizes frames are resized to,
and frames cut into the rows the towers take, merge window by merge window."""
from __future__ import annotations

import math

import torch

from exl2.errors import ConfigError

MAX_ASPECT = 200          # smart_resize refuses longer slivers


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) as Qwen2VLImageProcessor resizes: each side rounded to a multiple of `factor`, then scaled
    (keeping the aspect ratio) down to at most max_pixels or up to at least min_pixels."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ConfigError(f"The image is {width}×{height} pixels; Qwen vision models take aspect ratios up to "
                          f"{MAX_ASPECT}:1.")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def whole_video_resize(frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int,
                       max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's smart_resize: each side rounded to a multiple of `factor`, then scaled (keeping the aspect ratio)
    so frames × height × width lies within [min_pixels, max_pixels]."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ConfigError(f"The video is {width}×{height} pixels; Qwen vision models take aspect ratios up to "
                          f"{MAX_ASPECT}:1.")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(frames / temporal) * temporal
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def patchify(frames: torch.Tensor, patch: int, merge: int,
             temporal: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Frames [F, C, H, W] → (one row per patch, grid (t, h, w) in patches): the last frame repeated until F is a
    multiple of `temporal` (a still image becomes `temporal` equal frames), then frame groups in order, merge windows
    row-major within each, patches row-major within a window; each row the patch's (channel, frame, y, x) values."""
    if pad := -frames.shape[0] % temporal:
        frames = torch.cat((frames, frames[-1:].expand(pad, *frames.shape[1:])))
    f, c, height, width = frames.shape
    t, rows, cols = f // temporal, height // patch, width // patch
    x = frames.reshape(t, temporal, c, rows // merge, merge, patch, cols // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * rows * cols, c * temporal * patch * patch), (t, rows, cols)


def merge_order(rows: int, cols: int, merge: int) -> torch.Tensor:
    """The row-major patch index of each tower row: merge × merge windows row-major, patches row-major within."""
    index = torch.arange(rows * cols).view(rows // merge, merge, cols // merge, merge)
    return index.transpose(1, 2).flatten()
