"""Vision: the image side of vision-language models (Qwen3-VL, Qwen3.5): the tower's config, the tower (ViT + merger + DeepStack where the family has it), mRoPE positions, the image processor."""

from rlfuse.model.vision.config import VisionConfig
from rlfuse.model.vision.positions import mrope_axis, mrope_positions, text_positions
from rlfuse.model.vision.tower import ImageFeatures, VisionTower, init_vision_weights, tokens_per_image

__all__ = ["ImageFeatures", "VisionConfig", "VisionTower", "init_vision_weights", "mrope_axis", "mrope_positions",
           "text_positions", "tokens_per_image"]
