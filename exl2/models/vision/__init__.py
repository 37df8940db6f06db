"""Vision encoders for multimodal checkpoints: an image in, embedding rows for the text model's image tokens out.

Mistral 3.1 / 3.2 (Mistral3ForConditionalGeneration), Pixtral-12B (Llava with a Pixtral tower), Gemma 3
(Gemma3ForConditionalGeneration: a SigLIP tower), Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense and MoE) for now.
"""
from exl2.models.vision.gemma3 import Gemma3ImageProcessing, Gemma3Vision, Gemma3VisionSpec
from exl2.models.vision.image import ImageProcessing, load_image, to_rgb
from exl2.models.vision.pixtral import ImageEmbedding, PixtralSpec, PixtralVision
from exl2.models.vision.qwen2vl import QwenImageProcessing, QwenVision, QwenVisionSpec
from exl2.models.vision.qwen3vl import Qwen3Vision, Qwen3VisionSpec

__all__ = ["Gemma3ImageProcessing", "Gemma3Vision", "Gemma3VisionSpec", "ImageEmbedding", "ImageProcessing",
           "PixtralSpec", "PixtralVision", "Qwen3Vision", "Qwen3VisionSpec", "QwenImageProcessing", "QwenVision",
           "QwenVisionSpec", "load_image", "load_vision", "to_rgb"]


def load_vision(model_dir, device="cpu", dtype=None):
    """The vision encoder of `model_dir` (Pixtral, Gemma 3's SigLIP, Qwen2-VL's, Qwen2.5-VL's or Qwen3-VL's), or None
    when it has none."""
    import torch

    for cls in (PixtralVision, Gemma3Vision, QwenVision, Qwen3Vision):
        tower = cls.from_dir(model_dir, device, dtype or torch.float16)
        if tower is not None:
            return tower
    return None
