"""Model layer: config, the Llama/Qwen2/Qwen3 transformer, safetensors weights, tokenizer."""

from rlfuse.model.config import ModelConfig
from rlfuse.model.transformer import CausalLM, Packed, PagedKV
from rlfuse.model.tokenizer import Tokenizer
from rlfuse.model.weights import load_model, save_model

__all__ = ["CausalLM", "ModelConfig", "Packed", "PagedKV", "Tokenizer", "load_model", "save_model"]
