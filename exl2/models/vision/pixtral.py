"""The vision encoder of Mistral 3.1 / 3.2 (Mistral3ForConditionalGeneration): a Pixtral tower and the Mistral 3
projector, in plain PyTorch, computing what transformers' `get_image_features` computes for one image.

Tower: a patch Conv2d (no bias), RMSNorm (ln_pre), then pre-norm layers of bidirectional attention with 2-D (axial)
RoPE over the patch grid and a gated MLP. Projector: RMSNorm (the text model's eps), a patch merger (each
spatial_merge_size² block of patches concatenated, then `merging_layer`), linear_1, an activation, linear_2.
Pixtral-12B's layout (LlavaForConditionalGeneration with a Pixtral tower) is the same tower with a plain two-layer
projector. An image is encoded once per prompt, so this favours clarity over speed; linears load through the
decoder's WeightLoader, so EXL2 and GPTQ vision linears work as well as dense ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

import PIL.Image
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from exl2.errors import ConfigError, ModelLoadError
from exl2.generation.tokenizer import read_json
from exl2.models.vision.image import ImageProcessing
from exl2.runtime.weights import WeightLoader

TOWER = "vision_tower"
PROJECTOR = "multi_modal_projector"
_TOWER_EPS = 1e-5      # Pixtral's RMSNorms (ln_pre, attention_norm, ffn_norm) hard-code it

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ConfigError(f"The vision activation {name!r} is not supported ({', '.join(_ACTIVATIONS)}).")
    return _ACTIVATIONS[name]


def _int(value, what: str) -> int:
    """An int, or a square [n, n] pair as transformers allows for image and patch sizes."""
    if isinstance(value, (list, tuple)) and len(set(value)) == 1:
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"The vision config's {what} must be one integer, not {value!r}.")
    return value


@dataclass(frozen=True)
class PixtralSpec:
    """What config.json says about the tower and projector (transformers' defaults for missing keys)."""

    hidden: int
    intermediate: int
    heads: int
    layers: int               # tower layers to run: up to the deepest feature layer
    patch: int
    channels: int
    act: str
    rope_theta: float
    text_hidden: int
    merge: int                # spatial_merge_size; 1 (no merger) for Llava
    norm_eps: Optional[float]  # the projector's RMSNorm eps (the text model's); None: no norm (Llava)
    projector_act: str
    projector_bias: bool
    feature_layers: tuple[int, ...]   # indices into (ln_pre output, layer 1 output, …), concatenated in order
    image_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def marker_id(self) -> int:
        """The token a chat template puts where an image goes: [IMG] itself, which the layout replaces."""
        return self.image_token_id

    @classmethod
    def from_config(cls, cfg: dict) -> Optional["PixtralSpec"]:
        """The spec of a Mistral3ForConditionalGeneration (or Llava with a Pixtral tower); None for other models."""
        archs = cfg.get("architectures") or []
        vision, text = cfg.get("vision_config"), cfg.get("text_config") or {}
        if not isinstance(vision, dict):
            return None
        if "Mistral3ForConditionalGeneration" in archs:
            llava = False
        elif "LlavaForConditionalGeneration" in archs and vision.get("model_type") == "pixtral":
            llava = True
            if cfg.get("vision_feature_select_strategy", "default") != "full":
                raise ConfigError("A Llava model with a Pixtral tower needs vision_feature_select_strategy 'full'.")
        else:
            return None
        num_layers = int(vision.get("num_hidden_layers", 24))
        feature_layers = _feature_layers(cfg.get("vision_feature_layer", -2 if llava else -1), num_layers)
        rope = vision.get("rope_parameters") or {}
        return cls(
            hidden=int(vision.get("hidden_size", 1024)),
            intermediate=int(vision.get("intermediate_size", 4096)),
            heads=int(vision.get("num_attention_heads", 16)),
            layers=max(feature_layers),
            patch=_int(vision.get("patch_size", 16), "patch_size"),
            channels=int(vision.get("num_channels", 3)),
            act=vision.get("hidden_act", "gelu"),
            rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))),
            text_hidden=int(text.get("hidden_size", 4096)),
            merge=1 if llava else int(cfg.get("spatial_merge_size", 2)),
            norm_eps=None if llava else float(text.get("rms_norm_eps", 1e-6)),
            projector_act=cfg.get("projector_hidden_act", "gelu"),
            projector_bias=bool(cfg.get("multimodal_projector_bias", llava)),
            feature_layers=feature_layers,
            image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 32000 if llava else 10))),
        )


