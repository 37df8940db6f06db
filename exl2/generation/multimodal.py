"""Prompts with images: image sources to bytes, messages to what chat templates take, and a rendered prompt's
image tokens replaced by each image's layout (exl2.generation.images)."""
from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional, Sequence

from exl2.errors import ConfigError, ModelLoadError
from exl2.generation.images import ImageAliases, ImageTokens, image_key

# content part types that carry an image: exl2's own ({"type": "image", "image": source}) and OpenAI's
IMAGE_PARTS = ("image", "image_url")
MAX_IMAGE_BYTES = 32 << 20
FETCH_TIMEOUT = 20.0


def image_bytes(source: Any) -> bytes:
    """The encoded image a source names: bytes themselves, a data URI, an http(s) URL (fetched), a file path, or
    a PIL image (saved as PNG). Raises ConfigError with one sentence when it cannot be had."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if hasattr(source, "save") and hasattr(source, "mode"):   # a PIL image
        out = io.BytesIO()
        source.save(out, format="PNG")
        return out.getvalue()
    text = str(source)
    if text.startswith("data:"):
        head, _, payload = text.partition(",")
        if ";base64" not in head:
            raise ConfigError("An image data URI must be base64-encoded (data:image/...;base64,...).")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError("The image data URI is not valid base64.") from None
    if text.startswith(("http://", "https://")):
        return _fetch(text)
    path = Path(text)
    if not path.is_file():
        raise ConfigError(f"The image {text[:200]!r} is neither a data URI, an http(s) URL nor a file.")
    return path.read_bytes()


def _fetch(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT) as r:
            data = r.read(MAX_IMAGE_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ConfigError(f"The image at {url[:200]} could not be fetched ({e}).") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ConfigError(f"The image at {url[:200]} is larger than {MAX_IMAGE_BYTES >> 20} MiB.")
    return data


def part_source(part: dict) -> Any:
    """The image a content part carries: {"type": "image", "image": ...} or OpenAI's
    {"type": "image_url", "image_url": {"url": ...}} (or a bare URL string)."""
    if part.get("type") == "image":
        return part.get("image") if part.get("image") is not None else part.get("url")
    ref = part.get("image_url")
    return ref.get("url") if isinstance(ref, dict) else ref


def with_images(text: str, images: Sequence[Any]) -> list[dict]:
    """A message's content: the images (sources, as `image_bytes` takes them), then the text."""
    return [*({"type": "image", "image": i} for i in images), {"type": "text", "text": text}]


def split_images(messages: Sequence[dict]) -> tuple[list[dict], list[Any]]:
    """(the messages as chat templates take them, each image part reduced to {"type": "image"}; the image sources
    in order). Messages without image parts are passed on unchanged."""
    out, sources = [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in content):
            parts = []
            for p in content:
                if isinstance(p, dict) and p.get("type") in IMAGE_PARTS:
                    source = part_source(p)
                    if source is None:
                        raise ConfigError("An image content part names no image.")
                    sources.append(source)
                    parts.append({"type": "image"})
                else:
                    parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out, sources


class VisionPrompts:
    """A vision encoder (exl2.models.vision: `encode(image)` → ImageEmbedding) with the alias ids of the images
    it has encoded, keyed by their bytes."""

    def __init__(self, vision, first_alias: int):
        self.vision, self.aliases = vision, ImageAliases(first_alias)

    @classmethod
    def load(cls, model_dir, model) -> "VisionPrompts":
        """The vision tower of `model_dir` on `model`'s device and dtype, its aliases past `model`'s vocabulary; a
        ConfigError naming the model when it has none."""
        from exl2.models.vision import load_vision

        tower = load_vision(model_dir, model.device, model.dtype)
        if tower is None:
            raise no_vision(Path(model_dir).name, None)
        return cls(tower, model.spec.vocab_size)

    def image(self, source: Any) -> ImageTokens:
        from exl2.models.vision import load_image

        data = image_bytes(source)
        key = image_key(data)
        found = self.aliases.get(key)
        if found is not None:
            return found
        emb = self.vision.encode(load_image(data))
        return self.aliases.add(key, emb.token_ids, emb.image_token_id, emb.features, emb.grid, emb.deep)

    def prompt(self, text: str, tokenizer, sources: Sequence[Any]) -> tuple[list[int], tuple[ImageTokens, ...]]:
        """A rendered chat prompt with the template's image marker where each of `sources` goes, tokenized (after
        the text the model's processor adds around each marker, where it adds any: Gemma 3's newlines) and
        `_splice`d."""
        expand = getattr(self.vision, "expand_text", None)
        return self._splice(tokenizer.encode(expand(text) if expand else text, add_bos=False), sources)

    def _splice(self, ids: Sequence[int], sources: Sequence[Any]) -> tuple[list[int], tuple[ImageTokens, ...]]:
        """`ids` (a rendered prompt with the template's image marker where each image goes, in order: [IMG] for
        Pixtral, <start_of_image> for Gemma 3) with each replaced by its image's layout, and the images."""
        marks = [i for i, t in enumerate(ids) if t == self.vision.spec.marker_id]
        if len(marks) != len(sources):
            raise ConfigError(f"The chat template placed {len(marks)} image tokens for {len(sources)} images; "
                              "this template cannot show images.")
        images = tuple(self.image(s) for s in sources)
        out: list[int] = []
        last = 0
        for at, image in zip(marks, images):
            out += ids[last:at]
            out += image.ids
            last = at + 1
        out += ids[last:]
        return out, images


def has_vision_tower(model_dir) -> bool:
    """Whether config.json describes a model with a vision tower (a vision_config)."""
    from exl2.models.registry import read_config

    try:
        return "vision_config" in read_config(model_dir)
    except ModelLoadError:
        return False


def no_vision(model_name: str, loaded: Optional[bool]) -> ConfigError:
    if loaded is False:
        return ConfigError(f"{model_name} can read images, but it was loaded without its vision tower (set vision "
                           "on: --vision, EngineConfig(vision=True)).")
    return ConfigError(f"{model_name} cannot read images (it has no vision tower).")
