"""Model layer: config, the Llama/Qwen2/Qwen3 transformer and the Qwen3.5 hybrid (and the
scalar-head variant for reward models and critics), safetensors weights, tokenizer."""

from rlfuse.model.config import ModelConfig
from rlfuse.model.scalar_head import ScalarHeadModel, load_scalar_head_model
from rlfuse.model.tokenizer import Tokenizer
from rlfuse.model.transformer import CausalLM, Packed, PagedKV
from rlfuse.model.weights import build_causal_lm, load_model, save_model

__all__ = ["CausalLM", "build_causal_lm", "ModelConfig", "Packed", "PagedKV", "ScalarHeadModel", "Tokenizer", "load_model",
           "load_scalar_head_model", "save_model"]
