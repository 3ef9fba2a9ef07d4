"""Model layer: config, the Llama/Qwen2/Qwen3 transformer (and its scalar-head variant for
reward models and critics), safetensors weights, tokenizer."""

from rlfuse.model.config import ModelConfig
from rlfuse.model.scalar_head import ScalarHeadModel, load_scalar_head_model
from rlfuse.model.tokenizer import Tokenizer
from rlfuse.model.causal_lm import CausalLM, Packed, PagedKV
from rlfuse.model.weights import load_model, save_model

__all__ = ["CausalLM", "ModelConfig", "Packed", "PagedKV", "ScalarHeadModel", "Tokenizer", "load_model",
           "load_scalar_head_model", "save_model"]
