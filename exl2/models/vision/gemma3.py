"""The vision encoder of Gemma 3 (Gemma3ForConditionalGeneration): a SigLIP tower and the Gemma 3 projector, in plain
PyTorch, computing what transformers' `get_image_features` computes for one image.

Every image is resized to the tower's one square size (896 px in the published models), so every image costs the
same mm_tokens_per_image (256) soft tokens. With pan-and-scan on (do_pan_and_scan, off in the published processor
configs), an image much wider or taller than square is also cut into 2 to 4 crops along its long side, each read
as an image of its own after the whole, as Gemma3Processor lays them out. Tower: a patch Conv2d (with bias) plus
a learned position embedding per patch, pre-norm layers (LayerNorm, bidirectional attention with biased
projections, LayerNorm, fc1 → gelu → fc2), then post_layernorm; SigLIP's attention-pooling head, if the files hold one, is unused. Projector: the patch grid
average-pooled to tokens_per_side², Gemma's RMSNorm (x · (1 + w)), then one matrix into the text model's width.
Linears load through the decoder's WeightLoader, so EXL2 and GPTQ vision linears work as well as dense ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

import PIL.Image
import torch
import torch.nn.functional as F
from torch import nn

from exl2.errors import ConfigError, ModelLoadError
from exl2.models.vision.image import PixelSettings, processor_config, setting
from exl2.models.vision.pixtral import (PROJECTOR, TOWER, ImageEmbedding, VisionTensors, _activation, _int,
                                        vision_parts)
from exl2.runtime.weights import WeightLoader

# Gemma3ImageProcessor's class defaults, used where the preprocessor config is silent
DEFAULT_MEAN = DEFAULT_STD = (0.5, 0.5, 0.5)
DEFAULT_RESAMPLE = int(PIL.Image.Resampling.BILINEAR)


@dataclass(frozen=True)
class Gemma3VisionSpec:
    """What config.json says about the tower and projector (transformers' defaults for missing keys)."""

    hidden: int
    intermediate: int
    heads: int
    layers: int
    image_size: int           # the one square side every image is resized to
    patch: int
    channels: int
    act: str
    eps: float                # layer_norm_eps: the tower's LayerNorms and the projector's RMSNorm
    text_hidden: int
    mm_tokens_per_image: int
    image_token_id: int       # <image_soft_token>: one per feature row
    marker_id: int            # <start_of_image>: what the chat template writes where an image goes
    end_id: int               # <end_of_image>

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch

    @property
    def pool(self) -> int:
        """The average pool's kernel and stride (Gemma3MultiModalProjector's kernel_size)."""
        return self.patches_per_side // int(self.mm_tokens_per_image ** 0.5)

    @classmethod
    def from_config(cls, cfg: dict) -> Optional["Gemma3VisionSpec"]:
        """The spec of a Gemma3ForConditionalGeneration with a vision tower; None for other models."""
        vision, text = cfg.get("vision_config"), cfg.get("text_config") or {}
        if "Gemma3ForConditionalGeneration" not in (cfg.get("architectures") or []) or not isinstance(vision, dict):
            return None
        spec = cls(
            hidden=int(vision.get("hidden_size", 768)),
            intermediate=int(vision.get("intermediate_size", 3072)),
            heads=int(vision.get("num_attention_heads", 12)),
            layers=int(vision.get("num_hidden_layers", 12)),
            image_size=_int(vision.get("image_size", 224), "image_size"),
            patch=_int(vision.get("patch_size", 16), "patch_size"),
            channels=int(vision.get("num_channels", 3)),
            act=vision.get("hidden_act", "gelu_pytorch_tanh"),
            eps=float(vision.get("layer_norm_eps", 1e-6)),
            text_hidden=int(text.get("hidden_size", 2304)),
            mm_tokens_per_image=int(cfg.get("mm_tokens_per_image", 256)),
            image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 262144))),
            marker_id=int(cfg.get("boi_token_index", cfg.get("boi_token_id", 255999))),
            end_id=int(cfg.get("eoi_token_index", cfg.get("eoi_token_id", 256000))),
        )
        spec._check()
        return spec

    def _check(self) -> None:
        """The shapes the projector needs: transformers would fail later (or feed the wrong number of rows)."""
        _activation(self.act)
        if self.hidden % self.heads:
            raise ConfigError(f"The vision hidden size {self.hidden} is not a multiple of its {self.heads} heads.")
        side = math.isqrt(self.mm_tokens_per_image)
        if side < 1 or side * side != self.mm_tokens_per_image or self.pool < 1 \
                or (self.patches_per_side // self.pool) ** 2 != self.mm_tokens_per_image:
            raise ConfigError(f"mm_tokens_per_image {self.mm_tokens_per_image} is not an average pool of the "
                              f"{self.patches_per_side}×{self.patches_per_side} patch grid.")


def _square(size, image_size: int) -> int:
    """The preprocessor's `size` ({"height": h, "width": w} or an int) as one side; the tower's when unset."""
    if isinstance(size, dict) and (size.get("height") or size.get("width")):
        side = size.get("height") or size.get("width")
        if size.get("width", side) != side:
            raise ConfigError(f"The Gemma 3 image processor's size {size} is not square.")
        return int(side)
    return int(size) if isinstance(size, int) and size > 0 else image_size


@dataclass(frozen=True)
class Gemma3ImageProcessing(PixelSettings):
    """Gemma3ImageProcessor's settings (PIL backend), pan-and-scan's included (off unless the config or the user
    turns it on, as Gemma3Processor leaves it)."""

    size: int
    pan_and_scan: bool = False
    min_crop: int = 256          # pan_and_scan_min_crop_size: no crop narrower
    max_crops: int = 4           # pan_and_scan_max_num_crops
    min_ratio: float = 1.2       # pan_and_scan_min_ratio_to_activate: the aspect ratio from which images are cut

    @classmethod
    def from_dir(cls, model_dir: Path | str, image_size: int) -> "Gemma3ImageProcessing":
        """preprocessor_config.json (or processor_config.json's image_processor section); its size must be the
        tower's image_size, which position embeddings fix."""
        cfg = processor_config(model_dir)
        size = _square(cfg.get("size"), image_size)
        if size != image_size:
            raise ConfigError(f"The image processor resizes to {size} pixels but the vision tower takes {image_size}.")
        return cls(size=size, pan_and_scan=bool(setting(cfg, "do_pan_and_scan", False)),
                   min_crop=int(setting(cfg, "pan_and_scan_min_crop_size", 256)),
                   max_crops=int(setting(cfg, "pan_and_scan_max_num_crops", 4)),
                   min_ratio=float(setting(cfg, "pan_and_scan_min_ratio_to_activate", 1.2)),
                   **PixelSettings.read(cfg, DEFAULT_RESAMPLE, DEFAULT_MEAN, DEFAULT_STD))

    def __call__(self, image: PIL.Image.Image) -> torch.Tensor:
        """[3, size, size] float32 pixel values (aspect ratio not kept, as transformers does it)."""
        return self.pixels(image, self.size, self.size)

    def crops(self, image: PIL.Image.Image) -> list[PIL.Image.Image]:
        """Pan-and-scan's crops of `image` (none when it is off, the image is near square, or crops would be
        narrower than min_crop): as many as the aspect ratio rounds to, 2 to max_crops, side by side along the
        long side (Gemma3ImageProcessor.pan_and_scan)."""
        if not self.pan_and_scan:
            return []
        width, height = image.size
        long, short = max(width, height), min(width, height)
        if long / short < self.min_ratio:
            return []
        count = min(int(math.floor(long / short + 0.5)), int(math.floor(long / self.min_crop)))
        count = min(self.max_crops, max(2, count))
        across, down = (count, 1) if width >= height else (1, count)
        crop_w, crop_h = math.ceil(width / across), math.ceil(height / down)
        if min(crop_w, crop_h) < self.min_crop:
            return []
        return [image.crop((x, y, min(x + crop_w, width), min(y + crop_h, height)))
                for y in range(0, crop_h * down, crop_h) for x in range(0, crop_w * across, crop_w)]


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalized and scaled by (1 + w) in float32, then cast back (Gemma3RMSNorm)."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


class _Layer(nn.Module):
    """One SigLIP encoder layer: x + attention(layer_norm1(x)), then + mlp(layer_norm2(x))."""

    def __init__(self, spec: Gemma3VisionSpec, w: WeightLoader, prefix: str):
        super().__init__()
        h, inter = spec.hidden, spec.intermediate
        self.heads, self.eps, self.act = spec.heads, spec.eps, _activation(spec.act)
        self.norm1 = (w.tensor(f"{prefix}.layer_norm1.weight"), w.tensor(f"{prefix}.layer_norm1.bias"))
        self.norm2 = (w.tensor(f"{prefix}.layer_norm2.weight"), w.tensor(f"{prefix}.layer_norm2.bias"))
        self.q, self.k, self.v, self.o = (w.linear(f"{prefix}.self_attn.{n}_proj", h, h, True)
                                          for n in ("q", "k", "v", "out"))
        self.fc1 = w.linear(f"{prefix}.mlp.fc1", h, inter, True)
        self.fc2 = w.linear(f"{prefix}.mlp.fc2", inter, h, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, h = x.shape
        y = F.layer_norm(x, (h,), *self.norm1, self.eps)
        q, k, v = (lin(y).view(n, self.heads, -1).transpose(0, 1) for lin in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q[None], k[None], v[None])    # scale head_dim ** -0.5, as SigLIP's
        x = x + self.o(a[0].transpose(0, 1).reshape(n, h))
        y = F.layer_norm(x, (h,), *self.norm2, self.eps)
        return x + self.fc2(self.act(self.fc1(y)))


def _tower_prefix(tensors: VisionTensors) -> str:
    """SigLIP's tensors sit under vision_tower.vision_model.* in the published files, but directly under
    vision_tower.* where transformers 5 saved them."""
    nested = f"{TOWER}.vision_model"
    return nested if f"{nested}.embeddings.patch_embedding.weight" in tensors else TOWER


class TokenPieces(Protocol):
    def id_to_piece(self, token_id: int) -> Optional[str]: ...


class Gemma3Vision:
    """A SigLIP vision tower with Gemma 3's projector: PIL image → mm_tokens_per_image embedding rows."""

    def __init__(self, spec: Gemma3VisionSpec, weights: WeightLoader, prefix: str,
                 processing: Gemma3ImageProcessing, marker_text: str):
        self.spec, self.processing, self.marker_text = spec, processing, marker_text
        self.device, self.dtype = weights.device, weights.dtype
        emb = f"{prefix}.embeddings"
        conv = weights.tensor(f"{emb}.patch_embedding.weight")
        if tuple(conv.shape) != (spec.hidden, spec.channels, spec.patch, spec.patch):
            raise ModelLoadError(f"{emb}.patch_embedding.weight has shape {tuple(conv.shape)}, expected "
                                 f"{(spec.hidden, spec.channels, spec.patch, spec.patch)}.")
        self.patch_conv, self.patch_bias = conv, weights.tensor(f"{emb}.patch_embedding.bias")
        self.positions = weights.tensor(f"{emb}.position_embedding.weight")
        if tuple(self.positions.shape) != (spec.patches_per_side ** 2, spec.hidden):
            raise ModelLoadError(f"{emb}.position_embedding.weight has shape {tuple(self.positions.shape)}, "
                                 f"expected {(spec.patches_per_side ** 2, spec.hidden)}.")
        self.layers = [_Layer(spec, weights, f"{prefix}.encoder.layers.{i}") for i in range(spec.layers)]
        self.post_norm = (weights.tensor(f"{prefix}.post_layernorm.weight"),
                          weights.tensor(f"{prefix}.post_layernorm.bias"))
        self.soft_emb_norm = weights.tensor(f"{PROJECTOR}.mm_soft_emb_norm.weight")
        self.projection = weights.tensor(f"{PROJECTOR}.mm_input_projection_weight")
        if tuple(self.projection.shape) != (spec.hidden, spec.text_hidden):
            raise ModelLoadError(f"{PROJECTOR}.mm_input_projection_weight has shape {tuple(self.projection.shape)}, "
                                 f"expected {(spec.hidden, spec.text_hidden)}.")

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float16,
                 tokenizer: Optional[TokenPieces] = None) -> Optional["Gemma3Vision"]:
        """The vision encoder of `model_dir`, or None when its config.json describes no Gemma 3 vision model or
        its files hold no vision tower (a text-only export). `tokenizer` (default: the directory's) spells the
        <start_of_image> marker, which `expand_text` finds in a rendered prompt."""
        d = Path(model_dir)
        found = vision_parts(d, Gemma3VisionSpec)
        if found is None:
            return None
        spec, tensors = found
        if tokenizer is None:
            from exl2.generation.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_dir(d)
        processing = Gemma3ImageProcessing.from_dir(d, spec.image_size)
        marker = tokenizer.id_to_piece(spec.marker_id)
        if not marker:
            raise ModelLoadError(f"The tokenizer in {d} has no token {spec.marker_id} (<start_of_image>), which "
                                 "images need.")
        return cls(spec, WeightLoader(tensors, device, dtype), _tower_prefix(tensors), processing, marker)

    def preprocess(self, image: PIL.Image.Image) -> torch.Tensor:
        """[3, S, S] float32 normalized pixels (transformers' Gemma3ImageProcessor, no pan-and-scan)."""
        return self.processing(image)

    def crops(self, image: PIL.Image.Image) -> list[PIL.Image.Image]:
        """The image's pan-and-scan crops (none when pan-and-scan is off): each is read as an image of its own."""
        return self.processing.crops(image)

    def expand_text(self, text: str, crops: Optional[list[int]] = None) -> str:
        """A rendered prompt with "\\n\\n" on both sides of each <start_of_image>, as Gemma3Processor writes it
        before tokenizing: the tokenizer may merge them with the prompt's own newlines around the marker. An image
        with pan-and-scan crops (`crops`: the count for each marker in order) becomes the processor's "Here is the
        original image ... and here are some crops to help you see better ..." with one marker per crop."""
        one = f"\n\n{self.marker_text}\n\n"
        parts = text.split(self.marker_text)
        out = [parts[0]]
        for i, rest in enumerate(parts[1:]):
            n = crops[i] if crops else 0
            if n:
                out.append(f"Here is the original image {one} and here are some crops to help you see better "
                           + " ".join([one] * n))
            else:
                out.append(one)
            out.append(rest)
        return "".join(out)

    def token_layout(self) -> list[int]:
        """The tokens of one image in place of <start_of_image> (its "\\n\\n"s are text: `expand_text`):
        <start_of_image> <image_soft_token> × mm_tokens_per_image <end_of_image>."""
        s = self.spec
        return [s.marker_id, *[s.image_token_id] * s.mm_tokens_per_image, s.end_id]

    def _tower(self, pixels: torch.Tensor) -> torch.Tensor:
        """post_layernorm(last layer's output): [patches, hidden] for pixels [3, S, S], patches row-major."""
        x = F.conv2d(pixels[None], self.patch_conv, self.patch_bias, stride=self.spec.patch)[0].flatten(1).t()
        x = x + self.positions
        for layer in self.layers:
            x = layer(x)
        return F.layer_norm(x, (self.spec.hidden,), *self.post_norm, self.spec.eps)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """[patches, hidden] → [mm_tokens_per_image, text_hidden] (Gemma3MultiModalProjector)."""
        side = self.spec.patches_per_side
        grid = x.t().reshape(1, self.spec.hidden, side, side)
        pooled = F.avg_pool2d(grid, self.spec.pool)[0].flatten(1).t()
        return gemma_rms_norm(pooled, self.soft_emb_norm, self.spec.eps) @ self.projection

    @torch.inference_mode()
    def encode(self, image: PIL.Image.Image) -> ImageEmbedding:
        """The image's embedding rows and token layout."""
        pixels = self.preprocess(image).to(device=self.device, dtype=self.dtype)
        features = self._project(self._tower(pixels))
        return ImageEmbedding(features, self.token_layout(), self.spec.image_token_id)
