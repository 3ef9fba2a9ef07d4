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
    `layers.moe_config.MoEConfig`), read and written back; `moe_shared_expert`: its blocks
    have a gated shared expert (Qwen3.5-MoE); `dense_mlp`: False where no layer has a dense
    MLP (config.json then has no intermediate_size);
  * `checkpoint_name(name)`: our parameter name -> the checkpoint's (identity for the dense
    families, whose module tree mirrors HF's). Stacked MoE experts (one (E, ...) tensor here,
    one tensor per expert in published folders) are split and joined by `model.weights`
    for every `layers.moe.SparseMoeBlock`, whatever the family.
    `checkpoint_prefixes` / `skipped_prefixes`: a folder's names under another prefix (a
    multimodal wrapper's text tower) and the parts not loaded (vision tower, MTP head);
  * `norm(dim, eps)`: the RMSNorm variant of the residual stream and the final norm;
  * config hooks of families with more fields (hybrids): `read_hf`, `check_config`,
    `write_hf`, `rope_keys`, `text_tower_of`; a nested config.json (multimodal): `unwrap_hf`,
    `wrap_hf`; `has_vision`: a vision tower and mRoPE (`rlfuse.model.vision`);
  * `prepare(attn)`: per-forward metadata a family's mixers share (made once per forward);
  * `init_weights(model, std, generator)`: a family's random init, if not the dense one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from rlfuse.model.layers.norm import RMSNorm

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
    moe_shared_expert: bool = False
    """Its MoE blocks add a shared expert with a sigmoid gate (`layers.moe_config`)."""
    moe_fixed: dict[str, Any] = dataclasses.field(default_factory=dict)
    """MoE fields the HF class hard-codes (its config has no such field), e.g. Qwen3.5-MoE's
    layer rule and top-k renormalization: not written to config.json, another value refused."""
    peft_maps_mlp_targets: bool = False
    """PEFT (>= 0.19 under transformers 5) reads target_modules gate_proj / up_proj /
    down_proj of this family as its experts' (their transformers-v4 names) and moves them
    to target_parameters: a PEFT folder cannot hold dense-MLP adapters beside expert ones."""
    dense_mlp: bool = True
    """Some layer may have a dense MLP of `intermediate_size` (required in config.json);
    False: every layer is an MoE block, intermediate_size is not read nor written."""
    checkpoint_name: Callable[[str], str] = _same_name
    """Our state-dict name -> the checkpoint's."""
    checkpoint_prefixes: tuple[tuple[str, str], ...] = ()
    """(prefix in a checkpoint, ours): e.g. a multimodal folder's text tower names."""
    skipped_prefixes: tuple[tuple[str, str], ...] = ()
    """(prefix in a checkpoint, what it is): tensors not loaded, logged in one line each."""
    norm: Callable[[int, float], nn.Module] = RMSNorm
    """builder(dim, eps) of the decoder's RMSNorms (the layers' two and the final one)."""
    read_hf: Callable[[dict, dict, str], dict] | None = None
    """(config.json dict, its rope parameters, where) -> this family's extra ModelConfig fields."""
    check_config: Callable[[ModelConfig], None] | None = None
    """Validates (and fills the defaults of) those fields; None: the family has none."""
    write_hf: Callable[[ModelConfig], dict] | None = None
    """-> the extra config.json entries of those fields."""
    rope_keys: tuple[str, ...] = ()
    """rope_parameters keys `read_hf` consumes (no part of the rope type)."""
    text_tower_of: dict[str, str] = dataclasses.field(default_factory=dict)
    """Multimodal wrapper model_type -> its HF class, whose text_config is this family's."""
    prepare: Callable[[Any], Any] | None = None
    """attn metadata -> the same with what the mixers share per forward (None: as is)."""
    unwrap_hf: Callable[[dict, str], dict] | None = None
    """(config.json dict, where) -> the flat dict the shared reader reads (a multimodal
    config's text_config, with what `read_hf` needs of the outer one); None: as is."""
    wrap_hf: Callable[[dict, ModelConfig], dict] | None = None
    """(the flat config.json dict written, cfg) -> the file's dict (nested); None: as is."""
    has_vision: bool = False
    """The model has a vision tower (`ModelConfig.vision`, `rlfuse.model.vision`) and takes
    mRoPE positions (`ModelConfig.mrope_section`)."""
    init_weights: Callable[[nn.Module, float, Any], None] | None = None
    """(model, std, generator) -> None: the family's random init (None: the dense rule)."""
    notes: str = ""
    """One line for docs/models.md."""

    def __post_init__(self):
        bad = set(self.fixed) - set(SWITCHES)
        if bad:
            raise ValueError(f"ArchSpec {self.model_type}: fixed names unknown switches {sorted(bad)} (known: {SWITCHES})")
