"""Training data: rows from JSONL/JSON/Parquet files or built-in tasks, prompts and SFT
examples (templates, length checks, drop counts, the resumable stream), preference
pairs, and the built-in tasks with their exact verifiers; image rows (rlfuse.data.media)."""

from rlfuse.data.media import IMAGE_TOKENS, ImageProcessor, VisionData, expand_images
from rlfuse.data.preference import PreferencePair, build_preference_pairs
from rlfuse.data.prompts import Prompt, PromptStream, SFTExample, build_prompts, build_sft_examples, check_prompt_len
from rlfuse.data.rows import load_rows
from rlfuse.data.tasks import (
           INT_RE,
           extract_answer,
           lookup_value,
           rows_alphabet,
           task_alphabet,
           verify_arithmetic,
           verify_countdown,
)

__all__ = ["IMAGE_TOKENS", "INT_RE", "ImageProcessor", "VisionData", "expand_images", "PreferencePair", "Prompt", "PromptStream", "SFTExample", "build_preference_pairs",
           "build_prompts", "build_sft_examples", "check_prompt_len", "extract_answer", "load_rows", "rows_alphabet",
           "lookup_value", "task_alphabet", "verify_arithmetic", "verify_countdown"]
