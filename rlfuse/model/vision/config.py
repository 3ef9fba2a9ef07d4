"""The vision tower's configuration (`ModelConfig.vision`): Qwen3-VL's or Qwen3.5's
`vision_config`, plus the token ids the outer config.json holds (image placeholder, vision
start / end).

`VisionConfig.from_hf(outer config.json dict, where, family)` reads and checks it (ValueError
naming the file and field); `to_hf(family)` gives (vision_config dict, outer token-id fields)
back. The two families' towers differ only in what `VisionFamily` holds: Qwen3.5's has no
DeepStack (no `deepstack_visual_indexes` in its config) and other default token ids.
Test: python -m pytest -q tests/test_qwen3_vl.py tests/test_qwen3_5_vl.py
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
# transformers' Qwen3VLVisionConfig / Qwen3VLConfig defaults for absent fields
_INT_DEFAULTS = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
                 "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584,
                 "num_position_embeddings": 2304}
_TOKEN_DEFAULTS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
                   "vision_end_token_id": 151653}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VisionFamily:
    """What a family's vision_config looks like in config.json (the tower itself is shared)."""
    name: str
    """The outer config's class, for errors."""
    model_type: str
    """vision_config.model_type written back."""
    deepstack: bool
    """The config has `deepstack_visual_indexes` (Qwen3-VL); False: never DeepStack (Qwen3.5)."""
    token_defaults: dict
    """transformers' defaults of the outer config's token ids."""


QWEN3_VL_VISION = VisionFamily(name="Qwen3-VL", model_type="qwen3_vl_vision", deepstack=True,
                               token_defaults=_TOKEN_DEFAULTS)
QWEN3_5_VISION = VisionFamily(name="Qwen3.5", model_type="qwen3_5_vision", deepstack=False,
                              token_defaults={"image_token_id": 248056, "video_token_id": 248057,
                                              "vision_start_token_id": 248053, "vision_end_token_id": 248054})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VisionConfig:
    depth: int
    """Vision transformer blocks."""
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int = 3
    patch_size: int = 16
    """Pixels per patch side."""
    temporal_patch_size: int = 2
    """Frames per patch (an image is repeated to fill them)."""
    spatial_merge_size: int = 2
    """The merger joins merge x merge patches into one text-side token."""
    out_hidden_size: int
    """The merger's output width: the text model's hidden_size."""
    num_position_embeddings: int = 2304
    """The learned position grid (a square: side = sqrt of this), resampled to each image."""
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    """Vision blocks whose outputs (through their own mergers) are added to the text hidden
    states after decoder layers 0, 1, ... (DeepStack)."""
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    """The tower's 2-D (h, w) RoPE base."""
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    def __post_init__(self):
        for f in (*_INT_DEFAULTS, *_TOKEN_DEFAULTS):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if f in _TOKEN_DEFAULTS else 1):
                raise ValueError(f"vision config field {f!r} must be a positive integer, got {v!r}")
        t = self.rope_theta
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"vision config field 'rope_parameters.rope_theta' must be a positive number, got {t!r}")
        object.__setattr__(self, "rope_theta", float(t))
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision config: hidden_size ({self.hidden_size}) / num_heads ({self.num_heads}) must "
                             f"be a multiple of 4 (the 2-D RoPE splits each head's half in h and w)")
        side = int(self.num_position_embeddings ** 0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"vision config field 'num_position_embeddings' must be a square, "
                             f"got {self.num_position_embeddings}")
        ds = tuple(self.deepstack_visual_indexes)
        if any(not isinstance(i, int) or not 0 <= i < self.depth for i in ds):
            raise ValueError(f"vision config field 'deepstack_visual_indexes' must list block indices in "
                             f"[0, {self.depth}), got {list(ds)}")
        object.__setattr__(self, "deepstack_visual_indexes", ds)
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision config field 'hidden_act' must be one of {ACTIVATIONS}, got {self.hidden_act!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch row of pixel_values: C * Tp * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_hf(cls, d: dict, where: str, family: VisionFamily = QWEN3_VL_VISION) -> VisionConfig:
        """From the OUTER config.json dict (its vision_config and token ids) of `family`."""
        v = d.get("vision_config")
        if not isinstance(v, dict):
            raise ValueError(f"{where}: a {family.name} config needs a 'vision_config' object, got {type(v).__name__}")
        vw = f"{where} (vision_config)"
        # absent: transformers' default; present: checked by __post_init__ (errors name the field)
        kw: dict[str, Any] = {k: v.get(k, default) for k, default in _INT_DEFAULTS.items()}
        for k, default in family.token_defaults.items():
            t = d.get(k, default)
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"{where}: field {k!r} is {t!r}; expected a token id")
            kw[k] = t
        rope = v.get("rope_parameters") or {}
        kw["rope_theta"] = rope.get("rope_theta", 10000.0)
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"{vw}: field 'rope_parameters.rope_type' is {rope['rope_type']!r}; expected 'axial'")
        # Qwen3.5's tower has no DeepStack: transformers never reads the field there
        ds = v.get("deepstack_visual_indexes", [8, 16, 24]) if family.deepstack else []
        if not isinstance(ds, (list, tuple)):
            raise ValueError(f"{vw}: field 'deepstack_visual_indexes' must be a list of block indices, got {ds!r}")
        try:
            return cls(deepstack_visual_indexes=tuple(ds), hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"), **kw)
        except ValueError as e:
            raise ValueError(f"{vw}: {e}") from None

    def to_hf(self, family: VisionFamily = QWEN3_VL_VISION) -> tuple[dict, dict]:
        """(the vision_config dict, the outer config's token-id fields) of `family`."""
        if self.deepstack_visual_indexes and not family.deepstack:
            raise ValueError(f"vision config field 'deepstack_visual_indexes' is {list(self.deepstack_visual_indexes)}"
                             f"; a {family.name} vision tower has no DeepStack (give ())")
        v = {k: getattr(self, k) for k in _INT_DEFAULTS}
        v.update(model_type=family.model_type, depth=self.depth, hidden_act=self.hidden_act,
                 rope_parameters={"rope_type": "axial", "rope_theta": self.rope_theta})
        if family.deepstack:
            v["deepstack_visual_indexes"] = list(self.deepstack_visual_indexes)
        return v, {k: getattr(self, k) for k in _TOKEN_DEFAULTS}
