"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (per-head q/k RMSNorm, no MLP bias)
with a sparse mixture-of-experts block (`layers.moe.SparseMoeBlock`) in place of the MLP on
the layers transformers makes sparse (`MoEConfig.is_sparse`: not in `mlp_only_layers`,
num_experts > 0, (i + 1) % decoder_sparse_step == 0); the other layers keep the dense MLP.
Test: python -m pytest -q tests/test_moe_model.py
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from rlfuse.model.arch.spec import ArchSpec
from rlfuse.model.layers import MLP, Attention
from rlfuse.model.layers.moe import SparseMoeBlock

if TYPE_CHECKING:
    from rlfuse.model.config import ModelConfig


def moe_or_dense_mlp(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """Layer `layer_idx`'s feed-forward block: sparse where the MoE rule says so, else dense."""
    m = cfg.moe
    if m is not None and m.is_sparse(layer_idx):
        return SparseMoeBlock(hidden_size=cfg.hidden_size, moe_intermediate_size=m.moe_intermediate_size,
                              num_experts=m.num_experts, top_k=m.num_experts_per_tok,
                              norm_topk_prob=m.norm_topk_prob, layer_idx=layer_idx,
                              record_stats=m.output_router_logits)
    return MLP(cfg)


QWEN3_MOE = ArchSpec(
    model_type="qwen3_moe",
    hf_class="Qwen3MoeForCausalLM",
    mixers={"full_attention": ("self_attn", Attention)},
    mlp=moe_or_dense_mlp,
    defaults={"attention_bias": False},
    fixed={"qk_norm": True, "mlp_bias": False},
    hf_extra={"use_sliding_window": False},
    has_moe=True,
    peft_maps_mlp_targets=True,
    notes="Qwen3 attention; softmax top-k routed experts (no shared expert) on the sparse layers; "
          "sliding-window attention refused",
)
