"""Vision encoders for multimodal checkpoints: an image in, embedding rows for the text model's image tokens out.

Mistral 3.1 / 3.2 (Mistral3ForConditionalGeneration) and Pixtral-12B (Llava with a Pixtral tower) for now.
"""
from exl2.models.vision.image import ImageProcessing, load_image, to_rgb
from exl2.models.vision.pixtral import ImageEmbedding, PixtralSpec, PixtralVision

__all__ = ["ImageEmbedding", "ImageProcessing", "PixtralSpec", "PixtralVision", "load_image", "to_rgb"]
