"""rlfuse.engine: the inference engine (paged KV cache, prefix caching, continuous
batching, CUDA graphs) on the trainer's own weights. Public API: `LLM`, `EngineConfig`,
`SamplingParams`, `Completion`, and for image prompts `MediaItem` (rlfuse.engine.media); `naive` holds the full-recompute oracle for tests."""

from rlfuse.engine.config import EngineConfig, SamplingParams
from rlfuse.engine.llm import LLM
from rlfuse.engine.media import IMAGE_TOKENS, MediaItem, check_media, encode_images, media_hash, prompt_positions
from rlfuse.engine.sequence import Completion
from rlfuse.engine.stats import EngineStats

__all__ = ["IMAGE_TOKENS", "LLM", "Completion", "EngineConfig", "EngineStats", "MediaItem", "SamplingParams", "check_media",
           "encode_images", "media_hash", "prompt_positions"]
