"""LoRA adapters on the live model: applied at every forward, never merged into the base.

    attach_lora(model, LoRAConfig(rank=8))     # every projection of every layer
    opt = AdamW([p for _, p in lora_parameters(model)])   # A and B only
    with adapters_off(model): ref = forward(...)          # the base model, same weights
    ref_model = BaseModelView(model)                      # the same, called like the model

`attach_lora` swaps each target projection (a `transformer.Linear`) for a `LoRALinear`
that shares the projection's weight and bias tensors (nothing is copied) and adds the
adapter A (r, in) and B (out, r). Every base parameter of the model (projections,
embeddings, norms, LM head) gets requires_grad False: it stays in its dtype, and no
gradient, optimizer state or fp32 master copy is ever made for it. Only A and B train.

The engine calls `model.forward` like the trainer, so rollouts run the same
`rlfuse.kernels.linear.lora.lora_linear` (prefill, eager decode, and CUDA graphs, which read A
and B at replay: an optimizer step's in-place update is seen by the next replay). In
exact numerics rollout log-probs equal the trainer's bitwise with adapters on as without.

`adapters_off(model)` switches every adapter off for the enclosed forwards: each target
runs `linear(x, W, b)`, bit for bit the base model, which makes the KL / DPO reference
model free. It is meant for no-grad reference forwards: a gradient-checkpointed forward
recomputes in backward, after the switch is restored. The engine notices a switch (its
decode graphs recorded the adapters as they were) and re-captures.

Init (PEFT's): A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform, a = sqrt 5), B = 0, so a
fresh adapter leaves the model's output unchanged. Scale s = alpha / r (rsLoRA: alpha /
sqrt r). Dropout on the adapter branch's input, only in a training forward that records
gradients (a no-grad forward, e.g. a rollout on a model left in train mode, never drops).
PEFT folders (load / export) and the merged HF export: `rlfuse.model.lora_peft`.
Test: python -m pytest -q tests/test_lora.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from rlfuse.kernels.linear.gemm import linear
from rlfuse.kernels.linear.lora import lora_linear
from rlfuse.kernels.moe import ExpertLoRA, experts_mlp
from rlfuse.model.causal_lm import CausalLM
from rlfuse.model.layers import Linear
from rlfuse.model.layers.moe import Experts, SparseMoeBlock

log = logging.getLogger(__name__)

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# Gated DeltaNet (hybrid models' linear-attention layers, rlfuse.model.layers.gated_deltanet)
LINEAR_ATTENTION_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# Qwen3-Next's fused input projections (layers.FusedGatedDeltaNet; transformers' and PEFT's names)
FUSED_LINEAR_ATTENTION_TARGETS = ("in_proj_qkvz", "in_proj_ba")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS + LINEAR_ATTENTION_TARGETS[:-1] + FUSED_LINEAR_ATTENTION_TARGETS + ("out_proj",)
ALL_LINEAR = "all-linear"
FUSED_GROUPS = ("qkv_fused", "gate_up_fused", "in_proj_fused")  # the layers' fused-group attributes (rlfuse.model.fuse.GROUPS)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoRAConfig:
    """Defaults follow "LoRA Without Regret" (Thinking Machines, 2025): adapters on every
    linear layer, the MLP included, alpha 32; the learning rate is typically ~10x the full
    fine-tune's."""
    rank: int = 16
    """Adapter rank r: A is (r, in_features), B is (out_features, r)."""
    alpha: float = 32.0
    """The update is (alpha / rank) * B A (alpha / sqrt(rank) with rslora)."""
    targets: str | tuple[str, ...] = ALL_LINEAR
    """'all-linear' (every projection of every layer: q/k/v/o, gate/up/down, and a hybrid
    model's linear-attention in_proj_qkv/z/b/a (Qwen3-Next: in_proj_qkvz/ba) and out_proj;
    never the LM head) or a list of projection names, e.g. [q_proj, v_proj]."""
    dropout: float = 0.0
    """Dropout probability on the adapter branch's input in training forwards."""
    rslora: bool = False
    """Rank-stabilized scale alpha / sqrt(rank) (PEFT's use_rslora)."""
    path: str | None = None
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start
    from; its rank, alpha, targets and rslora are used, and a value set here must agree."""
    experts: bool = False
    """MoE models: also adapt every routed expert's gate_up and down GEMMs, one A/B pair per
    expert (rank and scale as above), applied inside the grouped GEMMs in the rollout and the
    trainer alike. PEFT folders do not carry them (an rlfuse side file does); the merged
    export does. The routers stay frozen."""
    export_merged: bool = False
    """Also write an HF folder with the adapter merged into the weights (W + s B A rounded
    to the weights' dtype) beside the PEFT adapter: RUN_DIR/final_merged, for tools that
    cannot apply an adapter. Rounding in bf16 loses part of a small update; rlfuse itself
    trains and generates with the unmerged adapter."""

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"lora.rank must be a positive integer, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"lora.alpha must be a positive number, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be a number in [0, 1), got {self.dropout!r}")
        if not isinstance(self.experts, bool):
            raise ValueError(f"lora.experts must be true or false, got {self.experts!r}")
        if not isinstance(self.export_merged, bool):
            raise ValueError(f"lora.export_merged must be true or false, got {self.export_merged!r}")
        targets = self.targets
        if isinstance(targets, str):
            if targets != ALL_LINEAR:
                raise ValueError(f"lora.targets must be {ALL_LINEAR!r} or a list of {list(TARGETS)}, got {targets!r}")
        else:
            if not isinstance(targets, (list, tuple)) or not targets:
                raise ValueError(f"lora.targets must be {ALL_LINEAR!r} or a non-empty list of {list(TARGETS)}, "
                                 f"got {targets!r}")
            bad = [t for t in targets if t not in TARGETS]
            if bad:
                raise ValueError(f"lora.targets: unknown projection(s) {bad}; valid: {list(TARGETS)} "
                                 f"or {ALL_LINEAR!r}")
            if len(set(targets)) != len(targets):
                raise ValueError(f"lora.targets lists a projection twice: {list(targets)}")
            object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in targets))

    @property
    def target_names(self) -> tuple[str, ...]:
        return TARGETS if self.targets == ALL_LINEAR else self.targets

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class LoRALinear(Linear):
    """A target projection with its adapter: y = x W^T + b + s (x A^T) B^T through
    `rlfuse.kernels.linear.lora.lora_linear`. `weight` and `bias` are the base projection's own
    tensors (same state-dict names); `lora_A`, `lora_B` are the adapter, `cfg` the
    LoRAConfig it was attached with. With a `bank` (serving several adapters) each row runs
    its own adapter of the bank instead."""

    adapter_params = ("lora_A", "lora_B")
    """Parameters that are no part of the HF checkpoint (`rlfuse.model.weights` skips them)."""

    def __init__(self, base: Linear, cfg: LoRAConfig):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(cfg.rank, self.in_features, dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, cfg.rank, dtype=w.dtype, device=w.device))
        self.cfg, self.scale, self.dropout, self.enabled = cfg, cfg.scale, float(cfg.dropout), True
        self.bank = None  # a rlfuse.model.lora_bank.ProjectionBank: each row runs its own adapter
        self._joined = None  # ((WA, bA), the pointers it was made at): see join_

    def join_(self) -> None:
        """Move weight and lora_A into one buffer (rows of W, then of A; the bias beside r
        zeros), each a view of it: a fast no-gradient forward then runs the base GEMM and the
        shrink as one GEMM (`lora_linear(joined=...)`). `rlfuse.model.fuse.fuse_projections`
        calls it for adapted projections outside a fused group; anything that moves the
        tensors afterwards (`.to()`) just ends it."""
        N = self.out_features
        with torch.no_grad():
            wa = torch.cat([self.weight.detach(), self.lora_A.detach()])
            self.weight.data, self.lora_A.data = wa[:N], wa[N:]
            ba = None
            if self.bias is not None:
                ba = torch.cat([self.bias.detach(), self.bias.new_zeros(self.lora_A.shape[0])])
                self.bias.data = ba[:N]
        self._joined = ((wa, ba), self._pointers())

    def is_joined(self) -> bool:
        """join_ ran and nothing moved the tensors since."""
        return self._joined is not None and self._joined[1] == self._pointers()

    def _pointers(self):
        return tuple(t.data_ptr() for t in (self.weight, self.lora_A, self.bias) if t is not None)

    def forward(self, x):
        if not self.enabled:
            return linear(x, self.weight, self.bias)
        if self.bank is not None:
            bk = self.bank
            rows = bk.rows(x.numel() // x.shape[-1])
            return lora_linear(x, self.weight, self.bias, bk.A, bk.B, bk.scale, adapter=rows)
        x_a = None
        if self.dropout > 0 and self.training and torch.is_grad_enabled():
            x_a = F.dropout(x, self.dropout, training=True)
        joined = self._joined[0] if self.is_joined() else None
        return lora_linear(x, self.weight, self.bias, self.lora_A, self.lora_B, self.scale, x_a, joined=joined)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scale={self.scale:g}"


class LoRAExperts(Experts):
    """An MoE block's routed experts with per-expert adapters (`lora.experts`): the base
    `gate_up_proj` / `down_proj` tensors shared (same state-dict names), plus
    gate_up_A (E, r, D), gate_up_B (E, 2I, r), down_A (E, r, I), down_B (E, D, r), applied by
    `rlfuse.kernels.moe.experts_mlp` in the grouped GEMMs' path."""

    adapter_params = ("gate_up_A", "gate_up_B", "down_A", "down_B")
    """Parameters that are no part of the HF checkpoint (`rlfuse.model.weights` skips them)."""

    def __init__(self, base: Experts, cfg: LoRAConfig):
        nn.Module.__init__(self)
        self.gate_up_proj, self.down_proj = base.gate_up_proj, base.down_proj
        w = base.gate_up_proj
        E, two_i, D = w.shape
        kw = dict(dtype=w.dtype, device=w.device)
        self.gate_up_A = nn.Parameter(torch.empty(E, cfg.rank, D, **kw))
        self.gate_up_B = nn.Parameter(torch.zeros(E, two_i, cfg.rank, **kw))
        self.down_A = nn.Parameter(torch.empty(E, cfg.rank, two_i // 2, **kw))
        self.down_B = nn.Parameter(torch.zeros(E, D, cfg.rank, **kw))
        self.cfg, self.scale, self.dropout, self.enabled = cfg, cfg.scale, float(cfg.dropout), True

    def forward(self, x_TD, r):
        if not self.enabled:
            return super().forward(x_TD, r)
        drop = None
        if self.dropout > 0 and self.training and torch.is_grad_enabled():
            drop = lambda t: F.dropout(t, self.dropout, training=True)  # noqa: E731
        return experts_mlp(x_TD, self.gate_up_proj, self.down_proj, r,
                           ExpertLoRA(self.gate_up_A, self.gate_up_B, self.down_A, self.down_B, self.scale, drop))

    def merged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up + s B A, down + s B A) per expert, in the base dtype (the merged export)."""
        gu = self.gate_up_proj.float() + self.scale * self.gate_up_B.float() @ self.gate_up_A.float()
        dn = self.down_proj.float() + self.scale * self.down_B.float() @ self.down_A.float()
        return gu.to(self.gate_up_proj.dtype), dn.to(self.down_proj.dtype)


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """(module name, LoRALinear) of every projection adapter, in module order (expert
    adapters: `expert_lora_modules`)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def expert_lora_modules(model: nn.Module) -> list[tuple[str, LoRAExperts]]:
    """(module name, LoRAExperts) of every MoE block's expert adapters, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRAExperts)]


def _all_adapters(model: nn.Module) -> list[tuple[str, LoRALinear | LoRAExperts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAExperts))]


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(parameter name, tensor) of every adapter tensor (projections' A and B, experts'
    A and B): what the optimizer gets."""
    return [(f"{n}.{p}", getattr(m, p)) for n, m in _all_adapters(model) for p in m.adapter_params]


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, (LoRALinear, LoRAExperts)) for m in model.modules())


