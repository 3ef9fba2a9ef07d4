"""Tiny random-init `transformers` models of each family (no download), for parity tests.

  llama : llama3 rope scaling chosen so the three regimes of the llama3 rule all occur
          (theta 1e4, Dh 16, original_max 32, low/high freq factors 1/4: wavelengths
          2*pi*1e4^(i/8) = 6.3 (< 8, kept), 19.9 (between 8 and 32, smoothed),
          62.8.. (> 32, divided by 8)); untied LM head.
  qwen2 : q/k/v biases, untied.
  qwen3 : per-head q/k RMSNorm, head_dim (32) != hidden/heads (16), tied embeddings.
Weights are redrawn so no parameter keeps its special init (norms 1 + N(0, 0.1^2),
biases N(0, 0.1^2)): a swapped or ignored tensor changes the output.
"""

from __future__ import annotations

import torch
import transformers

FAMILIES = ("llama", "qwen2", "qwen3")
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def hf_config(family: str, **over) -> transformers.PretrainedConfig:
    if family == "llama":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32, "rope_theta": 10000.0}
        kw = dict(COMMON, head_dim=16, rope_parameters=rope, tie_word_embeddings=False)
        return transformers.LlamaConfig(**{**kw, **over})
    if family == "qwen2":
        kw = dict(COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
                  use_sliding_window=False)
        return transformers.Qwen2Config(**{**kw, **over})
    if family == "qwen3":
        kw = dict(COMMON, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  tie_word_embeddings=True, use_sliding_window=False)
        return transformers.Qwen3Config(**{**kw, **over})
    raise ValueError(family)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model


def hf_model(family: str, seed: int = 0, **over):
    """A float32 eager-attention transformers model with random weights, in eval mode."""
    cfg = hf_config(family, **over)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    return randomize_(model, seed).eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# Qwen3.5 (hybrid): 3 Gated DeltaNet layers then 1 gated full-attention layer; value heads =
# 2 x key heads; half of head_dim rotated. Not in FAMILIES (tests/test_qwen3_5.py has its own).
QWEN3_5 = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
               layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=512,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})


def qwen3_5_config(**over) -> transformers.PretrainedConfig:
    return transformers.Qwen3_5TextConfig(**{**QWEN3_5, **over})


@torch.no_grad()
def qwen3_5_model(seed: int = 0, **over):
    """A float32 eager transformers Qwen3_5ForCausalLM, every parameter drawn away from its
    init: (1 + w) norms w ~ N(0, 0.1^2), the gated norm 1 + N(0, 0.1^2), A_log and dt_bias
    N(0, 0.5^2), the conv N(0, 0.3^2) (a conv of width 4 summing small weights would leave
    q/k/v near zero), matrices N(0, 0.05^2)."""
    cfg = qwen3_5_config(**over)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    return _draw_qwen3_5_(model, seed)


# Qwen3.5-MoE: QWEN3_5's layers, each with an MoE block of 6 experts (top-2) and a shared expert.
QWEN3_5_MOE = {k: v for k, v in QWEN3_5.items() if k != "intermediate_size"} | dict(
    moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=2,
    router_aux_loss_coef=0.02)


@torch.no_grad()
def qwen3_5_moe_model(seed: int = 0, router_std: float = 0.5, **over):
    """A float32 eager transformers Qwen3_5MoeForCausalLM drawn as `qwen3_5_model`, the routers
    N(0, router_std^2) (wide: which experts a token picks matters)."""
    return _routed_hybrid(transformers.Qwen3_5MoeTextConfig(**{**QWEN3_5_MOE, **over}), seed, router_std)


@torch.no_grad()
def _routed_hybrid(cfg, seed: int, router_std: float):
    """A float32 eager transformers hybrid MoE from `cfg`, drawn as `_draw_qwen3_5_`, then its
    routers N(0, router_std^2) from seed + 1000."""
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    _draw_qwen3_5_(model, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            p.copy_(router_std * torch.randn(p.shape, generator=g))
    return model


@torch.no_grad()
def _draw_qwen3_5_(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g)
        if name.endswith("linear_attn.norm.weight"):
            p.copy_(1 + 0.1 * r)
        elif name.endswith("norm.weight"):
            p.copy_(0.1 * r)
        elif name.endswith(("A_log", "dt_bias")):
            p.copy_(0.5 * r)
        elif name.endswith("conv1d.weight"):
            p.copy_(0.3 * r)
        else:
            p.copy_(0.05 * r)
    return model.eval()


def tiny_hybrid_model(seed: int = 0, std: float = 0.1, **over):
    """rlfuse's tiny Qwen3.5 (`rlfuse.model.arch.qwen3_5.tiny_hybrid_fields(**over)`), fp32,
    weights drawn from `seed` (the family's init: std for the matrices)."""
    from rlfuse.model import CausalLM, ModelConfig
    from rlfuse.model.arch.qwen3_5 import tiny_hybrid_fields

    model = CausalLM(ModelConfig(**tiny_hybrid_fields(**over)))
    model.init_weights(std=std, generator=torch.Generator().manual_seed(seed))
    return model


# Qwen3-Next: QWEN3_5's layers with fused in_proj_qkvz / in_proj_ba; MoE blocks of 6 experts
# (top-2) with a shared expert on layers 0, 2 and 3, layer 1 a dense MLP (mlp_only_layers).
QWEN3_NEXT = QWEN3_5 | dict(moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6,
                            num_experts_per_tok=2, router_aux_loss_coef=0.02, mlp_only_layers=[1],
                            decoder_sparse_step=1, norm_topk_prob=False)


@torch.no_grad()
def qwen3_next_model(seed: int = 0, router_std: float = 0.5, **over):
    """A float32 eager transformers Qwen3NextForCausalLM drawn as `qwen3_5_moe_model`."""
    return _routed_hybrid(transformers.Qwen3NextConfig(**{**QWEN3_NEXT, **over}), seed, router_std)
