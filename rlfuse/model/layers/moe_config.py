"""The mixture-of-experts part of a model config (the `config.json` fields of Qwen3-MoE and
of Qwen3.5-MoE's text model).

`ModelConfig.moe` holds a `MoEConfig` for the families whose ArchSpec says `has_moe` (None
for dense models). Qwen3-MoE ("qwen3_moe"): layer i is sparse (a `SparseMoeBlock`) when i
is not in `mlp_only_layers`, num_experts > 0 and (i + 1) % decoder_sparse_step == 0 --
transformers' rule; other layers keep the dense MLP of `intermediate_size`. Qwen3.5-MoE
("qwen3_5_moe_text", `shared_expert=True` below): every layer is sparse, the top-k weights
are always renormalized, and each block adds a shared expert (a SwiGLU MLP of
`shared_expert_intermediate_size`) scaled by a sigmoid gate; transformers' class has no
decoder_sparse_step, mlp_only_layers or norm_topk_prob (`QWEN3_5_MOE_FIXED`, the family's
`ArchSpec.moe_fixed`), so a config asking for other values is refused. Qwen3-Next
("qwen3_next"): the same shared expert, with Qwen3-MoE's layer rule and norm_topk_prob
read from config.json. Errors name the field: a top-k above the expert count, a non-positive size, a
layer index out of range, and fields of MoE features rlfuse does not implement (shared
experts where the family has none, router jitter, other scoring functions).
Test: python -m pytest -q tests/test_moe_model.py tests/test_qwen3_5_moe.py tests/test_qwen3_next.py
"""

from __future__ import annotations

import dataclasses
from typing import Any

QWEN3_5_MOE_FIXED = {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": ()}
"""What transformers' Qwen3.5-MoE hard-codes (its config class has no such fields): every
layer sparse, the top-k weights renormalized. A config.json asking otherwise is refused."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MoEConfig:
    num_experts: int
    """Routed experts per sparse layer (0: every layer dense)."""
    num_experts_per_tok: int
    """Experts each token is routed to (top-k), at most num_experts."""
    moe_intermediate_size: int
    """Each expert's SwiGLU width."""
    norm_topk_prob: bool = False
    """Renormalize the top-k probabilities to sum to 1 (transformers' default: false; Qwen3-30B-A3B: true)."""
    decoder_sparse_step: int = 1
    """Every decoder_sparse_step-th layer is sparse."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep the dense MLP."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss where training adds it."""
    output_router_logits: bool = False
    """transformers adds the load-balancing loss to the model's loss only when this is true."""
    shared_expert_intermediate_size: int = 0
    """The shared expert's SwiGLU width (Qwen3.5-MoE: every token goes through it, its output
    scaled by sigmoid(shared_expert_gate(x))); 0: no shared expert (Qwen3-MoE)."""

    def __post_init__(self):
        if isinstance(self.mlp_only_layers, list):  # from YAML or JSON
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))

    def is_sparse(self, layer_idx: int) -> bool:
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def check(self, num_hidden_layers: int, *, shared_expert: bool = False, fixed: dict | None = None,
              family: str = "qwen3_moe") -> None:
        """shared_expert: the family's blocks have one (Qwen3.5-MoE, Qwen3-Next); else
        shared_expert_intermediate_size must be 0. fixed: field -> the value the family's HF
        class hard-codes (`ArchSpec.moe_fixed`); another value is refused."""
        for f in ("moe_intermediate_size", "decoder_sparse_step", "num_experts_per_tok"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"config field {f!r} must be a positive integer, got {v!r}")
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"config field 'num_experts' must be a non-negative integer, got {self.num_experts!r}")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"config field 'num_experts_per_tok' is {self.num_experts_per_tok}; it must be at most "
                             f"num_experts = {self.num_experts}")
        bad = [i for i in self.mlp_only_layers if isinstance(i, bool) or not isinstance(i, int)
               or not 0 <= i < num_hidden_layers]
        if bad:
            raise ValueError(f"config field 'mlp_only_layers' holds {bad}; expected layer indices in "
                             f"[0, num_hidden_layers = {num_hidden_layers})")
        for f in ("norm_topk_prob", "output_router_logits"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"config field {f!r} must be true or false, got {getattr(self, f)!r}")
        v = self.shared_expert_intermediate_size
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (shared_expert and v == 0):
            raise ValueError(f"config field 'shared_expert_intermediate_size' must be a "
                             f"{'positive' if shared_expert else 'non-negative'} integer, got {v!r}")
        if v and not shared_expert:
            raise ValueError(f"config field 'shared_expert_intermediate_size' is {v}; shared experts are not "
                             f"supported ({family} has none)")
        for f, want in (fixed or {}).items():
            if getattr(self, f) != want:
                raise ValueError(f"config field {f!r} is {getattr(self, f)!r}; {family} always has {f} = "
                                 f"{list(want) if isinstance(want, tuple) else want!r} (transformers has no "
                                 f"switch for it)")
        c = self.router_aux_loss_coef
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not c >= 0:
            raise ValueError(f"config field 'router_aux_loss_coef' must be a non-negative number, got {c!r}")

    def to_hf(self, fixed: dict | None = None) -> dict[str, Any]:
        """The config.json fields; those in `fixed` (hard-coded by the HF class: it has no
        such field) are left out, as is a zero shared-expert width (the family has none)."""
        d = dataclasses.asdict(self)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        for k in fixed or {}:
            del d[k]
        if not self.shared_expert_intermediate_size:
            del d["shared_expert_intermediate_size"]
        return d


