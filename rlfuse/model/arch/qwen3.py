"""Qwen3 (Qwen3ForCausalLM): Llama's layers with per-head RMSNorm on q and k before RoPE,
attention_bias read from config.json, never an MLP bias."""

from rlfuse.model.arch.spec import ArchSpec
from rlfuse.model.layers import MLP, Attention

QWEN3 = ArchSpec(
    model_type="qwen3",
    hf_class="Qwen3ForCausalLM",
    mixers={"full_attention": ("self_attn", Attention)},
    mlp=lambda cfg, i: MLP(cfg),
    defaults={"attention_bias": False},
    fixed={"qk_norm": True, "mlp_bias": False},
    hf_extra={"use_sliding_window": False},
    notes="q/k RMSNorm per head; sliding-window attention refused",
)
