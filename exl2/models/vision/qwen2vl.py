"""The vision encoder of Qwen2-VL (Qwen2VLForConditionalGeneration) and Qwen2.5-VL
(Qwen2_5_VLForConditionalGeneration), in plain PyTorch, computing what transformers' `get_image_features` computes
for one still image.

Images keep their aspect ratio: each is resized so both sides are whole merged patches (28 px) and its area lies
within [min_pixels, max_pixels], so the number of image tokens varies with the image. A still image is repeated to
temporal_patch_size frames and cut into patches listed merge window by merge window (each 2×2 group of patches
together), which the Conv3d patch embedding turns into one row each. Pre-norm blocks attend bidirectionally with a
2-D rotary embedding (row and column positions) over the fused qkv; the merger normalizes, concatenates each 2×2
group and maps it through two linears into the text model's width. Qwen2-VL: LayerNorms and a quick-GELU MLP, every
block attending to the whole image. Qwen2.5-VL: RMSNorms and a SwiGLU MLP, and all blocks but fullatt_block_indexes
attend only within windows of window_size pixels (rows reordered window by window, and back after the merger).
Linears load through the decoder's WeightLoader, so EXL2 and GPTQ vision linears work as well as dense ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import PIL.Image
import torch
import torch.nn.functional as F
from torch import nn

from exl2.errors import ConfigError, ModelLoadError
from exl2.models.vision.image import DEFAULT_MEAN, DEFAULT_STD, PixelSettings, processor_config, setting
from exl2.models.vision.pixtral import ImageEmbedding, _activation, _int, _rotate, rms_norm, vision_parts
from exl2.models.vision.qwen_patches import merge_order, patchify, smart_resize
from exl2.models.vision.qwen_video import QwenVideoProcessing
from exl2.models.vision.video import Video
from exl2.runtime.weights import WeightLoader

KINDS = {"Qwen2VLForConditionalGeneration": "qwen2_vl", "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}
VISUAL = "visual"
NORM_EPS = 1e-6           # every norm of both towers hard-codes it
# Qwen2VLImageProcessor's class defaults (Qwen2.5-VL uses the same processor), used where its config is silent
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
DEFAULT_RESAMPLE = int(PIL.Image.Resampling.BICUBIC)
# the video processor's (qwen-vl-utils' frame bounds), used where the model directory has no video settings
DEFAULT_VIDEO = QwenVideoProcessing(min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28, patch=14, temporal_patch=2,
                                    merge=2, whole_video=False, resample=DEFAULT_RESAMPLE, mean=DEFAULT_MEAN,
                                    std=DEFAULT_STD)

Norm = tuple[torch.Tensor, Optional[torch.Tensor]]   # (weight, bias): a LayerNorm, or an RMSNorm when bias is None


@dataclass(frozen=True)
class QwenTowerSpec:
    """What the Qwen vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) share in config.json."""

    kind: str
    hidden: int
    intermediate: int
    heads: int
    layers: int
    patch: int
    temporal_patch: int
    merge: int                # spatial_merge_size: the merger joins merge × merge patches into one row
    channels: int
    act: str
    rope_theta: float
    text_hidden: int          # the merger's output width, the text model's hidden size
    image_token_id: int       # <|image_pad|>: one per feature row
    vision_start_id: int      # <|vision_start|>, before an image's <|image_pad|> tokens
    vision_end_id: int        # <|vision_end|>, after them
    video_token_id: int       # <|video_pad|>: one per feature row of a video

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def marker_id(self) -> int:
        """The token a chat template puts where an image goes: one <|image_pad|>, which the layout expands."""
        return self.image_token_id

    @property
    def video_marker_id(self) -> int:
        """The token a chat template puts where a video goes: one <|video_pad|>."""
        return self.video_token_id

    @staticmethod
    def read(cfg: dict, kinds: dict[str, str]) -> Optional[tuple[str, dict, dict, dict]]:
        """(kind, vision_config, the text model's keys, the fields every tower reads alike) of a model whose
        architecture is one of `kinds`; None for other models. Published Qwen2-VL files write the text keys at the
        top level, later ones (and transformers 5) under text_config; the token ids sit at the top level."""
        kind = next((kinds[a] for a in cfg.get("architectures") or [] if a in kinds), None)
        vision = cfg.get("vision_config")
        if kind is None or not isinstance(vision, dict):
            return None
        text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
        rope = vision.get("rope_parameters") or {}
        common = dict(
            kind=kind,
            heads=int(vision.get("num_heads", vision.get("num_attention_heads", 16))),
            temporal_patch=_int(vision.get("temporal_patch_size", 2), "temporal_patch_size"),
            merge=int(vision.get("spatial_merge_size", 2)),
            channels=int(vision.get("in_channels", 3)),
            rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))),
            image_token_id=_token_id(cfg, text, "image_token_id", 151655),
            vision_start_id=_token_id(cfg, text, "vision_start_token_id", 151652),
            vision_end_id=_token_id(cfg, text, "vision_end_token_id", 151653),
            video_token_id=_token_id(cfg, text, "video_token_id", 151656),
        )
        return kind, vision, text, common

    def _check(self, text_hidden: Optional[int]) -> None:
        """The shapes every tower needs: transformers would fail later (or feed the text model rows of another
        width)."""
        _activation(self.act)
        if self.hidden % self.heads:
            raise ConfigError(f"The vision hidden size {self.hidden} is not a multiple of its {self.heads} heads.")
        if self.head_dim % 4:
            raise ConfigError(f"The vision head size {self.head_dim} is not a multiple of 4, which the 2-D rotary "
                              "embedding needs.")
        if text_hidden is not None and int(text_hidden) != self.text_hidden:
            raise ConfigError(f"The vision merger outputs {self.text_hidden} features but the text model's hidden "
                              f"size is {text_hidden}.")


@dataclass(frozen=True)
class QwenVisionSpec(QwenTowerSpec):
    """Qwen2-VL's and Qwen2.5-VL's tower and merger (transformers' defaults for missing keys); kind "qwen2_vl" or
    "qwen2_5_vl"."""

    window_size: int          # Qwen2.5-VL's attention window side in pixels; 0: every block sees the whole image
    full_attention: tuple[int, ...]   # Qwen2.5-VL's fullatt_block_indexes: blocks that see the whole image
    tokens_per_second: Optional[float]   # Qwen2.5-VL: M-RoPE time positions a second of video; None: one a frame pair

    @property
    def window(self) -> int:
        """The attention window's side in merged patches (0: no windows)."""
        return self.window_size // (self.merge * self.patch)

    @classmethod
    def from_config(cls, cfg: dict) -> Optional["QwenVisionSpec"]:
        """The spec of a Qwen2-VL or Qwen2.5-VL model; None for other models."""
        found = cls.read(cfg, KINDS)
        if found is None:
            return None
        kind, vision, text, common = found
        if kind == "qwen2_vl":
            hidden = int(vision.get("embed_dim", 1280))
            shape = dict(hidden=hidden, intermediate=int(hidden * vision.get("mlp_ratio", 4)),
                         text_hidden=int(vision.get("hidden_size", 3584)), act=vision.get("hidden_act", "quick_gelu"),
                         window_size=0, full_attention=(), tokens_per_second=None)
        else:
            shape = dict(hidden=int(vision.get("hidden_size", 3584)),
                         intermediate=int(vision.get("intermediate_size", 3420)),
                         text_hidden=int(vision.get("out_hidden_size", 3584)), act=vision.get("hidden_act", "silu"),
                         window_size=int(vision.get("window_size", 112)),
                         full_attention=tuple(int(i) for i in vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
                         tokens_per_second=float(vision.get("tokens_per_second", 4)))
        spec = cls(layers=int(vision.get("depth", 32)), patch=_int(vision.get("patch_size", 14), "patch_size"),
                   **common, **shape)
        spec._check(text.get("hidden_size"))
        return spec

    def _check(self, text_hidden: Optional[int]) -> None:
        super()._check(text_hidden)
        if self.kind == "qwen2_5_vl" and self.window < 1:
            raise ConfigError(f"The vision window_size {self.window_size} is smaller than one merged patch "
                              f"({self.merge * self.patch} pixels).")


def _token_id(cfg: dict, text: dict, key: str, default: int) -> int:
    value = cfg.get(key, text.get(key))
    return default if value is None else int(value)


@dataclass(frozen=True)
class QwenImageProcessing(PixelSettings):
    """Qwen2VLImageProcessor's settings (PIL backend), for still images."""

    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> "QwenImageProcessing":
        """preprocessor_config.json (or processor_config.json's image_processor section). Published files name the
        area bounds min_pixels / max_pixels, transformers 5 size's shortest_edge / longest_edge; the former win, as
        in the processor's __init__."""
        cfg = processor_config(model_dir)
        size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
        return cls(min_pixels=int(setting(cfg, "min_pixels", setting(size, "shortest_edge", DEFAULT_MIN_PIXELS))),
                   max_pixels=int(setting(cfg, "max_pixels", setting(size, "longest_edge", DEFAULT_MAX_PIXELS))),
                   patch=_int(setting(cfg, "patch_size", 14), "patch_size"),
                   temporal_patch=_int(setting(cfg, "temporal_patch_size", 2), "temporal_patch_size"),
                   merge=int(setting(cfg, "merge_size", 2)),
                   **PixelSettings.read(cfg, DEFAULT_RESAMPLE, DEFAULT_MEAN, DEFAULT_STD))

    def check(self, spec: QwenVisionSpec) -> None:
        """The patches must be the tower's: its Conv3d and merger fix their sizes."""
        for what, ours, tower in (("patch_size", self.patch, spec.patch), ("merge_size", self.merge, spec.merge),
                                  ("temporal_patch_size", self.temporal_patch, spec.temporal_patch)):
            if ours != tower:
                raise ConfigError(f"The image processor's {what} is {ours} but the vision tower's is {tower}.")

    def __call__(self, image: PIL.Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(patches [t·h·w, C·temporal_patch·patch²] float32, in the processor's merge-window order; the grid
        (t, h, w) in patches), as Qwen2VLImageProcessor returns pixel_values and image_grid_thw."""
        height, width = smart_resize(image.height, image.width, self.patch * self.merge, self.min_pixels,
                                     self.max_pixels)
        return patchify(self.pixels(image, height, width)[None], self.patch, self.merge, self.temporal_patch)


def vision_rope(grid: tuple[int, int, int], merge: int, head_dim: int, theta: float,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [t·rows·cols, head_dim] float32 in the tower's row order for a grid (t, rows, cols) of patches: a
    quarter of the head turns with the patch's row, the next quarter with its column (same frequencies, from
    head_dim / 2), and the half repeats for rotate-half RoPE (Qwen2VLVisionRotaryEmbedding); every frame group
    alike."""
    t, rows, cols = grid
    half = head_dim // 2
    inv = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)
    index = merge_order(rows, cols, merge).to(device)
    angles = torch.cat([(index // cols).float()[:, None] * inv, (index % cols).float()[:, None] * inv], dim=-1)
    angles = torch.cat([angles, angles], dim=-1).repeat(t, 1)
    return angles.cos(), angles.sin()


def window_order(rows: int, cols: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Merged patches (rows × cols, row-major) regrouped window by window: (each one's row-major index, window after
    window, row-major within; the windows' sizes). Windows of window × window merged patches tile the grid
    row-major from the top left, so those at the right and bottom edges may be smaller."""
    grid = torch.arange(rows * cols).view(rows, cols)
    blocks = [grid[r:r + window, c:c + window].flatten() for r in range(0, rows, window)
              for c in range(0, cols, window)]
    return torch.cat(blocks), [b.numel() for b in blocks]


def _norm(w: WeightLoader, prefix: str, layer_norm: bool) -> Norm:
    return w.tensor(f"{prefix}.weight"), (w.tensor(f"{prefix}.bias") if layer_norm else None)


def _apply(norm: Norm, x: torch.Tensor) -> torch.Tensor:
    weight, bias = norm
    if bias is None:
        return rms_norm(x, weight, NORM_EPS)
    return F.layer_norm(x, x.shape[-1:], weight, bias, NORM_EPS)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE computed in float32 and cast back (apply_rotary_pos_emb_vision); x [n, heads, head_dim]."""
    return _rotate(x.float(), cos[:, None], sin[:, None]).to(x.dtype)


def span_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention within each consecutive span of `lengths` rows of q, k, v [n, heads, d] (scale
    head_dim ** -0.5): spans of one length go through one batched call, so a large image's hundreds of windows cost
    a few launches (they come in at most four lengths: whole windows, and those cut by the right and bottom edges)."""
    if len(lengths) == 1:
        return F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)
    starts: dict[int, list[int]] = {}
    at = 0
    for length in lengths:
        starts.setdefault(length, []).append(at)
        at += length
    out = torch.empty_like(q)
    for length, first in starts.items():
        rows = (torch.tensor(first)[:, None] + torch.arange(length)).flatten().to(q.device)
        batch = [t[rows].view(len(first), length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)]
        out[rows] = F.scaled_dot_product_attention(*batch).transpose(1, 2).reshape(-1, *q.shape[1:])
    return out


class _Block(nn.Module):
    """One vision block: x + attn(norm1(x)), then + mlp(norm2(x)); attention within each span of `lengths` rows.
    `mlp` names the two linears of the ungated MLP (Qwen3-VL's block is Qwen2-VL's with linear_fc1 / linear_fc2)."""

    def __init__(self, spec: QwenVisionSpec, w: WeightLoader, prefix: str, mlp: tuple[str, str] = ("fc1", "fc2")):
        super().__init__()
        h, inter = spec.hidden, spec.intermediate
        self.heads, self.act, self.gated = spec.heads, _activation(spec.act), spec.kind == "qwen2_5_vl"
        self.norm1 = _norm(w, f"{prefix}.norm1", not self.gated)
        self.norm2 = _norm(w, f"{prefix}.norm2", not self.gated)
        self.qkv = w.linear(f"{prefix}.attn.qkv", h, 3 * h, True)
        self.proj = w.linear(f"{prefix}.attn.proj", h, h, True)
        if self.gated:
            self.gate = w.linear(f"{prefix}.mlp.gate_proj", h, inter, True)
            self.up = w.linear(f"{prefix}.mlp.up_proj", h, inter, True)
            self.down = w.linear(f"{prefix}.mlp.down_proj", inter, h, True)
        else:
            self.fc1 = w.linear(f"{prefix}.mlp.{mlp[0]}", h, inter, True)
            self.fc2 = w.linear(f"{prefix}.mlp.{mlp[1]}", inter, h, True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n, h = x.shape
        q, k, v = self.qkv(_apply(self.norm1, x)).view(n, 3, self.heads, -1).unbind(1)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        x = x + self.proj(span_attention(q, k, v, lengths).reshape(n, h))
        y = _apply(self.norm2, x)
        if self.gated:
            return x + self.down(self.act(self.gate(y)) * self.up(y))
        return x + self.fc2(self.act(self.fc1(y)))


class _Merger(nn.Module):
    """ln_q, then each merge² consecutive rows concatenated → mlp.0 → GELU → mlp.2 (PatchMerger)."""

    def __init__(self, spec: QwenVisionSpec, w: WeightLoader):
        super().__init__()
        self.joined = joined = spec.hidden * spec.merge ** 2
        self.ln_q = _norm(w, f"{VISUAL}.merger.ln_q", spec.kind == "qwen2_vl")
        self.fc1 = w.linear(f"{VISUAL}.merger.mlp.0", joined, joined, True)
        self.fc2 = w.linear(f"{VISUAL}.merger.mlp.2", joined, spec.text_hidden, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(_apply(self.ln_q, x).view(-1, self.joined))))


class QwenVision:
    """A Qwen2-VL or Qwen2.5-VL vision tower with its merger: PIL image or video → one embedding row per merged
    patch."""

    def __init__(self, spec: QwenVisionSpec, weights: WeightLoader, processing: QwenImageProcessing,
                 video: QwenVideoProcessing = DEFAULT_VIDEO):
        video.check(spec)
        self.spec, self.processing, self.video_processing = spec, processing, video
        self.device, self.dtype = weights.device, weights.dtype
        name = f"{VISUAL}.patch_embed.proj.weight"
        conv = weights.tensor(name)
        shape = (spec.hidden, spec.channels, spec.temporal_patch, spec.patch, spec.patch)
        if tuple(conv.shape) != shape:
            raise ModelLoadError(f"{name} has shape {tuple(conv.shape)}, expected {shape}.")
        self.patch_embed = conv.reshape(spec.hidden, -1)     # Conv3d with kernel = stride = one patch: a matmul
        self.blocks = [_Block(spec, weights, f"{VISUAL}.blocks.{i}") for i in range(spec.layers)]
        self.merger = _Merger(spec, weights)

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float16,
                 tokenizer: Optional[object] = None) -> Optional["QwenVision"]:
        """The vision encoder of `model_dir`, or None when its config.json describes no Qwen2-VL / Qwen2.5-VL model
        or its files hold no vision tower (a text-only export). `tokenizer` is accepted for the signature the other
        towers share: the layout needs only config.json's <|image_pad|> id."""
        d = Path(model_dir)
        found = vision_parts(d, QwenVisionSpec, (VISUAL,))
        if found is None:
            return None
        spec, tensors = found
        processing = QwenImageProcessing.from_dir(d)
        processing.check(spec)
        video = QwenVideoProcessing.from_dir(d, DEFAULT_VIDEO)
        return cls(spec, WeightLoader(tensors, device, dtype), processing, video)

    def preprocess(self, image: PIL.Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(patches [t·h·w, C·temporal_patch·patch²] float32, grid (t, h, w) in patches): Qwen2VLImageProcessor's
        pixel_values and image_grid_thw."""
        return self.processing(image)

    def _tower(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """[t·h·w / merge², text_hidden] for one image's or video's patches (in the tower's dtype and device):
        merged patches row-major, frame group after frame group. Each frame group attends only within itself."""
        s = self.spec
        t, rows, cols = grid
        unit = s.merge ** 2
        x = patches @ self.patch_embed.t()
        cos, sin = vision_rope(grid, s.merge, s.head_dim, s.rope_theta, self.device)
        whole = windows = [rows * cols] * t    # attention spans: each frame group; Qwen2.5-VL's windows in each
        if s.window:
            merged, sizes = window_order(rows // s.merge, cols // s.merge, s.window)
            frame = rows * cols // unit
            merged = (torch.arange(t)[:, None] * frame + merged).flatten()
            order = (merged[:, None] * unit + torch.arange(unit)).flatten().to(self.device)
            x, cos, sin = x[order], cos[order], sin[order]
            windows = [n * unit for n in sizes] * t
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, whole if i in s.full_attention else windows)
        out = self.merger(x)
        if s.window:
            out = torch.empty_like(out).index_copy_(0, merged.to(self.device), out)
        return out

    @torch.inference_mode()
    def encode(self, image: PIL.Image.Image) -> ImageEmbedding:
        """The image's embedding rows, its <|image_pad|> tokens (what the processor expands the marker into) and
        the merged grid (t, h / merge, w / merge) for the text model's M-RoPE."""
        patches, grid = self.preprocess(image)
        features = self._tower(patches.to(device=self.device, dtype=self.dtype), grid)
        t, rows, cols = grid
        ids = [self.spec.image_token_id] * features.shape[0]
        return ImageEmbedding(features, ids, self.spec.image_token_id, (t, rows // self.spec.merge,
                                                                         cols // self.spec.merge))

    def sample_video(self, total: int, fps: Optional[float]) -> list[int]:
        """The frames of a `total`-frame video at `fps` (None: already sampled) the tower reads."""
        return self.video_processing.sample(total, fps)

    @torch.inference_mode()
    def encode_video(self, video: Video, tokenizer: Optional[object] = None) -> ImageEmbedding:
        """The video's embedding rows (frame group after frame group), its <|video_pad|> tokens, the merged grid
        (t, h / merge, w / merge) and the M-RoPE time positions between frame groups: Qwen2.5-VL's
        tokens_per_second × the seconds a group spans, Qwen2-VL's one."""
        patches, grid = self.video_processing(video)
        features = self._tower(patches.to(device=self.device, dtype=self.dtype), grid)
        t, rows, cols = grid
        s = self.spec
        step = 1.0 if s.tokens_per_second is None else s.tokens_per_second * self.video_processing.group_seconds(video)
        return ImageEmbedding(features, [s.video_token_id] * features.shape[0], s.video_token_id,
                              (t, rows // s.merge, cols // s.merge), time_step=step)