def lora_config(model: nn.Module) -> LoRAConfig:
    """The LoRAConfig the model's adapters were attached with."""
    mods = lora_modules(model)
    if not mods:
        raise ValueError("the model has no LoRA adapters")
    return mods[0][1].cfg


def adapter_switches(model: nn.Module) -> tuple[bool, ...]:
    """Each adapter's on/off state, in module order (() without adapters): the engine
    compares it between requests, since its decode graphs and cached prefixes were
    computed under one state."""
    return tuple(m.enabled for m in model.modules() if isinstance(m, (LoRALinear, LoRAExperts)))


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """Run the enclosed forwards as the base model (every adapter off); restored on exit."""
    mods = [m for _, m in _all_adapters(model)]
    was = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield model
    finally:
        for m, e in zip(mods, was):
            m.enabled = e


class BaseModelView:
    """The model with its adapters off, called like the model: the KL / DPO reference with
    no second copy of the weights. `requires_grad_`, `eval` and `train` are accepted and do
    nothing (the base is frozen already, and switching the view would switch the policy);
    a no-grad forward never applies dropout anyway."""

    def __init__(self, model: CausalLM):
        if not has_lora(model):
            raise ValueError("BaseModelView: the model has no LoRA adapters")
        self.model = model

    def __call__(self, *args, **kwargs):
        with adapters_off(self.model):
            return self.model(*args, **kwargs)

    def encode_images(self, *args, **kwargs):
        return self.model.encode_images(*args, **kwargs)  # the vision tower carries no adapter

    @property
    def config(self):
        return self.model.config

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.lm_head_weight

    @property
    def kernels(self):
        return self.model.kernels

    def token_logprobs(self, *args, **kwargs):
        return self.model.token_logprobs(*args, **kwargs)  # the LM head carries no adapter

    @property
    def training(self) -> bool:
        return self.model.training

    def requires_grad_(self, requires_grad: bool = True) -> "BaseModelView":
        return self

    def eval(self) -> "BaseModelView":
        return self

    def train(self, mode: bool = True) -> "BaseModelView":
        return self


