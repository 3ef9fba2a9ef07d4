"""Llama (LlamaForCausalLM): full attention with optional q/k/v/o biases, a SwiGLU MLP with
an optional bias, llama3 RoPE scaling."""

from rlfuse.model.arch.spec import ArchSpec
from rlfuse.model.layers import MLP, Attention

LLAMA = ArchSpec(
    model_type="llama",
    hf_class="LlamaForCausalLM",
    mixers={"full_attention": ("self_attn", Attention)},
    mlp=lambda cfg, i: MLP(cfg),
    defaults={"attention_bias": False},
    fixed={"qk_norm": False},
    notes="attention_bias and mlp_bias read from config.json; llama3 rope scaling",
)
