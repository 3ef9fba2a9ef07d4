"""Qwen3.5 vision-language (Qwen3_5ForConditionalGeneration, model_type "qwen3_5"): the Qwen3.5
hybrid text tower (`arch.qwen3_5`: Gated DeltaNet + gated attention with partial RoPE), a
vision tower of Qwen3-VL's pattern WITHOUT DeepStack (`rlfuse.model.vision.tower` with
`deepstack_visual_indexes` = (); config `vision.config.QWEN3_5_VISION`), and interleaved
multimodal RoPE over the rotated dims only: mrope_section (default (11, 11, 10)) sums to
head_dim * partial_rotary_factor / 2, and frequency f turns by the t, h or w position row
by transformers' interleaved rule (`rlfuse.model.vision.positions`, as Qwen3-VL). The
positions of a prompt with images are Qwen3-VL's (`get_rope_index`: an image's tokens at
p + (frame, row, col), then p += max(h', w')); the Gated DeltaNet layers ignore positions.

Loading: a Qwen3_5ForConditionalGeneration folder loads as this model (its vision tower
with it) unless asked for the text tower only (`ModelConfig.from_hf(..., text_only=True)`,
the run's `model.text_only`), which gives `arch.qwen3_5`'s Qwen3_5ForCausalLM. The
multi-token-prediction head (`mtp.*`) is not loaded (one log line). Checkpoint names:
`model.language_model.*` (ours `model.*`), `model.visual.*` (ours `visual.*`),
`lm_head.weight`; we save the same, which transformers loads back.
Not covered: video inputs (video_token_id rows are plain text here).
Test: python -m pytest -q tests/test_qwen3_5_vl.py
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlfuse.model.arch.qwen3_5 import QWEN3_5 as TEXT
from rlfuse.model.arch.qwen3_5 import tiny_hybrid_fields
from rlfuse.model.arch.qwen3_vl import check_vision, read_mrope_section, unwrap_vl, vl_checkpoint_name, wrap_vl
from rlfuse.model.arch.spec import ArchSpec
from rlfuse.model.layers import OffsetRMSNorm
from rlfuse.model.vision import init_vision_weights
from rlfuse.model.vision.config import QWEN3_5_VISION, VisionConfig

if TYPE_CHECKING:
    from rlfuse.model.config import ModelConfig

MODEL_TYPE = "qwen3_5"
HF_CLASS = "Qwen3_5ForConditionalGeneration"
_SECTION = (11, 11, 10)  # transformers' Qwen3_5TextRotaryEmbedding default


def _unwrap(d: dict, where: str) -> dict:
    return unwrap_vl(d, where, MODEL_TYPE, HF_CLASS, TEXT.model_type)


def _read_hf(d: dict, rope: dict, where: str) -> dict:
    # transformers always interleaves Qwen3.5's sections (it never reads mrope_interleaved)
    return {**TEXT.read_hf(d, rope, where), "mrope_section": read_mrope_section(rope, where, list(_SECTION)),
            "vision": VisionConfig.from_hf(d["outer_config"], where, QWEN3_5_VISION)}


def _check(cfg: ModelConfig) -> None:
    TEXT.check_config(cfg)
    check_vision(cfg, _SECTION)
    if cfg.vision.deepstack_visual_indexes:
        raise ValueError(f"vision config field 'deepstack_visual_indexes' is "
                         f"{list(cfg.vision.deepstack_visual_indexes)}; Qwen3.5's vision tower has no DeepStack "
                         f"(give ())")


def _write_hf(cfg: ModelConfig) -> dict:
    d = TEXT.write_hf(cfg)
    d["rope_parameters"] |= {"mrope_section": list(cfg.mrope_section), "mrope_interleaved": True}
    return d


def _wrap(flat: dict[str, Any], cfg: ModelConfig) -> dict:
    return wrap_vl(flat, cfg, MODEL_TYPE, TEXT.model_type, QWEN3_5_VISION)


@torch.no_grad()
def _init_weights(model, std: float, generator) -> None:
    """The vision tower by its rule (`init_vision_weights`), then the text model by Qwen3.5's."""
    init_vision_weights(model.visual, std, generator)
    TEXT.init_weights(model, std, generator)


QWEN3_5_VL = ArchSpec(
    model_type=MODEL_TYPE,
    hf_class=HF_CLASS,
    mixers=TEXT.mixers,
    mlp=TEXT.mlp,
    layer_types=TEXT.layer_types,
    defaults=TEXT.defaults,
    fixed=TEXT.fixed,
    checkpoint_name=vl_checkpoint_name,
    skipped_prefixes=(("mtp.", "multi-token-prediction head"),),
    norm=OffsetRMSNorm,
    read_hf=_read_hf,
    check_config=_check,
    write_hf=_write_hf,
    rope_keys=TEXT.rope_keys,
    prepare=TEXT.prepare,
    unwrap_hf=_unwrap,
    wrap_hf=_wrap,
    has_vision=True,
    init_weights=_init_weights,
    notes="Qwen3.5 hybrid text tower + Qwen3-VL-pattern vision tower without DeepStack, interleaved mRoPE on the "
          "partial rotary dims; images only (no video); `text_only` loads the text tower alone (qwen3_5_text)",
)


def tiny_hybrid_vl_fields(**over) -> dict:
    """ModelConfig fields of a tiny Qwen3.5-VL for the CPU tests and `rlfuse check --tiny
    --vision --hybrid`: a 2-layer hybrid text tower of width 64 (one Gated DeltaNet, then one
    gated full attention; head_dim 16, half rotated: mrope_section (1, 2, 1) over its 4
    frequencies), a 2-block vision tower of width 32 (patch 4, merge 2, a 4 x 4 position
    grid), no DeepStack. Token ids at the top of the vocabulary V (512 unless `vocab_size` is
    given), as `arch.qwen3_vl.tiny_vl_fields`. `over`: any ModelConfig field."""
    v = over.get("vocab_size", 512)
    vision = VisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                          temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=over.get("hidden_size", 64),
                          num_position_embeddings=16, deepstack_visual_indexes=(), image_token_id=v - 3,
                          video_token_id=v - 2, vision_start_token_id=v - 5, vision_end_token_id=v - 4)
    return tiny_hybrid_fields(model_type=MODEL_TYPE, vocab_size=v, num_hidden_layers=2,
                                      layer_types=("linear_attention", "full_attention"), mrope_section=(1, 2, 1),
                                      vision=vision) | over