@torch.no_grad()
def init_lora_(model: nn.Module, seed: int = 0, b_std: float = 0.0) -> None:
    """PEFT's init: A kaiming-uniform (bound 1/sqrt(in)), B zero, drawn in fp32 on the CPU
    from `seed` so every device and dtype starts from the same values. `b_std` > 0 draws B
    from N(0, b_std^2) instead: an adapter that changes the output from the start, for
    checks and tests (with B = 0 they would compare the base model)."""
    g = torch.Generator().manual_seed(seed)
    for _, m in lora_modules(model):
        bound = 1.0 / math.sqrt(m.in_features)
        m.lora_A.copy_(torch.empty(m.lora_A.shape, dtype=torch.float32).uniform_(-bound, bound, generator=g))
        m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * b_std if b_std > 0 else
                       torch.zeros(m.lora_B.shape))
    for _, m in expert_lora_modules(model):  # after the projections: their draws are unchanged
        for a, b in (("gate_up_A", "gate_up_B"), ("down_A", "down_B")):
            A, B = getattr(m, a), getattr(m, b)
            bound = 1.0 / math.sqrt(A.shape[2])
            A.copy_(torch.empty(A.shape, dtype=torch.float32).uniform_(-bound, bound, generator=g))
            B.copy_(torch.randn(B.shape, generator=g) * b_std if b_std > 0 else torch.zeros(B.shape))


