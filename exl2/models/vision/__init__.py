"""Vision encoders for multimodal checkpoints: an image in, embedding rows for the text model's image tokens out.

Mistral 3.1 / 3.2 (Mistral3ForConditionalGeneration), Pixtral-12B (Llava with a Pixtral tower) and Gemma 3
(Gemma3ForConditionalGeneration: a SigLIP tower) for now.
"""
from exl2.models.vision.gemma3 import Gemma3ImageProcessing, Gemma3Vision, Gemma3VisionSpec
from exl2.models.vision.image import ImageProcessing, load_image, to_rgb
from exl2.models.vision.pixtral import ImageEmbedding, PixtralSpec, PixtralVision

__all__ = ["Gemma3ImageProcessing", "Gemma3Vision", "Gemma3VisionSpec", "ImageEmbedding", "ImageProcessing",
           "PixtralSpec", "PixtralVision", "load_image", "load_vision", "to_rgb"]


def load_vision(model_dir, device="cpu", dtype=None):
    """The vision encoder of `model_dir` (Pixtral or Gemma 3's SigLIP), or None when it has none."""
    import torch

    for cls in (PixtralVision, Gemma3Vision):
        tower = cls.from_dir(model_dir, device, dtype or torch.float16)
        if tower is not None:
            return tower
    return None
