"""Images in, pixel tensors out: decoding (bytes, data URIs, files) and the Pixtral image processor's arithmetic.

`ImageProcessing` reproduces transformers' PixtralImageProcessor (its PIL backend, which the Mistral 3 processor
runs): shrink so the longest edge fits, round each side up to whole (merged) patches, resize bicubically in 8-bit
with PIL, rescale by 1/255 (in float64, then float32) and normalize per channel in float32. `resize_and_normalize`
is that arithmetic for a given size, which Gemma 3's fixed-size processor shares.
"""
from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence
from urllib.parse import unquote_to_bytes

import numpy as np
import PIL.Image
import torch

from exl2.errors import ConfigError
from exl2.generation.tokenizer import read_json

# PixtralImageProcessor's class defaults, used where the model directory has no preprocessor config
DEFAULT_LONGEST_EDGE = 1024
DEFAULT_MEAN = (0.48145466, 0.4578275, 0.40821073)
DEFAULT_STD = (0.26862954, 0.26130258, 0.27577711)


def _decode_data_uri(uri: str) -> bytes:
    """The payload of `data:[<type>][;base64],<data>` (base64 or percent-encoded)."""
    head, sep, payload = uri.partition(",")
    if not sep:
        raise ConfigError("The image data URI has no ',' before its data.")
    if head.endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=False)
        except (binascii.Error, ValueError):
            raise ConfigError("The image data URI holds invalid base64 data.") from None
    return unquote_to_bytes(payload)


def _read_source(source: bytes | str | Path) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, str) and source.startswith("data:"):
        return _decode_data_uri(source)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"The image file {path} does not exist.")
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"The image file {path} cannot be read ({e.strerror}).") from None


def to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """RGB, with transparent areas composited onto white (as vLLM and mistral_common do) rather than onto
    whatever colour the transparent pixels happen to hold."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def load_image(source: bytes | str | Path) -> PIL.Image.Image:
    """An RGB image from raw bytes, a data URI ("data:image/png;base64,...") or a file path."""
    data = _read_source(source)
    try:
        image = PIL.Image.open(io.BytesIO(data))
        image.load()
    except PIL.Image.DecompressionBombError:
        raise ConfigError("The image is too large to decode safely.") from None
    except (PIL.UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise ConfigError(f"The image data ({len(data)} bytes) is not an image format Pillow can decode.") from None
    return to_rgb(image)


def _longest_edge(size) -> int:
    """`size` as transformers saves it: {"longest_edge": n}, {"height": h, "width": w} or a bare int."""
    if isinstance(size, dict):
        if size.get("longest_edge"):
            return int(size["longest_edge"])
        if size.get("height") and size.get("width"):
            return int(min(size["height"], size["width"]))
    if isinstance(size, int) and size > 0:
        return size
    return DEFAULT_LONGEST_EDGE


def setting(cfg: dict, key: str, default):
    """A preprocessor setting; null (as published configs write unset keys) means the default."""
    value = cfg.get(key)
    return default if value is None else value


@dataclass(frozen=True, kw_only=True)
class PixelSettings:
    """Resampling, rescaling and normalization, as transformers' image processors name them."""

    resample: int
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @staticmethod
    def read(cfg: dict, resample: int, mean: tuple[float, ...], std: tuple[float, ...]) -> dict:
        """The fields from a preprocessor config, with these defaults for what it leaves out or null."""
        return dict(resample=int(setting(cfg, "resample", resample)),
                    do_rescale=bool(setting(cfg, "do_rescale", True)),
                    rescale_factor=float(setting(cfg, "rescale_factor", 1 / 255)),
                    do_normalize=bool(setting(cfg, "do_normalize", True)),
                    mean=tuple(float(v) for v in setting(cfg, "image_mean", mean)),
                    std=tuple(float(v) for v in setting(cfg, "image_std", std)))

    def pixels(self, image: PIL.Image.Image, height: int, width: int) -> torch.Tensor:
        """[3, height, width] float32 pixel values of `image` under these settings."""
        return resize_and_normalize(image, height, width, self.resample,
                                    self.rescale_factor if self.do_rescale else None,
                                    (self.mean, self.std) if self.do_normalize else None)


@dataclass(frozen=True)
class ImageProcessing(PixelSettings):
    """PixtralImageProcessor's settings; `patch` is the side the output is rounded up to (patch_size ×
    spatial_merge_size, as the processor passes it), so every merged patch is whole."""

    patch: int
    longest_edge: int = DEFAULT_LONGEST_EDGE

    @classmethod
    def from_dir(cls, model_dir: Path | str, patch: int) -> "ImageProcessing":
        """preprocessor_config.json, or the image_processor section of a one-file processor_config.json."""
        cfg = processor_config(model_dir)
        return cls(patch=patch, longest_edge=_longest_edge(cfg.get("size")),
                   **PixelSettings.read(cfg, int(PIL.Image.Resampling.BICUBIC), DEFAULT_MEAN, DEFAULT_STD))

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after resizing: scaled down (floored) to fit the longest edge, then each side rounded
        up to a multiple of `patch` (so small images grow a little)."""
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        height, width = max(height, 1), max(width, 1)     # a sliver of an image still gets one patch
        return (height - 1) // self.patch * self.patch + self.patch, (width - 1) // self.patch * self.patch + self.patch

    def __call__(self, image: PIL.Image.Image) -> torch.Tensor:
        """[3, H, W] float32 pixel values."""
        return self.pixels(image, *self.target_size(image.height, image.width))


def processor_config(model_dir: Path | str) -> dict:
    """The image processor's settings: preprocessor_config.json, or the image_processor section of a one-file
    processor_config.json (newer exports); {} when neither exists."""
    d = Path(model_dir)
    cfg = read_json(d / "preprocessor_config.json")
    if not cfg:
        nested = read_json(d / "processor_config.json").get("image_processor")
        cfg = nested if isinstance(nested, dict) else {}
    return cfg


def resize_and_normalize(image: PIL.Image.Image, height: int, width: int, resample: int,
                         rescale_factor: float | None, mean_std: tuple[Sequence[float], Sequence[float]] | None
                         ) -> torch.Tensor:
    """[3, height, width] float32, as transformers' PIL image processors compute it: RGB (convert_to_rgb), resized
    in 8-bit with PIL, rescaled in float64 then cast to float32, normalized per channel in float32. None skips
    the rescale or the normalization."""
    image = image if image.mode == "RGB" else image.convert("RGB")   # what transformers' convert_to_rgb does
    resized = image.resize((width, height), resample=PIL.Image.Resampling(resample))
    pixels = np.asarray(resized).transpose(2, 0, 1)
    if rescale_factor is not None:
        pixels = (pixels.astype(np.float64) * rescale_factor).astype(np.float32)
    pixels = pixels.astype(np.float32, copy=False)
    if mean_std is not None:
        mean = np.array(mean_std[0], dtype=np.float32)[:, None, None]
        std = np.array(mean_std[1], dtype=np.float32)[:, None, None]
        pixels = (pixels - mean) / std
    return torch.from_numpy(np.ascontiguousarray(pixels))
