"""Model layer: config, the architecture registry (arch/) and the shared layers it assembles
(layers/), the vision side of vision-language models (vision/: tower, mRoPE positions, image
processor), the causal LM (dense, hybrid e.g. Qwen3.5, or vision-language e.g. Qwen3-VL) and
its scalar-head variant for reward models and critics, safetensors weights, tokenizer."""

from rlfuse.model.arch import ARCHS, ArchSpec
from rlfuse.model.causal_lm import CausalLM
from rlfuse.model.config import ModelConfig
from rlfuse.model.layers import Linear, LinearSlots, Packed, PagedKV, pack_by_tokens
from rlfuse.model.scalar_head import ScalarHeadModel, load_scalar_head_model
from rlfuse.model.tokenizer import Tokenizer
from rlfuse.model.weights import load_model, load_rows_from_files, save_model

__all__ = ["ARCHS", "ArchSpec", "CausalLM", "Linear", "LinearSlots", "ModelConfig", "Packed", "PagedKV",
           "ScalarHeadModel", "Tokenizer", "load_model", "load_rows_from_files", "load_scalar_head_model", "pack_by_tokens",
           "save_model"]
