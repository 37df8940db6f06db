"""The vision encoder of Qwen3-VL (Qwen3VLForConditionalGeneration, and Qwen3VLMoeForConditionalGeneration, whose
tower is the same), in plain PyTorch, computing what transformers' `get_image_features` computes for one still image:
the merger's rows and the DeepStack rows.

Mostly Qwen2-VL's tower. The Conv3d patch embedding has a bias, and a learned square table of position embeddings,
bilinearly resampled (corners aligned) to the image's patch grid, is added to it. Blocks are Qwen2-VL's
(LayerNorms, fused qkv, 2-D rotary embedding, full attention; a gelu-tanh MLP named linear_fc1 / linear_fc2), reused
from qwen2vl.py. Besides the final merger (LayerNorm per patch, then each 2×2 group joined through two linears),
DeepStack mergers turn the hidden state after each of deepstack_visual_indexes' blocks into rows of the text width
(LayerNorm after joining the group), which the text model adds to its first layers' outputs at the image tokens.
Preprocessing is Qwen2-VL's (transformers runs Qwen2VLImageProcessor for Qwen3-VL) with 16-pixel patches.
Linears load through the decoder's WeightLoader, so EXL2 and GPTQ vision linears work as well as dense ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import PIL.Image
import torch
import torch.nn.functional as F
from torch import nn

from exl2.errors import ConfigError, ModelLoadError
from exl2.models.vision.image import processor_config
from exl2.models.vision.pixtral import ImageEmbedding, _int, vision_parts
from exl2.models.vision.qwen2vl import (DEFAULT_RESAMPLE, QwenImageProcessing, QwenTowerSpec, _apply, _Block, _norm,
                                        vision_rope)
from exl2.models.vision.qwen_patches import merge_order
from exl2.models.vision.qwen_video import QwenVideoProcessing
from exl2.models.vision.video import Video
from exl2.runtime.weights import WeightLoader

KINDS = {"Qwen3VLForConditionalGeneration": "qwen3_vl", "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe"}
VISUAL = "visual"
# Qwen3-VL's published preprocessor_config.json, used where the model directory has none: transformers' class,
# Qwen2VLImageProcessor, would default to Qwen2-VL's 14-pixel patches and CLIP mean / std, which the tower rejects
PUBLISHED_MIN_PIXELS = 65536          # size.shortest_edge
PUBLISHED_MAX_PIXELS = 16777216       # size.longest_edge
PUBLISHED_MEAN = PUBLISHED_STD = (0.5, 0.5, 0.5)
# its published video_preprocessor_config.json: the area bound is the whole video's, at most 768 merged patches a frame
PUBLISHED_VIDEO = QwenVideoProcessing(min_pixels=4096, max_pixels=25165824, patch=16, temporal_patch=2, merge=2,
                                      whole_video=True, max_video_tokens=768, resample=DEFAULT_RESAMPLE,
                                      mean=PUBLISHED_MEAN, std=PUBLISHED_STD)


@dataclass(frozen=True)
class Qwen3VisionSpec(QwenTowerSpec):
    """Qwen3-VL's tower and mergers (Qwen3VLVisionConfig's defaults for missing keys); kind "qwen3_vl" or
    "qwen3_vl_moe"."""

    positions: int            # num_position_embeddings: the learned table, a square grid of that many patches
    deepstack: tuple[int, ...]   # deepstack_visual_indexes: blocks whose output feeds DeepStack merger i

    @property
    def side(self) -> int:
        """The position table's side in patches."""
        return math.isqrt(self.positions)

    @classmethod
    def from_config(cls, cfg: dict) -> Optional["Qwen3VisionSpec"]:
        """The spec of a Qwen3-VL or Qwen3-VL-MoE model; None for other models."""
        found = cls.read(cfg, KINDS)
        if found is None:
            return None
        _, vision, text, common = found
        spec = cls(
            hidden=int(vision.get("hidden_size", 1152)),
            intermediate=int(vision.get("intermediate_size", 4304)),
            layers=int(vision.get("depth", 27)),
            patch=_int(vision.get("patch_size", 16), "patch_size"),
            act=vision.get("hidden_act", "gelu_pytorch_tanh"),
            positions=int(vision.get("num_position_embeddings", 2304)),
            deepstack=tuple(int(i) for i in vision.get("deepstack_visual_indexes", (8, 16, 24))),
            text_hidden=int(vision.get("out_hidden_size", 3584)),
            **common,
        )
        spec._check(text.get("hidden_size"))
        return spec

    def _check(self, text_hidden: Optional[int]) -> None:
        """Besides every tower's shapes: a square position table and DeepStack blocks the tower has (transformers
        would take the table's integer root, or drop DeepStack rows)."""
        super()._check(text_hidden)
        if self.positions < 1 or self.side ** 2 != self.positions:
            raise ConfigError(f"The vision num_position_embeddings {self.positions} is not a square grid.")
        if len(set(self.deepstack)) != len(self.deepstack) or not all(0 <= i < self.layers for i in self.deepstack):
            raise ConfigError(f"The deepstack_visual_indexes {list(self.deepstack)} are not distinct blocks of the "
                              f"{self.layers}-block vision tower.")


