"""Qwen3.5 (Qwen3_5ForCausalLM, model_type "qwen3_5_text"; and the text tower of
Qwen3_5ForConditionalGeneration, "qwen3_5"): a hybrid stack whose `layer_types` pick per
layer a Gated DeltaNet (`linear_attn`, rlfuse.model.layers.gated_deltanet) or a gated full
attention (`self_attn`, rlfuse.model.layers.gated_attention: output gate, q/k norms, partial
RoPE); Qwen3's SwiGLU MLP; every RMSNorm but the gated one scales by (1 + w) and rounds once
(`OffsetRMSNorm`). A multimodal folder read with `text_only` (`ModelConfig.from_hf`) gives
this text model from its `model.language_model.` tensors, its vision tower and
multi-token-prediction head not loaded; without it, the folder is `arch.qwen3_5_vl`.

Config fields beyond the dense ones: layer_types (HF default: every 4th layer full
attention, `full_attention_interval`), the linear-attention shapes, partial_rotary_factor
(in rope_parameters; the multimodal rope's sections are plain RoPE for text: its three
position streams are all the text position).

Qwen3-Next ("qwen3_next", `arch.qwen3_next`) is this stack with the linear-attention input
projections fused and MoE / dense MLPs by Qwen3-MoE's layer rule.
Test: python -m pytest -q tests/test_qwen3_5.py
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlfuse.model.arch.fields import number
from rlfuse.model.arch.spec import ArchSpec
from rlfuse.model.layers import MLP, GatedAttention, GatedDeltaNet, OffsetRMSNorm
from rlfuse.model.layers.gated_deltanet import prepare_prefix_rows

if TYPE_CHECKING:
    from rlfuse.model.config import ModelConfig

LAYER_TYPES = ("full_attention", "linear_attention")
# transformers' Qwen3_5TextConfig defaults for absent fields
_LINEAR_DEFAULTS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 32}
# rope_parameters keys that are no part of the rope type: the partial factor and mrope's sections
_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def _default_types(n: int, interval: int = 4) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def _read_hf(d: dict, rope: dict, where: str) -> dict:
    if d.get("attn_output_gate", True) is not True:
        raise ValueError(f"{where}: field 'attn_output_gate' is {d['attn_output_gate']!r}; Qwen3.5's attention "
                         f"always has its output gate (transformers has no switch for it)")
    out: dict[str, Any] = {k: number(d, k, where, default, integer=True) for k, default in _LINEAR_DEFAULTS.items()}
    types = d.get("layer_types")
    if types is None:
        interval = number(d, "full_attention_interval", where, 4, integer=True)
        types = _default_types(number(d, "num_hidden_layers", where, integer=True), interval)
    elif not isinstance(types, list):
        raise ValueError(f"{where}: field 'layer_types' must be a list of {list(LAYER_TYPES)}, got {types!r}")
    out["layer_types"] = tuple(types)
    if "partial_rotary_factor" in rope:
        out["partial_rotary_factor"] = number(rope, "partial_rotary_factor", where,
                                              label="rope_parameters.partial_rotary_factor")
    else:  # transformers' Qwen3_5TextConfig default
        out["partial_rotary_factor"] = number(d, "partial_rotary_factor", where, 0.25)
    return out


def _check(cfg: ModelConfig) -> None:
    for k, default in _LINEAR_DEFAULTS.items():
        v = getattr(cfg, k)
        if v is None:
            object.__setattr__(cfg, k, default)
        elif not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"config field {k!r} must be a positive integer, got {v!r}")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ValueError(f"config field 'linear_num_value_heads' ({cfg.linear_num_value_heads}) must be a "
                         f"multiple of 'linear_num_key_heads' ({cfg.linear_num_key_heads})")
    types = _default_types(cfg.num_hidden_layers) if cfg.layer_types is None else cfg.layer_types
    if isinstance(types, str) or not isinstance(types, (list, tuple)):
        raise ValueError(f"config field 'layer_types' must be a list of {list(LAYER_TYPES)}, got {types!r}")
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise ValueError(f"config field 'layer_types': layer {i} has type {t!r}, which rlfuse does not "
                             f"support; supported layer types: {list(LAYER_TYPES)}")
    if len(types) != cfg.num_hidden_layers:
        raise ValueError(f"config field 'layer_types' lists {len(types)} layers; num_hidden_layers is "
                         f"{cfg.num_hidden_layers}")
    object.__setattr__(cfg, "layer_types", tuple(types))


def _write_hf(cfg: ModelConfig) -> dict:
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor}
    return {"layer_types": list(cfg.layer_types), "partial_rotary_factor": cfg.partial_rotary_factor,
            "rope_parameters": rope, **{k: getattr(cfg, k) for k in _LINEAR_DEFAULTS}}


@torch.no_grad()
def _init_weights(model, std: float, generator) -> None:
    """transformers' init: matrices N(0, std), (1 + w) norms at w = 0, the gated norm and
    dt_bias at 1, A = exp(A_log) uniform in [0.01, 16). The text model's parameters only
    (a vision tower, `arch.qwen3_5_vl`, has its own rule)."""
    for name, p in model.named_parameters():
        if name.startswith("visual."):
            continue
        if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
            p.fill_(1.0)
        elif name.endswith("norm.weight") or name.endswith(".bias"):
            p.zero_()
        elif name.endswith("A_log"):
            # drawn on the generator's device: a CUDA generator cannot fill a CPU tensor
            where = generator.device if generator is not None else p.device
            p.copy_(torch.empty(p.shape, device=where).uniform_(0.01, 16.0, generator=generator).log())
        else:
            p.normal_(0.0, std, generator=generator)


QWEN3_5 = ArchSpec(
    model_type="qwen3_5_text",
    hf_class="Qwen3_5ForCausalLM",
    mixers={"linear_attention": ("linear_attn", GatedDeltaNet), "full_attention": ("self_attn", GatedAttention)},
    mlp=lambda cfg, i: MLP(cfg),
    layer_types=lambda cfg: list(cfg.layer_types),
    defaults={"attention_bias": False},
    fixed={"qk_norm": True, "mlp_bias": False},
    checkpoint_prefixes=(("model.language_model.", "model."),),
    skipped_prefixes=(("model.visual.", "vision tower"), ("mtp.", "multi-token-prediction head")),
    norm=OffsetRMSNorm,
    read_hf=_read_hf,
    check_config=_check,
    write_hf=_write_hf,
    rope_keys=_ROPE_KEYS,
    text_tower_of={"qwen3_5": "Qwen3_5ForConditionalGeneration"},
    prepare=prepare_prefix_rows,
    init_weights=_init_weights,
    notes="hybrid: Gated DeltaNet + gated attention (partial RoPE, (1 + w) norms); also the text tower of "
          "`qwen3_5` (Qwen3_5ForConditionalGeneration) folders loaded `text_only` (vision and MTP weights not loaded)",
)


def tiny_hybrid_fields(**over) -> dict:
    """ModelConfig fields of a small Qwen3.5 shape for the CPU demo / check / tests (usable as
    a recipe's `model.random_init`): 4 layers (three Gated DeltaNet, then one gated full
    attention), value heads = 2 x key heads, head_dim 16 with half of it rotated. `over`:
    any ModelConfig field (e.g. vocab_size for a tokenizer)."""
    return dict(model_type="qwen3_5_text", vocab_size=512, hidden_size=64, intermediate_size=192,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                partial_rotary_factor=0.5, tie_word_embeddings=False, max_position_embeddings=1024,
                rope_theta=10000.0, layer_types=("linear_attention",) * 3 + ("full_attention",),
                linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4) | over
