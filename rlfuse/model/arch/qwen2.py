"""Qwen2 (Qwen2ForCausalLM): Llama's layers with q/k/v biases always on and never an o_proj
or MLP bias."""

from rlfuse.model.arch.spec import ArchSpec
from rlfuse.model.layers import MLP, Attention

QWEN2 = ArchSpec(
    model_type="qwen2",
    hf_class="Qwen2ForCausalLM",
    mixers={"full_attention": ("self_attn", lambda cfg, i: Attention(cfg, i, o_bias=False))},
    mlp=lambda cfg, i: MLP(cfg),
    defaults={"attention_bias": True},
    fixed={"qk_norm": False, "attention_bias": True, "mlp_bias": False},
    hf_extra={"use_sliding_window": False},
    notes="q/k/v biases, no o_proj bias; sliding-window attention refused",
)