def _feature_layers(value, num_layers: int) -> tuple[int, ...]:
    """`vision_feature_layer` (an index or a list, Python-style into the num_layers + 1 hidden states)."""
    wanted = value if isinstance(value, list) else [value]
    out = []
    for i in wanted:
        if not isinstance(i, int) or not -(num_layers + 1) <= i <= num_layers:
            raise ConfigError(f"vision_feature_layer {value!r} does not fit a {num_layers}-layer vision tower.")
        out.append(i % (num_layers + 1))
    return tuple(out)


class VisionTensors:
    """The tensors under `roots` (the tower's and projector's: `vision_tower.*` / `multi_modal_projector.*` by
    default, Qwen2-VL's `visual.*`), whether the files store them so (older checkpoints) or under transformers 5's
    `model.` prefix; read on demand from the shards."""

    def __init__(self, model_dir: Path | str, roots: tuple[str, ...] = (TOWER, PROJECTOR)):
        files = sorted(Path(model_dir).glob("*.safetensors"))
        # like TensorSource: Mistral's own-format consolidated.safetensors duplicates the HF shards
        files = [f for f in files if not f.name.startswith("consolidated")] or files
        self._where: dict[str, tuple[object, str]] = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:   # safetensors raises its own error types
                raise ModelLoadError(f"{path} cannot be opened as safetensors ({e}).") from None
            for key in handle.keys():
                name = key[len("model."):] if key.startswith(tuple(f"model.{r}." for r in roots)) else key
                if name.startswith(tuple(f"{r}." for r in roots)):
                    self._where.setdefault(name, (handle, key))

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(name)
        handle, key = self._where[name]
        return handle.get_tensor(key)


