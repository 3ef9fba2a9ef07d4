"""Qwen3-VL (Qwen3VLForConditionalGeneration, model_type "qwen3_vl"): Qwen3's decoder (q/k
RMSNorm per head, no MLP bias) as the text tower, a vision tower (`rlfuse.model.vision.tower`)
whose merged patches replace the image-placeholder tokens' embeddings and whose DeepStack
features are added after the first decoder layers, and interleaved multimodal RoPE
(`rlfuse.model.vision.positions`).

config.json nests the text fields under `text_config` and the tower's under `vision_config`;
the token ids (image_token_id, vision_start_token_id, ...) and tie_word_embeddings are
outer fields. Checkpoint names: `model.language_model.*` (ours `model.*`), `model.visual.*`
(ours `visual.*`), `lm_head.weight`; we save the same, which transformers loads back.
Not covered: video inputs (video_token_id rows are plain text here).
Test: python -m pytest -q tests/test_qwen3_vl.py
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlfuse.model.arch.spec import ArchSpec
from rlfuse.model.layers import MLP, Attention
from rlfuse.model.vision.config import QWEN3_VL_VISION, VisionConfig, VisionFamily

if TYPE_CHECKING:
    from rlfuse.model.config import ModelConfig

_ROPE_KEYS = ("mrope_section", "mrope_interleaved")
_OUTER = ("tie_word_embeddings", "torch_dtype", "dtype")


def unwrap_vl(d: dict, where: str, model_type: str, cls: str, text_type: str) -> dict:
    """The flat dict the shared reader reads: text_config (of model_type `text_type`), the
    outer fields it needs, and the outer dict itself (`outer_config`, for the vision fields)."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{where}: a {cls} config needs a 'text_config' object, got {type(text).__name__}")
    if text.get("model_type", text_type) != text_type:
        raise ValueError(f"{where}: field 'text_config.model_type' is {text['model_type']!r}; a {cls} folder "
                         f"holds a {text_type!r} text tower")
    return {**text, **{k: d[k] for k in _OUTER if k in d}, "model_type": model_type, "outer_config": d}


def _unwrap(d: dict, where: str) -> dict:
    return unwrap_vl(d, where, "qwen3_vl", "Qwen3VLForConditionalGeneration", "qwen3_vl_text")


def read_mrope_section(rope: dict, where: str, default: list[int]) -> tuple[int, ...]:
    section = rope.get("mrope_section", default)  # transformers' default when absent
    if not isinstance(section, (list, tuple)) or len(section) != 3 or \
            any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in section):
        raise ValueError(f"{where}: field 'rope_parameters.mrope_section' must be three integers, got {section!r}")
    return tuple(section)


def _read_hf(d: dict, rope: dict, where: str) -> dict:
    section = read_mrope_section(rope, where, [24, 20, 20])
    if rope.get("mrope_interleaved", True) is not True:
        raise ValueError(f"{where}: field 'rope_parameters.mrope_interleaved' is {rope['mrope_interleaved']!r}; "
                         f"Qwen3-VL's mRoPE is always interleaved")
    return {"vision": VisionConfig.from_hf(d["outer_config"], where), "mrope_section": section}


def check_vision(cfg: ModelConfig, default_section: tuple[int, int, int]) -> None:
    """The vision fields of a vision-language config (shared by the VL families): the tower's
    config, its token ids below the vocabulary, its output width, and mrope_section (None:
    `default_section`) summing to the rotary frequencies (rotary_dim / 2)."""
    if isinstance(cfg.vision, dict):
        object.__setattr__(cfg, "vision", VisionConfig(**cfg.vision))
    if not isinstance(cfg.vision, VisionConfig):
        raise ValueError(f"config field 'vision' must be a VisionConfig for {cfg.architecture}, got {cfg.vision!r}")
    for f in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        if getattr(cfg.vision, f) >= cfg.vocab_size:
            raise ValueError(f"config field {f!r} is {getattr(cfg.vision, f)}; it must be a token id below "
                             f"vocab_size ({cfg.vocab_size})")
    if cfg.vision.out_hidden_size != cfg.hidden_size:
        raise ValueError(f"vision config field 'out_hidden_size' ({cfg.vision.out_hidden_size}) must equal the text "
                         f"model's hidden_size ({cfg.hidden_size})")
    section = default_section if cfg.mrope_section is None else tuple(cfg.mrope_section)
    if len(section) != 3 or sum(section) != cfg.rotary_dim // 2:
        half = "head_dim / 2" if cfg.rotary_dim == cfg.head_dim else "head_dim * partial_rotary_factor / 2"
        raise ValueError(f"config field 'mrope_section' {list(section)} must be three numbers summing to "
                         f"{half} = {cfg.rotary_dim // 2}")
    object.__setattr__(cfg, "mrope_section", section)