def image_processing(model_dir: Path | str, spec: Qwen3VisionSpec) -> QwenImageProcessing:
    """The directory's image processor settings (read as Qwen2VLImageProcessor reads them), or Qwen3-VL's published
    ones when it has none; their patches must be the tower's."""
    if processor_config(model_dir):
        processing = QwenImageProcessing.from_dir(model_dir)
    else:
        processing = QwenImageProcessing(min_pixels=PUBLISHED_MIN_PIXELS, max_pixels=PUBLISHED_MAX_PIXELS,
                                         patch=spec.patch, temporal_patch=spec.temporal_patch, merge=spec.merge,
                                         resample=DEFAULT_RESAMPLE, mean=PUBLISHED_MEAN, std=PUBLISHED_STD)
    processing.check(spec)
    return processing


def _taps(pos: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table positions (along one axis) that patch positions `pos` of `size` interpolate between, and their
    weights: corners aligned, so the first and last patches sit on the table's first and last entries."""
    src = pos.float() * (side - 1) / max(size - 1, 1)
    low = src.floor()
    dist = (src - low)[:, None] - torch.tensor([0.0, 1.0])
    taps = (low.long()[:, None] + torch.tensor([0, 1])).clamp(max=side - 1)
    return taps, 1 - dist.abs()


def position_taps(rows: int, cols: int, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [rows·cols, 4] into the flattened side × side position table, weight [rows·cols, 4] float32) in the
    tower's row order: each patch's bilinear blend of the table resampled to rows × cols."""
    order = merge_order(rows, cols, merge)
    r_taps, r_weights = _taps(order // cols, rows, side)
    c_taps, c_weights = _taps(order % cols, cols, side)
    index = (r_taps[:, :, None] * side + c_taps[:, None, :]).flatten(1)
    return index, (r_weights[:, :, None] * c_weights[:, None, :]).flatten(1)


class _Merger(nn.Module):
    """LayerNorm, each merge² consecutive rows joined → linear_fc1 → GELU → linear_fc2 (a Qwen3-VL patch merger).
    The main merger normalizes each patch before joining, DeepStack's (`joined_norm`) the joined row."""

    def __init__(self, spec: Qwen3VisionSpec, w: WeightLoader, prefix: str, joined_norm: bool):
        super().__init__()
        self.joined, self.joined_norm = spec.hidden * spec.merge ** 2, joined_norm
        self.norm = _norm(w, f"{prefix}.norm", True)
        self.fc1 = w.linear(f"{prefix}.linear_fc1", self.joined, self.joined, True)
        self.fc2 = w.linear(f"{prefix}.linear_fc2", self.joined, spec.text_hidden, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _apply(self.norm, x.view(-1, self.joined)) if self.joined_norm else _apply(self.norm, x)
        return self.fc2(F.gelu(self.fc1(x.view(-1, self.joined))))


class Qwen3Vision:
    """A Qwen3-VL vision tower with its mergers: PIL image → one embedding row per merged patch, plus the DeepStack
    rows."""

    def __init__(self, spec: Qwen3VisionSpec, weights: WeightLoader, processing: QwenImageProcessing,
                 video: QwenVideoProcessing = PUBLISHED_VIDEO):
        video.check(spec)
        self.spec, self.processing, self.video_processing = spec, processing, video
        self.device, self.dtype = weights.device, weights.dtype
        conv = (spec.hidden, spec.channels, spec.temporal_patch, spec.patch, spec.patch)
        shapes = {"patch_embed.proj.weight": conv, "patch_embed.proj.bias": (spec.hidden,),
                  "pos_embed.weight": (spec.positions, spec.hidden)}
        loaded = {}
        for name, shape in shapes.items():
            loaded[name] = weights.tensor(f"{VISUAL}.{name}")
            if tuple(loaded[name].shape) != shape:
                raise ModelLoadError(f"{VISUAL}.{name} has shape {tuple(loaded[name].shape)}, expected {shape}.")
        # Conv3d with kernel = stride = one patch: a matmul
        self.patch_embed = loaded["patch_embed.proj.weight"].reshape(spec.hidden, -1)
        self.patch_bias = loaded["patch_embed.proj.bias"]
        self.pos_embed = loaded["pos_embed.weight"]
        names = ("linear_fc1", "linear_fc2")
        self.blocks = [_Block(spec, weights, f"{VISUAL}.blocks.{i}", names) for i in range(spec.layers)]
        self.merger = _Merger(spec, weights, f"{VISUAL}.merger", False)
        self.deep_mergers = [_Merger(spec, weights, f"{VISUAL}.deepstack_merger_list.{i}", True)
                             for i in range(len(spec.deepstack))]

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float16,
                 tokenizer: Optional[object] = None) -> Optional["Qwen3Vision"]:
        """The vision encoder of `model_dir`, or None when its config.json describes no Qwen3-VL model or its files
        hold no vision tower (a text-only export). `tokenizer` is accepted for the signature the other towers
        share: the layout needs only config.json's <|image_pad|> id."""
        d = Path(model_dir)
        found = vision_parts(d, Qwen3VisionSpec, (VISUAL,))
        if found is None:
            return None
        spec, tensors = found
        video = QwenVideoProcessing.from_dir(d, PUBLISHED_VIDEO)
        return cls(spec, WeightLoader(tensors, device, dtype), image_processing(d, spec), video)

    def preprocess(self, image: PIL.Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(patches [t·h·w, C·temporal_patch·patch²] float32, grid (t, h, w) in patches): the pixel_values and
        image_grid_thw of Qwen2VLImageProcessor, the processor transformers runs for Qwen3-VL."""
        return self.processing(image)

    def _tower(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> tuple[torch.Tensor, tuple]:
        """(merger rows [t·h·w / merge², text_hidden], DeepStack rows like them, in block order) for one image's or
        video's patches (in the tower's dtype and device): merged patches row-major, frame group after frame group,
        each group attending only within itself."""
        s = self.spec
        t, rows, cols = grid
        x = patches @ self.patch_embed.t() + self.patch_bias
        index, weight = position_taps(rows, cols, s.side, s.merge)
        blend = self.pos_embed[index.to(self.device)].float() * weight.to(self.device)[..., None]
        x = x + blend.sum(1).to(x.dtype).repeat(t, 1)
        cos, sin = vision_rope(grid, s.merge, s.head_dim, s.rope_theta, self.device)
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, [rows * cols] * t)
            if i in s.deepstack:
                deep.append(self.deep_mergers[s.deepstack.index(i)](x))
        return self.merger(x), tuple(deep)

    @torch.inference_mode()
    def encode(self, image: PIL.Image.Image) -> ImageEmbedding:
        """The image's embedding rows and DeepStack rows, its <|image_pad|> tokens (what the processor expands the
        marker into) and the merged grid (t, h / merge, w / merge) for the text model's M-RoPE."""
        patches, grid = self.preprocess(image)
        features, deep = self._tower(patches.to(device=self.device, dtype=self.dtype), grid)
        t, rows, cols = grid
        m = self.spec.merge
        ids = [self.spec.image_token_id] * features.shape[0]
        return ImageEmbedding(features, ids, self.spec.image_token_id, (t, rows // m, cols // m), deep)

    def sample_video(self, total: int, fps: Optional[float]) -> list[int]:
        """The frames of a `total`-frame video at `fps` (None: already sampled) the tower reads."""
        return self.video_processing.sample(total, fps)

    @torch.inference_mode()
    def encode_video(self, video: Video, tokenizer) -> ImageEmbedding:
        """The video's embedding rows and DeepStack rows (frame group after frame group), and its tokens as
        Qwen3VLProcessor lays them out: per frame group "<t seconds>" (tokenized with `tokenizer`), then
        <|vision_start|>, its <|video_pad|> tokens and <|vision_end|>; the merged grid (t, h / merge, w / merge).
        Set apart by the text between them, each group takes its M-RoPE places as a one-frame image would."""
        patches, grid = self.video_processing(video)
        features, deep = self._tower(patches.to(device=self.device, dtype=self.dtype), grid)
        t, rows, cols = grid
        s = self.spec
        frame = [s.vision_start_id] + [s.video_token_id] * (rows * cols // s.merge ** 2) + [s.vision_end_id]
        ids = []
        for second in self.video_processing.seconds(video):
            ids += tokenizer.encode(f"<{second:.1f} seconds>", add_bos=False) + frame
        return ImageEmbedding(features, ids, s.video_token_id, (t, rows // s.merge, cols // s.merge), deep)
