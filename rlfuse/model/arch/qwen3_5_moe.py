"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM, model_type "qwen3_5_moe_text"; and the text tower of
Qwen3_5MoeForConditionalGeneration, "qwen3_5_moe"): Qwen3.5's hybrid stack (`arch.qwen3_5`:
Gated DeltaNet and gated full-attention mixers, (1 + w) norms, partial RoPE, the same config
fields and checkpoint prefixes) with an MoE block on every layer: softmax top-k routed
experts, the top-k weights always renormalized, plus a shared SwiGLU expert whose output is
scaled per token by sigmoid(shared_expert_gate(x)) (`layers.moe.SparseMoeBlock` with
`shared_expert`). No layer has a dense MLP, so config.json has no intermediate_size.

Checkpoints: the experts as fused (E, 2I, D) / (E, D, I) tensors or one tensor per expert
(`model.weights` reads both, writes the per-expert layout transformers' conversion reads).
Qwen3-Next ("qwen3_next", `arch.qwen3_next`) uses the same MoE block on the layers its
decoder_sparse_step / mlp_only_layers make sparse (norm_topk_prob read from config.json),
with the linear-attention input projections fused.
Test: python -m pytest -q tests/test_qwen3_5_moe.py
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from torch import nn

from rlfuse.model.arch.qwen3_5 import QWEN3_5, tiny_hybrid_fields
from rlfuse.model.layers import MLP
from rlfuse.model.layers.moe import SparseMoeBlock
from rlfuse.model.layers.moe_config import QWEN3_5_MOE_FIXED

if TYPE_CHECKING:
    from rlfuse.model.config import ModelConfig


def moe_with_shared_expert(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """Layer `layer_idx`'s MoE block, its shared expert a SwiGLU MLP of shared_expert_intermediate_size."""
    m = cfg.moe
    return SparseMoeBlock(hidden_size=cfg.hidden_size, moe_intermediate_size=m.moe_intermediate_size,
                          num_experts=m.num_experts, top_k=m.num_experts_per_tok, norm_topk_prob=True,
                          layer_idx=layer_idx, record_stats=m.output_router_logits,
                          shared_expert=MLP(cfg, m.shared_expert_intermediate_size))


QWEN3_5_MOE = dataclasses.replace(
    QWEN3_5,
    model_type="qwen3_5_moe_text",
    hf_class="Qwen3_5MoeForCausalLM",
    mlp=moe_with_shared_expert,
    has_moe=True,
    moe_shared_expert=True,
    moe_fixed=QWEN3_5_MOE_FIXED,
    dense_mlp=False,
    text_tower_of={"qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"},
    notes="Qwen3.5's hybrid layers; every MLP an MoE block: softmax top-k (renormalized) routed experts plus "
          "a sigmoid-gated shared expert; text tower of `qwen3_5_moe` (Qwen3_5MoeForConditionalGeneration) "
          "folders, vision and MTP weights not loaded",
)


def tiny_hybrid_moe_fields(**over) -> dict:
    """ModelConfig fields of a small Qwen3.5-MoE for the CPU check / tests: the tiny hybrid's
    layers (`tiny_hybrid_fields`), each with 8 experts (top-2, width 64) and a shared
    expert of width 64. `over`: any ModelConfig field."""
    base = tiny_hybrid_fields()
    del base["intermediate_size"]
    return base | dict(model_type="qwen3_5_moe_text",
                       moe=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                                shared_expert_intermediate_size=64)) | over