def _check(cfg: ModelConfig) -> None:
    check_vision(cfg, (24, 20, 20))


def _write_hf(cfg: ModelConfig) -> dict:
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta,
            "mrope_section": list(cfg.mrope_section), "mrope_interleaved": True}
    return {"rope_parameters": rope}


def wrap_vl(flat: dict[str, Any], cfg: ModelConfig, model_type: str, text_type: str,
            family: VisionFamily) -> dict:
    """The nested config.json of a VL model from the flat dict the shared writer made."""
    vision, tokens = cfg.vision.to_hf(family)
    outer = {k: flat.pop(k) for k in ("architectures", "tie_word_embeddings") if k in flat}
    text = {**flat, "model_type": text_type}
    return {**outer, "model_type": model_type, "text_config": text, "vision_config": vision, **tokens,
            "torch_dtype": flat.get("torch_dtype"), "dtype": flat.get("dtype")}


def _wrap(flat: dict[str, Any], cfg: ModelConfig) -> dict:
    return wrap_vl(flat, cfg, "qwen3_vl", "qwen3_vl_text", QWEN3_VL_VISION)


def vl_checkpoint_name(name: str) -> str:
    """Ours -> a VL checkpoint's: `visual.*` under `model.`, the text model under `model.language_model.`."""
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return name


QWEN3_VL = ArchSpec(
    model_type="qwen3_vl",
    hf_class="Qwen3VLForConditionalGeneration",
    mixers={"full_attention": ("self_attn", Attention)},
    mlp=lambda cfg, i: MLP(cfg),
    defaults={"attention_bias": False},
    fixed={"qk_norm": True, "mlp_bias": False},
    checkpoint_name=vl_checkpoint_name,
    read_hf=_read_hf,
    check_config=_check,
    write_hf=_write_hf,
    rope_keys=_ROPE_KEYS,
    unwrap_hf=_unwrap,
    wrap_hf=_wrap,
    has_vision=True,
    notes="Qwen3 text tower + vision tower (2-D RoPE ViT, patch merger, DeepStack) and interleaved mRoPE; "
          "images only (no video)",
)


def tiny_vl_fields(**over) -> dict:
    """ModelConfig fields of a tiny Qwen3-VL for the CPU tests and demo: 2 text layers of
    width 64 (head_dim 16, mrope_section (2, 3, 3)), a 3-block vision tower of width 32
    (patch 4, merge 2, a 4 x 4 position grid) with DeepStack from blocks 0 and 1. Token ids
    at the top of the vocabulary V (512 unless `vocab_size` is given): vision_start V-5,
    vision_end V-4, image V-3, video V-2. `over`: any ModelConfig field."""
    v = over.get("vocab_size", 512)
    vision = VisionConfig(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                          temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=over.get("hidden_size", 64),
                          num_position_embeddings=16, deepstack_visual_indexes=(0, 1), image_token_id=v - 3,
                          video_token_id=v - 2, vision_start_token_id=v - 5, vision_end_token_id=v - 4)
    return dict(model_type="qwen3_vl", vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                max_position_embeddings=1024, rope_theta=10000.0, mrope_section=(2, 3, 3), vision=vision) | over
