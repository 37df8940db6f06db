"""Prompts with images and videos: sources to bytes, messages to what chat templates take, and a rendered prompt's
image and video tokens replaced by each one's layout (exl2.generation.images)."""
from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from exl2.errors import ConfigError, ModelLoadError
from exl2.generation.images import ImageAliases, ImageTokens, image_key

# content part types that carry an image: exl2's own ({"type": "image", "image": source}) and OpenAI's
IMAGE_PARTS = ("image", "image_url")
# and a video: exl2's own ({"type": "video", "video": source or [frames]}) and vLLM's video_url
VIDEO_PARTS = ("video", "video_url")
MAX_IMAGE_BYTES = 32 << 20
MAX_VIDEO_BYTES = 512 << 20
FETCH_TIMEOUT = 20.0


@dataclass(frozen=True)
class _Picture:
    """An image already decoded (a pan-and-scan crop, or the whole image it came from), under its cache key."""

    key: str
    image: Any


@dataclass(frozen=True)
class VideoSource:
    """A video in a prompt's sources (images are bare): encoded bytes, a data URI, an http(s) URL, a file path, or
    its frames (a list of image sources, taken as sampled already)."""

    source: Any


def image_bytes(source: Any, what: str = "image", limit: int = MAX_IMAGE_BYTES) -> bytes:
    """The encoded image (or video: `what`, `limit`) a source names: bytes themselves, a data URI, an http(s) URL
    (fetched), a file path, or a PIL image (saved as PNG). Raises ConfigError with one sentence when it cannot be
    had."""
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
            raise ConfigError(f"An {what} data URI must be base64-encoded (data:{what}/...;base64,...).")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"The {what} data URI is not valid base64.") from None
    if text.startswith(("http://", "https://")):
        return _fetch(text, what, limit)
    path = Path(text)
    if not path.is_file():
        raise ConfigError(f"The {what} {text[:200]!r} is neither a data URI, an http(s) URL nor a file.")
    if path.stat().st_size > limit:
        raise ConfigError(f"The {what} file {text[:200]} is larger than {limit >> 20} MiB.")
    return path.read_bytes()


