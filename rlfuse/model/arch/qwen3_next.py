"""Qwen3-Next (Qwen3NextForCausalLM, model_type "qwen3_next"): Qwen3.5's hybrid stack
(`arch.qwen3_5`: Gated DeltaNet and gated full-attention mixers, (1 + w) norms, the plain
gated norm of the linear-attention output, partial RoPE, the same layer_types /
full_attention_interval and linear-attention fields) with two differences, read from
transformers 5.24's modeling_qwen3_next.py:

  * the linear-attention input projections are fused as transformers stores them,
    in_proj_qkvz and in_proj_ba, interleaved per key head (`layers.FusedGatedDeltaNet`: the
    same mixer, its projection outputs de-interleaved by views; checkpoint and PEFT names
    map 1:1, no weight is rewritten on load or save);
  * the MLP follows Qwen3-MoE's layer rule (`MoEConfig.is_sparse`: not in mlp_only_layers,
    num_experts > 0, (i + 1) % decoder_sparse_step == 0): such a layer is an MoE block with
    Qwen3.5-MoE's sigmoid-gated shared expert, the others a dense SwiGLU MLP of
    intermediate_size; the top-k weights are renormalized only when norm_topk_prob (HF
    default true) says so.
The multi-token-prediction weights (`mtp.*`) of published folders are not loaded.
Test: python -m pytest -q tests/test_qwen3_next.py
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from torch import nn

from rlfuse.model.arch.qwen3_5 import QWEN3_5, tiny_hybrid_fields
from rlfuse.model.layers import MLP, FusedGatedDeltaNet, GatedAttention
from rlfuse.model.layers.moe import SparseMoeBlock

if TYPE_CHECKING:
    from rlfuse.model.config import ModelConfig


def moe_or_dense_with_shared_expert(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """Layer `layer_idx`'s feed-forward block: an MoE block with a shared expert where the
    layer rule makes it sparse, else the dense MLP (transformers' Qwen3NextDecoderLayer)."""
    m = cfg.moe
    if not m.is_sparse(layer_idx):
        return MLP(cfg)
    return SparseMoeBlock(hidden_size=cfg.hidden_size, moe_intermediate_size=m.moe_intermediate_size,
                          num_experts=m.num_experts, top_k=m.num_experts_per_tok, norm_topk_prob=m.norm_topk_prob,
                          layer_idx=layer_idx, record_stats=m.output_router_logits,
                          shared_expert=MLP(cfg, m.shared_expert_intermediate_size))


QWEN3_NEXT = dataclasses.replace(
    QWEN3_5,
    model_type="qwen3_next",
    hf_class="Qwen3NextForCausalLM",
    mixers={"linear_attention": ("linear_attn", FusedGatedDeltaNet), "full_attention": ("self_attn", GatedAttention)},
    mlp=moe_or_dense_with_shared_expert,
    has_moe=True,
    moe_shared_expert=True,
    peft_maps_mlp_targets=True,  # measured: PEFT 0.21 moves gate/up/down_proj targets onto the experts
    checkpoint_prefixes=(),
    skipped_prefixes=(("mtp.", "multi-token-prediction head"),),
    text_tower_of={},
    notes="Qwen3.5's hybrid layers with in_proj_qkvz / in_proj_ba fused (interleaved per key head); MoE blocks "
          "(softmax top-k, norm_topk_prob, sigmoid-gated shared expert) on the layers decoder_sparse_step / "
          "mlp_only_layers make sparse, dense MLPs on the others; MTP weights not loaded",
)


def tiny_next_fields(**over) -> dict:
    """ModelConfig fields of a small Qwen3-Next for the CPU check / tests: the tiny hybrid's
    layers (`tiny_hybrid_fields`: three Gated DeltaNet, then gated full attention), MoE
    blocks of 8 experts (top-2, width 64, renormalized) with a shared expert of width 64 on
    layers 0, 2 and 3, and layer 1 dense (mlp_only_layers). `over`: any ModelConfig field."""
    return tiny_hybrid_fields() | dict(
        model_type="qwen3_next",
        moe=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                 shared_expert_intermediate_size=64, mlp_only_layers=(1,))) | over
