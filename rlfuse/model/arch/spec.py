"""What an architecture is to rlfuse: `ArchSpec`, one per HF `model_type`, registered in
`rlfuse.model.arch` (its `__init__`). Shared code reads these fields and never tests a
model_type by name.

Plug-in points (docs/architecture.md, "A new architecture"):
  * `layer_types(cfg)`: the kind of each layer's token mixer, e.g. ["linear_attention",
    "linear_attention", "linear_attention", "full_attention", ...] for a hybrid stack;
    `mixers` maps each kind to (its HF attribute name, a builder (cfg, layer_idx) -> module);
  * `mlp(cfg, layer_idx)`: the layer's MLP (dense SwiGLU, or an MoE block);
  * `fixed` / `defaults`: config fields the HF class hard-codes or defaults;
    `hf_extra`: fields its config.json always carries;
  * `has_moe`: config.json carries the mixture-of-experts fields (`ModelConfig.moe`, a
    `layers.moe_config.MoEConfig`), read and written back;
  * `checkpoint_name(name)`: our parameter name -> the checkpoint's (identity for the dense
    families, whose module tree mirrors HF's). Stacked MoE experts (one (E, ...) tensor here,
    one tensor per expert in published folders) are split and joined by `model.weights`
    for every `layers.moe.SparseMoeBlock`, whatever the family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from rlfuse.model.config import ModelConfig

SWITCHES = ("attention_bias", "mlp_bias", "qk_norm")
"""The config switches an architecture may fix (`ArchSpec.fixed`); the others are read
from config.json and written back."""


def _full_attention(cfg: ModelConfig) -> list[str]:
    return ["full_attention"] * cfg.num_hidden_layers


def _same_name(name: str) -> str:
    return name


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArchSpec:
    model_type: str
    """HF `model_type` (config.json), the registry key."""
    hf_class: str
    """HF architecture class name (config.json "architectures")."""
    mixers: dict[str, tuple[str, Callable[[ModelConfig, int], nn.Module]]]
    """layer type -> (HF attribute name of the mixer, builder(cfg, layer_idx))."""
    mlp: Callable[[ModelConfig, int], nn.Module]
    """builder(cfg, layer_idx) of a layer's MLP."""
    layer_types: Callable[[ModelConfig], list[str]] = _full_attention
    """The layer type of every layer (keys of `mixers`)."""
    defaults: dict[str, bool] = dataclasses.field(default_factory=dict)
    """Switches left None in a config take these values."""
    fixed: dict[str, bool] = dataclasses.field(default_factory=dict)
    """Switches the HF class hard-codes (transformers has no flag for them): not read from
    config.json, not written to it, and a config asking otherwise is refused."""
    hf_extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Fields written into every config.json of this family."""
    has_moe: bool = False
    """config.json carries MoE fields (`ModelConfig.moe` is required, else refused)."""
    checkpoint_name: Callable[[str], str] = _same_name
    """Our state-dict name -> the checkpoint's."""
    notes: str = ""
    """One line for docs/models.md."""

    def __post_init__(self):
        bad = set(self.fixed) - set(SWITCHES)
        if bad:
            raise ValueError(f"ArchSpec {self.model_type}: fixed names unknown switches {sorted(bad)} (known: {SWITCHES})")