def _fetch(url: str, what: str, limit: int) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT) as r:
            data = r.read(limit + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ConfigError(f"The {what} at {url[:200]} could not be fetched ({e}).") from None
    if len(data) > limit:
        raise ConfigError(f"The {what} at {url[:200]} is larger than {limit >> 20} MiB.")
    return data


def part_source(part: dict) -> Any:
    """The image or video a content part carries: {"type": "image", "image": ...}, {"type": "video", "video": ...},
    or OpenAI's {"type": "image_url", "image_url": {"url": ...}} and vLLM's video_url alike (or a bare URL
    string)."""
    kind = part.get("type")
    if kind in ("image", "video"):
        return part.get(kind) if part.get(kind) is not None else part.get("url")
    ref = part.get(kind)
    return ref.get("url") if isinstance(ref, dict) else ref


def with_images(text: str, images: Sequence[Any]) -> list[dict]:
    """A message's content: the images (sources, as `image_bytes` takes them) and videos (VideoSource), then the
    text."""
    media = ({"type": "video", "video": i.source} if isinstance(i, VideoSource) else {"type": "image", "image": i}
             for i in images)
    return [*media, {"type": "text", "text": text}]


def split_images(messages: Sequence[dict]) -> tuple[list[dict], list[Any]]:
    """(the messages as chat templates take them, each image part reduced to {"type": "image"} and each video part
    to {"type": "video"}; the sources in order, videos as VideoSource). Messages without such parts are passed on
    unchanged."""
    media = IMAGE_PARTS + VIDEO_PARTS
    out, sources = [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in media for p in content):
            parts = []
            for p in content:
                if isinstance(p, dict) and p.get("type") in media:
                    video = p["type"] in VIDEO_PARTS
                    source = part_source(p)
                    if source is None:
                        raise ConfigError(f"A{' video' if video else 'n image'} content part names no "
                                          f"{'video' if video else 'image'}.")
                    sources.append(VideoSource(source) if video else source)
                    parts.append({"type": "video" if video else "image"})
                else:
                    parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out, sources


class VisionPrompts:
    """A vision encoder (exl2.models.vision: `encode(image)` → ImageEmbedding, and for towers that read videos
    `sample_video` and `encode_video`) with the alias ids of the images and videos it has encoded, keyed by their
    bytes."""

    def __init__(self, vision, first_alias: int):
        self.vision, self.aliases = vision, ImageAliases(first_alias)

    @classmethod
    def load(cls, model_dir, model, pan_and_scan: Optional[bool] = None) -> "VisionPrompts":
        """The vision tower of `model_dir` on `model`'s device and dtype, its aliases past `model`'s vocabulary; a
        ConfigError naming the model when it has none. `pan_and_scan` turns Gemma 3's crops on or off (None: as
        its processor config says)."""
        import dataclasses

        from exl2.models.vision import load_vision

        tower = load_vision(model_dir, model.device, model.dtype)
        if tower is None:
            raise no_vision(Path(model_dir).name, None)
        if pan_and_scan is not None:
            if not hasattr(tower, "crops"):
                raise ConfigError(f"Pan-and-scan is Gemma 3's; {Path(model_dir).name}'s vision tower has none.")
            tower.processing = dataclasses.replace(tower.processing, pan_and_scan=pan_and_scan)
        return cls(tower, model.spec.vocab_size)

    def image(self, source: Any) -> ImageTokens:
        """An image (a source `image_bytes` takes, or a decoded _Picture), encoded once per distinct content."""
        from exl2.models.vision import load_image

        if isinstance(source, _Picture):
            key, picture = source.key, source.image
        else:
            data = image_bytes(source)
            key, picture = image_key(data), None
        found = self.aliases.get(key)
        if found is not None:
            return found
        return self._add(key, self.vision.encode(picture if picture is not None else load_image(data)))

    def _pictures(self, source: Any) -> list[_Picture]:
        """An image source as the whole image and its pan-and-scan crops."""
        from exl2.models.vision import load_image

        data = image_bytes(source)
        key = image_key(data)
        image = load_image(data)
        return [_Picture(key, image)] + [_Picture(f"{key}:crop{i}", c) for i, c in enumerate(self.vision.crops(image))]

    def _add(self, key: str, emb) -> ImageTokens:
        return self.aliases.add(key, emb.token_ids, emb.image_token_id, emb.features, emb.grid, emb.deep,
                                emb.time_step)

    def video(self, source: Any, tokenizer) -> ImageTokens:
        """A video (VideoSource's forms), sampled and encoded once per distinct content."""
        from exl2.models.vision import load_image
        from exl2.models.vision.video import decode_video, video_from_frames

        if isinstance(source, (list, tuple)):
            if not source:
                raise ConfigError("The video has no frames.")
            frames = [image_bytes(f) for f in source]
            key = "frames:" + image_key(b"".join(image_key(f).encode() for f in frames))
            found = self.aliases.get(key)
            if found is not None:
                return found
            video = video_from_frames([load_image(f) for f in frames], self.vision.sample_video)
        else:
            data = image_bytes(source, "video", MAX_VIDEO_BYTES)
            key = "video:" + image_key(data)
            found = self.aliases.get(key)
            if found is not None:
                return found
            video = decode_video(data, self.vision.sample_video)
        return self._add(key, self.vision.encode_video(video, tokenizer))

    def prompt(self, text: str, tokenizer, sources: Sequence[Any]) -> tuple[list[int], tuple[ImageTokens, ...]]:
        """A rendered chat prompt with the template's image (or video) marker where each of `sources` goes,
        tokenized (after the text the model's processor adds around each marker, where it adds any: Gemma 3's
        newlines) and `_splice`d."""
        expand = getattr(self.vision, "expand_text", None)
        if expand is None:
            return self._splice(tokenizer.encode(text, add_bos=False), sources, tokenizer)
        if getattr(self.vision, "crops", None) is None or any(isinstance(s, VideoSource) for s in sources):
            return self._splice(tokenizer.encode(expand(text), add_bos=False), sources, tokenizer)
        pictures = [self._pictures(s) for s in sources]       # Gemma 3: pan-and-scan crops, when on
        if len(pictures) != text.count(self.vision.marker_text):
            raise ConfigError(f"The chat template placed {text.count(self.vision.marker_text)} image tokens for "
                              f"{len(pictures)} images; this template cannot show them.")
        text = expand(text, [len(p) - 1 for p in pictures])
        return self._splice(tokenizer.encode(text, add_bos=False), [p for ps in pictures for p in ps], tokenizer)

    def _splice(self, ids: Sequence[int], sources: Sequence[Any],
                tokenizer) -> tuple[list[int], tuple[ImageTokens, ...]]:
        """`ids` (a rendered prompt with the template's marker where each image or video goes, in order: [IMG] for
        Pixtral, <start_of_image> for Gemma 3, <|image_pad|> / <|video_pad|> for Qwen) with each replaced by its
        layout, and the images and videos."""
        spec = self.vision.spec
        if any(isinstance(s, VideoSource) for s in sources) and getattr(self.vision, "encode_video", None) is None:
            raise ConfigError("This model's vision tower reads still images only, not videos.")
        kinds = {spec.marker_id: "image", getattr(spec, "video_marker_id", None): "video"}
        marks = [i for i, t in enumerate(ids) if t in kinds]
        wanted = ["video" if isinstance(s, VideoSource) else "image" for s in sources]
        found = [kinds[ids[i]] for i in marks]
        if found != wanted:
            raise ConfigError(f"The chat template placed {_count(found)} for {_count(wanted)}; this template "
                              "cannot show them.")
        images = tuple(self.video(s.source, tokenizer) if isinstance(s, VideoSource) else self.image(s)
                       for s in sources)
        out: list[int] = []
        last = 0
        for at, image in zip(marks, images):
            out += ids[last:at]
            out += image.ids
            last = at + 1
        out += ids[last:]
        return out, images


def _count(kinds: Sequence[str]) -> str:
    """'2 images and 1 video'-style counts of a list of "image" / "video"."""
    words = [f"{n} {k}{'s' if n != 1 else ''}" for k in ("image", "video") if (n := kinds.count(k))]
    return " and ".join(words) or "no images"


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