def vision_parts(model_dir: Path, spec_class, roots: tuple[str, ...] = (TOWER, PROJECTOR)) -> Optional[tuple]:
    """(spec, VisionTensors) of `model_dir` when its config.json is `spec_class`'s kind of vision model and its files
    hold the vision weights (under `roots`); None otherwise (another kind, or a text-only export)."""
    spec = spec_class.from_config(read_json(model_dir / "config.json"))
    if spec is None:
        return None
    tensors = VisionTensors(model_dir, roots)
    return (spec, tensors) if len(tensors) else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: normalized in float32, cast back, then scaled."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def axial_rope(rows: int, cols: int, head_dim: int, theta: float,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows·cols, head_dim] (float32, patches row-major) as PixtralVisionRotaryEmbedding builds them:
    the even-indexed frequencies turn with the patch's row, the odd-indexed ones with its column, and the
    half-dimension angle vector (rows' then columns') is repeated for rotate-half RoPE."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    h = torch.arange(rows, dtype=torch.float32, device=device)[:, None] * inv[None, 0::2]
    w = torch.arange(cols, dtype=torch.float32, device=device)[:, None] * inv[None, 1::2]
    angles = torch.cat([h[:, None, :].expand(rows, cols, -1), w[None, :, :].expand(rows, cols, -1)], dim=-1)
    angles = angles.reshape(rows * cols, head_dim // 2)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class _Layer(nn.Module):
    """One Pixtral transformer layer: x + attention(attention_norm(x)), then + feed_forward(ffn_norm(x))."""

    def __init__(self, spec: PixtralSpec, w: WeightLoader, prefix: str):
        super().__init__()
        h, inter = spec.hidden, spec.intermediate
        self.heads, self.act = spec.heads, _activation(spec.act)
        self.register_buffer("attention_norm", w.tensor(f"{prefix}.attention_norm.weight"), persistent=False)
        self.register_buffer("ffn_norm", w.tensor(f"{prefix}.ffn_norm.weight"), persistent=False)
        self.q, self.k, self.v, self.o = (w.linear(f"{prefix}.attention.{n}_proj", h, h, False) for n in "qkvo")
        self.gate = w.linear(f"{prefix}.feed_forward.gate_proj", h, inter, False)
        self.up = w.linear(f"{prefix}.feed_forward.up_proj", h, inter, False)
        self.down = w.linear(f"{prefix}.feed_forward.down_proj", inter, h, False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, h = x.shape
        y = rms_norm(x, self.attention_norm, _TOWER_EPS)
        q, k, v = (lin(y).view(n, self.heads, -1).transpose(0, 1) for lin in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(_rotate(q, cos, sin)[None], _rotate(k, cos, sin)[None], v[None])
        x = x + self.o(a[0].transpose(0, 1).reshape(n, h))
        y = rms_norm(x, self.ffn_norm, _TOWER_EPS)
        return x + self.down(self.act(self.gate(y)) * self.up(y))


def merge_patches(x: torch.Tensor, rows: int, cols: int, merge: int) -> torch.Tensor:
    """[rows·cols, d] → [(rows/m)·(cols/m), d·m²]: each m×m block of patches as one row, laid out like
    F.unfold's (channel, block row, block column) order, blocks row-major (what Mistral3PatchMerger feeds its
    merging_layer). A trailing partial block is dropped, as unfold drops it."""
    d = x.shape[-1]
    r, c = rows // merge, cols // merge
    grid = x.view(rows, cols, d)[: r * merge, : c * merge]
    return grid.reshape(r, merge, c, merge, d).permute(0, 2, 4, 1, 3).reshape(r * c, d * merge * merge)


class _Projector(nn.Module):
    """Mistral 3: norm → patch merger → linear_1 → act → linear_2; Llava: linear_1 → act → linear_2."""

    def __init__(self, spec: PixtralSpec, w: WeightLoader):
        super().__init__()
        self.spec, self.act = spec, _activation(spec.projector_act)
        features = spec.hidden * len(spec.feature_layers)
        if spec.norm_eps is not None:
            self.register_buffer("norm", w.tensor(f"{PROJECTOR}.norm.weight"), persistent=False)
            self.merging_layer = w.linear(f"{PROJECTOR}.patch_merger.merging_layer", features * spec.merge ** 2,
                                          features, False)
        self.linear_1 = w.linear(f"{PROJECTOR}.linear_1", features, spec.text_hidden, spec.projector_bias)
        self.linear_2 = w.linear(f"{PROJECTOR}.linear_2", spec.text_hidden, spec.text_hidden, spec.projector_bias)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        if self.spec.norm_eps is not None:
            x = rms_norm(x, self.norm, self.spec.norm_eps)
            x = self.merging_layer(merge_patches(x, rows, cols, self.spec.merge))
        return self.linear_2(self.act(self.linear_1(x)))


@dataclass
class ImageEmbedding:
    """One image, ready for a prompt: its embedding rows and the tokens that stand for it in the text."""

    features: torch.Tensor      # [n, text_hidden] in the model's dtype and device: one row per [IMG] token, in order
    token_ids: list[int]        # per row of merged patches: [IMG] × cols then [IMG_BREAK]; the last row ends [IMG_END]
    image_token_id: int         # the [IMG] id (config.json image_token_index)
    grid: Optional[tuple[int, int, int]] = None   # (t, h, w) of the feature rows, for 3-D RoPE (Qwen2-VL); else None
    deep: tuple = ()            # Qwen3-VL's DeepStack: [n, text_hidden] rows added after each of the first layers
    time_step: float = 1.0      # M-RoPE time positions between a video's frame groups (Qwen2.5-VL)


class TokenLookup(Protocol):
    def token_to_id(self, token: str) -> Optional[int]: ...


def _layout_token_ids(model_dir: Path, tokenizer: Optional[TokenLookup]) -> tuple[int, int]:
    """The [IMG_BREAK] and [IMG_END] ids (token texts as processor_config.json names them, else the defaults):
    config.json only names the [IMG] id."""
    proc = read_json(model_dir / "processor_config.json")
    names = (proc.get("image_break_token", "[IMG_BREAK]"), proc.get("image_end_token", "[IMG_END]"))
    if tokenizer is None:
        from exl2.generation.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(model_dir)
    ids = [tokenizer.token_to_id(n) for n in names]
    missing = [n for n, i in zip(names, ids) if i is None]
    if missing:
        raise ModelLoadError(f"The tokenizer in {model_dir} has no {' or '.join(missing)} token, which images need.")
    return ids[0], ids[1]


class PixtralVision:
    """A Pixtral vision tower with its projector: PIL image → embedding rows for the text model."""

    def __init__(self, spec: PixtralSpec, weights: WeightLoader, processing: ImageProcessing,
                 break_id: int, end_id: int):
        self.spec, self.processing = spec, processing
        self.break_id, self.end_id = break_id, end_id
        self.device, self.dtype = weights.device, weights.dtype
        conv = weights.tensor(f"{TOWER}.patch_conv.weight")
        if tuple(conv.shape) != (spec.hidden, spec.channels, spec.patch, spec.patch):
            raise ModelLoadError(f"{TOWER}.patch_conv.weight has shape {tuple(conv.shape)}, expected "
                                 f"{(spec.hidden, spec.channels, spec.patch, spec.patch)}.")
        self.patch_conv = conv
        self.ln_pre = weights.tensor(f"{TOWER}.ln_pre.weight")
        self.layers = [_Layer(spec, weights, f"{TOWER}.transformer.layers.{i}") for i in range(spec.layers)]
        self.projector = _Projector(spec, weights)

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float16,
                 tokenizer: Optional[TokenLookup] = None) -> Optional["PixtralVision"]:
        """The vision encoder of `model_dir`, or None when its config.json describes no Pixtral vision model or
        its files hold no vision tower (a text-only export). `tokenizer` (anything with token_to_id; default:
        the directory's) supplies the [IMG_BREAK] / [IMG_END] ids."""
        d = Path(model_dir)
        found = vision_parts(d, PixtralSpec)
        if found is None:
            return None
        spec, tensors = found
        break_id, end_id = _layout_token_ids(d, tokenizer)
        processing = ImageProcessing.from_dir(d, spec.patch * spec.merge)
        return cls(spec, WeightLoader(tensors, device, dtype), processing, break_id, end_id)

    def preprocess(self, image: PIL.Image.Image) -> torch.Tensor:
        """[3, H, W] float32 normalized pixels, H and W whole merged patches (transformers' PixtralImageProcessor
        as the Mistral 3 processor calls it)."""
        return self.processing(image)

    def token_layout(self, rows: int, cols: int) -> list[int]:
        """The text tokens of an image of rows × cols merged patches (PixtralProcessor's replace_image_token)."""
        ids = ([self.spec.image_token_id] * cols + [self.break_id]) * rows
        ids[-1] = self.end_id
        return ids

    def _tower(self, pixels: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """The feature layers' hidden states (ln_pre output = 0, layer i's output = i), concatenated:
        [rows·cols, hidden · feature layers], for pixels [3, H, W]. Only the states asked for are kept."""
        wanted = self.spec.feature_layers
        x = F.conv2d(pixels[None], self.patch_conv, stride=self.spec.patch)[0].flatten(1).t()
        x = rms_norm(x, self.ln_pre, _TOWER_EPS)
        cos, sin = axial_rope(rows, cols, self.spec.head_dim, self.spec.rope_theta, self.device)
        cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        kept = {0: x} if 0 in wanted else {}
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x, cos, sin)
            if i in wanted:
                kept[i] = x
        return torch.cat([kept[i] for i in wanted], dim=-1)

    @torch.inference_mode()
    def encode(self, image: PIL.Image.Image) -> ImageEmbedding:
        """The image's embedding rows and token layout."""
        pixels = self.preprocess(image).to(device=self.device, dtype=self.dtype)
        rows, cols = pixels.shape[-2] // self.spec.patch, pixels.shape[-1] // self.spec.patch
        features = self.projector(self._tower(pixels, rows, cols), rows, cols)
        tokens = self.token_layout(rows // self.spec.merge, cols // self.spec.merge)
        return ImageEmbedding(features, tokens, self.spec.image_token_id)