# Fields of MoE variants rlfuse does not build; present with a value that turns the feature
# on, they are refused rather than silently ignored (the model would compute something else).
_UNSUPPORTED = {
    "shared_expert_intermediate_size": "shared experts",
    "n_shared_experts": "shared experts",
    "num_shared_experts": "shared experts",
    "router_jitter_noise": "router jitter noise",
    "jitter_noise": "router jitter noise",
}


def moe_config_from_hf(d: dict, where: str, num_hidden_layers: int, *, shared_expert: bool = False,
                       fixed: dict | None = None, family: str = "qwen3_moe") -> MoEConfig:
    """MoEConfig from a config.json dict (transformers' defaults for absent optional fields).
    shared_expert: the family's blocks have a gated shared expert (Qwen3.5-MoE, Qwen3-Next),
    whose width `shared_expert_intermediate_size` is then required; fixed: as `MoEConfig.check`."""
    for field, what in _UNSUPPORTED.items():
        if shared_expert and field == "shared_expert_intermediate_size":
            continue
        if d.get(field):
            raise ValueError(f"{where}: field {field!r} is {d[field]!r}; {what} are not supported ({family} has none)")
    if d.get("scoring_func", "softmax") != "softmax":
        raise ValueError(f"{where}: field 'scoring_func' is {d['scoring_func']!r}; only 'softmax' routing is supported")
    if shared_expert and d.get("shared_expert_intermediate_size") is None:
        raise ValueError(f"{where}: missing required field 'shared_expert_intermediate_size' (a {family} "
                         f"config needs it)")
    # published Qwen3-MoE configs say num_experts; transformers 5 saves it as num_local_experts
    if d.get("num_experts") is None and d.get("num_local_experts") is not None:
        d = {**d, "num_experts": d["num_local_experts"]}
    elif d.get("num_local_experts") not in (None, d.get("num_experts")):
        raise ValueError(f"{where}: fields 'num_experts' ({d.get('num_experts')!r}) and 'num_local_experts' "
                         f"({d['num_local_experts']!r}) disagree")
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if d.get(field) is None:
            raise ValueError(f"{where}: missing required field {field!r} (a {family} config needs it)")
    layers = d.get("mlp_only_layers") or []
    if not isinstance(layers, list):
        raise ValueError(f"{where}: field 'mlp_only_layers' must be a list of layer indices, got {layers!r}")
    kw = dict(
        num_experts=d["num_experts"],
        num_experts_per_tok=d["num_experts_per_tok"],
        moe_intermediate_size=d["moe_intermediate_size"],
        norm_topk_prob=d.get("norm_topk_prob", False),
        decoder_sparse_step=d.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(layers),
        router_aux_loss_coef=d.get("router_aux_loss_coef", 0.001),
        output_router_logits=d.get("output_router_logits", False),
    )
    if shared_expert:  # an absent norm_topk_prob: True, both shared-expert families' default (or fixed value)
        kw["norm_topk_prob"] = d.get("norm_topk_prob", True)
        kw["shared_expert_intermediate_size"] = d["shared_expert_intermediate_size"]
    cfg = MoEConfig(**kw)
    try:
        cfg.check(num_hidden_layers, shared_expert=shared_expert, fixed=fixed, family=family)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return cfg