def attach_lora(model: CausalLM, cfg: LoRAConfig, *, seed: int = 0) -> list[str]:
    """Add an adapter to every target projection of `model` (in place), freeze every base
    parameter, initialize the adapters (PEFT's init from `seed`). Returns the adapted
    module names. `cfg.path` is for `rlfuse.model.lora_peft.load_peft_adapter`, which
    calls this and then loads the folder's A and B."""
    if has_lora(model):
        raise ValueError("attach_lora: the model already has LoRA adapters")
    names = []
    for name, mod in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in cfg.target_names and type(mod) is Linear and name.startswith("model.layers."):
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            setattr(parent, leaf, LoRALinear(mod, cfg))
            names.append(name)
            for attr in FUSED_GROUPS:  # a fused group over the replaced projection: gone, not stale
                if leaf in getattr(getattr(parent, attr, None), "names", ()):
                    setattr(parent, attr, None)  # the engine fuses the adapted group (rlfuse.model.fuse)
    if not names:
        raise ValueError(f"attach_lora: no projection named {list(cfg.target_names)} in the model")
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, SparseMoeBlock)]
    if cfg.experts:
        if not blocks:
            raise ValueError("lora.experts is true but the model has no MoE layers")
        for n, b in blocks:
            b.experts = LoRAExperts(b.experts, cfg)
            names.append(f"{n}.experts")
    for p in model.parameters():
        p.requires_grad_(False)
    for _, p in lora_parameters(model):
        p.requires_grad_(True)
    init_lora_(model, seed)
    n_train = sum(p.numel() for _, p in lora_parameters(model))
    n_all = sum(p.numel() for p in model.parameters())
    log.info("LoRA: rank %d, scale %g, on %d projections (%s): %d trainable parameters, %.3f%% of %d",
             cfg.rank, cfg.scale, len(names), ", ".join(cfg.target_names), n_train, 100 * n_train / n_all, n_all)
    if blocks and not cfg.experts:  # said, not silent
        log.warning("LoRA: the routed experts and routers of %d MoE layers get no adapter (frozen); set "
                    "lora.experts: true for per-expert adapters", len(blocks))
    elif blocks:
        log.info("LoRA: per-expert adapters on the routed experts of %d MoE layers (routers frozen)", len(blocks))
    return names


def _train_state_bytes(p: torch.Tensor) -> int:
    # what `rlfuse.train.optim.AdamW` keeps per trained tensor: the gradient (the
    # tensor's dtype), an fp32 master unless the tensor is fp32, two fp32 moments
    return p.numel() * (p.element_size() + (0 if p.dtype == torch.float32 else 4) + 8)


def lora_memory(model: nn.Module) -> dict[str, float]:
    """Parameter counts and the training state LoRA avoids, computed from the shapes (not
    measured): the gradients, fp32 masters and Adam moments a full fine-tune keeps for
    every parameter, less what the adapters' own weights and training state take."""
    adapter = [p for _, p in lora_parameters(model)]
    ids = {id(p) for p in adapter}
    base = [p for p in model.parameters() if id(p) not in ids]
    full = sum(_train_state_bytes(p) for p in base)
    lora = sum(_train_state_bytes(p) + p.numel() * p.element_size() for p in adapter)
    return {"lora/trainable_params": float(sum(p.numel() for p in adapter)),
            "lora/frozen_params": float(sum(p.numel() for p in base)),
            "lora/saved_train_state_gib": (full - lora) / 2**30}
