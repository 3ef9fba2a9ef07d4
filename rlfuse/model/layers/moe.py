"""The sparse mixture-of-experts block of Qwen3-MoE and Qwen3.5-MoE (and its router losses
and metrics).

Parameter names and layouts equal transformers 5.24's `Qwen3MoeSparseMoeBlock`:
    gate.weight               (E, D)       the router (a bias-free linear)
    experts.gate_up_proj      (E, 2I, D)   gate rows first, then up rows
    experts.down_proj         (E, D, I)
and, with a shared expert (`Qwen3_5MoeSparseMoeBlock`, shared_expert_intermediate_size Is > 0):
    shared_expert.{gate,up}_proj.weight (Is, D), shared_expert.down_proj.weight (D, Is)
    shared_expert_gate.weight (1, D)
Published checkpoints (and vLLM) store the experts one by one instead,
`experts.{e}.gate_proj.weight` (I, D), `experts.{e}.up_proj.weight` (I, D),
`experts.{e}.down_proj.weight` (D, I): `fuse_expert_tensors` assembles them, and
`split_expert_tensors` writes that layout back (transformers reads both).

Forward, x (T, D) -> (T, D) in x.dtype (steps, each an op of `rlfuse.kernels.moe`):
  1. router logits = linear(x, gate.weight)   (T, E), the exact linear in exact numerics
  2. routing = route(logits, top_k, norm_topk_prob)   softmax top-k + the expert sort
  3. out = experts_mlp(x, gate_up_proj, down_proj, routing)
  4. (shared expert) out = out + sigmoid(linear(x, shared_expert_gate.weight)) * shared_expert(x),
     the shared expert a dense SwiGLU MLP; in that order and in x.dtype, as transformers
In exact numerics every step is batch-invariant, so the router logits -- and with them
the experts each token picks -- are the same bits in the engine's decode and the trainer's
packed forward: no routing replay is needed.

Router losses (the block records `RouterStats` when `record_stats` is on -- the config's
`output_router_logits`, transformers' switch for adding the loss -- and grad is enabled;
off, no (T, E) tensors of the stats' graph outlive the forward):
  * `load_balancing_loss` is transformers' `load_balancing_loss_func` (Switch Transformer):
      f_e = (top-k assignments to e) / rows,  P_e = (sum of softmax probs of e) / rows,
      summed over layers before the product: loss = E * sum_e f_e P_e,
    with the softmax in the logits' dtype and the top-k recomputed from it by torch.topk, as
    transformers does (so in bf16, where rounded probabilities tie, f may count another
    expert than the router's fp32 choice); the gradient flows through P only.
  * `router_z_loss` (ST-MoE): mean over token-layer rows of logsumexp(logits)^2, in fp32.
Metrics (`moe_metrics`): per layer, the routed (token, slot) pairs of the busiest and the
idlest expert over the mean (1.0 = balanced), as tensors (no host sync here).
Shape legend: T tokens, D hidden, E experts, I expert intermediate size, k top-k.
Test: python -m pytest -q tests/test_moe_block.py
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from rlfuse.kernels.invariant import elementwise
from rlfuse.kernels.linear.gemm import linear
from rlfuse.kernels.moe import experts_mlp, route
from rlfuse.model.layers.linear import Linear


@dataclasses.dataclass(frozen=True, slots=True)
class RouterStats:
    """One layer's share of the router losses, from one forward."""
    counts: torch.Tensor    # (E,) fp32: top-k assignments per expert (transformers' recipe; mask-weighted)
    prob_sum: torch.Tensor  # (E,) fp32: softmax probabilities summed over rows (differentiable)
    z_sum: torch.Tensor     # () fp32: logsumexp(logits)^2 summed over rows (differentiable)
    rows: torch.Tensor      # () fp32: rows counted (the mask's sum)


def router_stats(logits: torch.Tensor, top_k: int, mask: torch.Tensor | None = None) -> RouterStats:
    """RouterStats of router logits (T, E); `mask` (T,) 0/1 leaves padding rows out."""
    p = torch.softmax(logits, dim=-1)  # in the logits' dtype, as transformers' loss computes it
    # torch.topk as transformers calls it: in bf16 the rounded probabilities often tie, and
    # which of two equal experts is counted is topk's choice (deterministic on one device)
    chosen = torch.topk(p, top_k, dim=-1).indices
    m = torch.ones(logits.shape[0], device=logits.device) if mask is None else mask.reshape(-1).float()
    counts = torch.zeros(logits.shape[1], device=logits.device).index_add_(
        0, chosen.reshape(-1), m.repeat_interleave(top_k))
    z = torch.logsumexp(logits.float(), dim=-1) ** 2
    return RouterStats(counts, (p.float() * m[:, None]).sum(0), (z * m).sum(), m.sum())


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> torch.Tensor:
    """transformers' load-balancing loss over the layers' stats (see the module docstring)."""
    rows = sum(s.rows for s in stats)
    f = sum(s.counts for s in stats) / rows
    P = sum(s.prob_sum for s in stats) / rows
    return (f * P).sum() * num_experts


def router_z_loss(stats: list[RouterStats]) -> torch.Tensor:
    return sum(s.z_sum for s in stats) / sum(s.rows for s in stats)


class Experts(nn.Module):
    """The E routed SwiGLU experts, as two 3-D parameters (transformers' `Qwen3MoeExperts`).
    `rlfuse.model.lora` swaps it for a subclass that adds per-expert adapters."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x_TD: torch.Tensor, r) -> torch.Tensor:
        """x (T, D) routed by r (`kernels.moe.Routing`) -> (T, D)."""
        return experts_mlp(x_TD, self.gate_up_proj, self.down_proj, r)


class SparseMoeBlock(nn.Module):
    def __init__(self, *, hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, layer_idx: int = 0, record_stats: bool = False, shared_expert=None):
        """shared_expert: the always-on expert (an `MLP`), gated per token by sigmoid(a (1, D)
        linear), or None (Qwen3-MoE)."""
        super().__init__()
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"config field 'num_experts_per_tok' is {top_k!r}; expected an integer in "
                             f"[1, num_experts = {num_experts}]")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.layer_idx, self.record_stats = layer_idx, record_stats
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, moe_intermediate_size)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        # what the last forward routed: read by moe_metrics and the trainer's router losses
        self.last_load: torch.Tensor | None = None        # (E,) int64 (token, slot) pairs, detached
        self.last_experts: torch.Tensor | None = None     # (T, k) int64 the experts each token picked
        self.last_stats: RouterStats | None = None        # with record_stats, when grad was enabled
        self.last_router_logits: torch.Tensor | None = None  # (T, E), detached
        # the engine's per-step record of the routing (a static (rows, k) int64 buffer, set
        # only around the engine's forwards, so a CUDA graph writes into it): None = off
        self.routing_buffer: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        logits = linear(x_TD, self.gate.weight)  # (T, E)
        r = route(logits, self.top_k, self.norm_topk_prob)
        out = self.experts(x_TD, r)
        if self.shared_expert is not None:
            # elementwise: in exact numerics a row's gate does not depend on the batch (CPU sigmoid's tail)
            out = out + elementwise(torch.sigmoid, self.shared_expert_gate(x_TD)) * self.shared_expert(x_TD)
        self.last_load = r.counts.detach()
        self.last_experts = r.experts
        if self.routing_buffer is not None:
            self.routing_buffer[:x_TD.shape[0]].copy_(r.experts)
        self.last_router_logits = logits.detach()  # values only: a graph tensor on a module would pin the graph
        self.last_stats = router_stats(logits, self.top_k) if self.record_stats and torch.is_grad_enabled() else None
        # not a view when x is already (T, D): FSDP2 hooks a decoder layer's outputs for backward,
        # and a view output would lose that hook to any later in-place op (torch warns)
        return out if out.shape == shape else out.view(shape)


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's MoE blocks in layer order."""
    return sorted((m for m in model.modules() if isinstance(m, SparseMoeBlock)), key=lambda b: b.layer_idx)


def collect_router_stats(model: nn.Module) -> list[RouterStats]:
    """The RouterStats of every MoE block's last forward (grad enabled), in layer order."""
    return [b.last_stats for b in moe_blocks(model) if b.last_stats is not None]


def moe_metrics(model: nn.Module) -> dict[str, torch.Tensor]:
    """`moe/*` metrics of the last forward: per layer the busiest and the idlest expert's
    share over the mean (`moe/load_max/layer_{i}`, `moe/load_min/layer_{i}`), their worst
    over layers (`moe/load_max`, `moe/load_min`), and the load-balancing loss of the last
    forward that recorded router stats (`moe/aux_loss`; see `record_stats`)."""
    out: dict[str, torch.Tensor] = {}
    blocks = [b for b in moe_blocks(model) if b.last_load is not None]
    for b in blocks:
        load = b.last_load.float()
        mean = load.mean().clamp_min(1e-9)
        out[f"moe/load_max/layer_{b.layer_idx}"] = load.max() / mean
        out[f"moe/load_min/layer_{b.layer_idx}"] = load.min() / mean
    if blocks:
        out["moe/load_max"] = torch.stack([out[f"moe/load_max/layer_{b.layer_idx}"] for b in blocks]).max()
        out["moe/load_min"] = torch.stack([out[f"moe/load_min/layer_{b.layer_idx}"] for b in blocks]).min()
    stats = collect_router_stats(model)
    if stats:
        out["moe/aux_loss"] = load_balancing_loss(stats, blocks[0].num_experts).detach()
    return out


class RouterLoss:
    """The router losses a training step adds to its loss on an MoE model, and its `moe/*`
    metrics. After each differentiable forward the trainer calls `term(share)`, `share` being
    that micro-batch's part of the step's loss normalizer (its tokens over the step's, or its
    pairs over the batch's; the shares of a step sum to 1), and adds the result to the
    micro-batch's loss:
        term = share * (aux_coef * load_balancing_loss + z_coef * router_z_loss)
    With one micro-batch this is transformers' `loss + router_aux_loss_coef * aux_loss`
    exactly; with several, the share-weighted mean of the micro-batches' terms (the loss is a
    product of batch means, so no split reproduces the whole batch's value bitwise).
    `metrics()` returns and resets the share-weighted means since its last call:
    moe/aux_loss, moe/z_loss (logged whatever the coefficients), moe/load_max and
    moe/load_min (the busiest / idlest expert's routed pairs over the mean, worst layer).
    Turns on every block's `record_stats` (two (T, E) reductions per layer; the forward's
    output is unchanged)."""

    def __init__(self, model: nn.Module, *, aux_coef: float, z_coef: float):
        self.blocks = moe_blocks(model)
        self.aux_coef, self.z_coef = float(aux_coef), float(z_coef)
        for b in self.blocks:
            b.record_stats = True
        self._reset()

    @classmethod
    def for_model(cls, model: nn.Module, *, aux_coef: float | None = None, z_coef: float = 0.0) -> RouterLoss | None:
        """None for a model without MoE blocks. `aux_coef` None: transformers' rule, the
        config's router_aux_loss_coef when its output_router_logits is true, else 0."""
        blocks = moe_blocks(model)
        if not blocks:
            return None
        if aux_coef is None:
            moe = model.config.moe
            aux_coef = moe.router_aux_loss_coef if moe.output_router_logits else 0.0
        return cls(model, aux_coef=aux_coef, z_coef=z_coef)

    @classmethod
    def for_run(cls, model: nn.Module, cfg) -> RouterLoss | None:
        """`for_model` with a run config's model.router_aux_loss_coef / router_z_loss_coef."""
        return cls.for_model(model, aux_coef=cfg.model.router_aux_loss_coef, z_coef=cfg.model.router_z_loss_coef)

    def _reset(self) -> None:
        self._aux = self._z = self._share = 0.0
        self._load: list[torch.Tensor | float] = [0.0] * len(self.blocks)

    def term(self, share: float = 1.0, *, pad: bool = False) -> torch.Tensor:
        """The weighted router losses of the last forward (its stats are consumed: a second
        call without a forward in between raises). `pad`: the forward was a data-parallel
        padding micro-batch (zero weight, it repeats real rows): its loads are not counted,
        or the ranks' summed loads would count those rows twice."""
        stats = [b.last_stats for b in self.blocks]
        if any(s is None for s in stats):
            raise RuntimeError("RouterLoss.term: no router stats of a differentiable forward since the last call")
        aux = load_balancing_loss(stats, self.blocks[0].num_experts)
        z = router_z_loss(stats)
        for i, b in enumerate(self.blocks):
            if not pad:
                self._load[i] = self._load[i] + b.last_load.float()
            b.last_stats = None  # the graph tensors go with the loss, not with the module
        self._aux = self._aux + share * aux.detach()
        self._z = self._z + share * z.detach()
        self._share += share
        return share * (self.aux_coef * aux + self.z_coef * z)

    def metrics(self, mean_across: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The step's moe/* metrics (see the class docstring), reset. Data-parallel,
        `mean_across` (a tensor -> its mean over the ranks, e.g. `partial(
        rlfuse.run.distributed.mean_across_ranks, ctx)`) makes them the whole batch's: the
        per-expert loads are averaged over the ranks before the busiest / idlest ratios are
        taken (a ratio of the summed loads, not a mean of the ranks' ratios), and the losses
        are the mean of the ranks' (equal shares of the batch). One collective, no host sync."""
        if not self._share:
            return {}
        share = torch.as_tensor(self._share, dtype=torch.float32)
        loads = torch.stack([torch.as_tensor(x, dtype=torch.float32) for x in self._load])  # (L, E)
        packed = torch.cat([loads.flatten(), torch.stack([torch.as_tensor(v, dtype=torch.float32).to(loads.device)
                                                          for v in (self._aux, self._z)]) / share.to(loads.device)])
        if mean_across is not None:
            packed = mean_across(packed)
        loads, (aux, z) = packed[:loads.numel()].view(loads.shape), packed[loads.numel():]
        ratio = loads / loads.mean(1, keepdim=True).clamp_min(1e-9)
        self._reset()
        return {"moe/aux_loss": aux, "moe/z_loss": z, "moe/load_max": ratio.max(), "moe/load_min": ratio.min()}


# ---------------------------------------------------------------- checkpoint layouts

EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")


def per_expert_names(prefix: str, num_experts: int) -> list[str]:
    """The published layout's tensor names of one block (prefix: e.g. "model.layers.3.mlp.")."""
    return [f"{prefix}experts.{e}.{p}.weight" for e in range(num_experts) for p in ("gate_proj", "up_proj", "down_proj")]


def named_blocks(model: nn.Module) -> list[tuple[str, SparseMoeBlock]]:
    """(parameter-name prefix such as "model.layers.3.mlp.", block) of every MoE block."""
    return [(f"{n}." if n else "", m) for n, m in model.named_modules() if isinstance(m, SparseMoeBlock)]


@torch.no_grad()
def copy_expert_tensors(get, prefix: str, gate_up: torch.Tensor, down: torch.Tensor,
                        where: str = "checkpoint") -> None:
    """Fill gate_up (E, 2I, D) and down (E, D, I) from the per-expert tensors of block
    `prefix` (e.g. "model.layers.3.mlp."), `get(name)` returning one or None when absent,
    one expert at a time (no second copy of the block). A missing or mis-shaped expert
    tensor: a ValueError naming it."""
    E, two_i, D = gate_up.shape
    inter = two_i // 2
    want = {"gate_proj": (inter, D), "up_proj": (inter, D), "down_proj": (D, inter)}
    for e in range(E):
        dst = {"gate_proj": gate_up[e, :inter], "up_proj": gate_up[e, inter:], "down_proj": down[e]}
        for p, shape in want.items():
            name = f"{prefix}experts.{e}.{p}.weight"
            t = get(name)
            if t is None:
                raise ValueError(f"{where}: missing tensor {name!r} (expert {e} of num_experts = {E})")
            if tuple(t.shape) != shape:
                raise ValueError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, the config expects {shape}")
            dst[p].copy_(t)


def fuse_expert_tensors(get, prefix: str, num_experts: int, hidden_size: int, intermediate_size: int,
                        where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """{prefix + "experts.gate_up_proj": (E, 2I, D), prefix + "experts.down_proj": (E, D, I)}
    assembled from the per-expert tensors (`copy_expert_tensors`), in their dtype."""
    first = get(f"{prefix}experts.0.gate_proj.weight")
    dtype = first.dtype if first is not None else torch.float32
    gate_up = torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype)
    down = torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype)
    copy_expert_tensors(get, prefix, gate_up, down, where)
    return {prefix + EXPERT_PARAMS[0]: gate_up, prefix + EXPERT_PARAMS[1]: down}


def split_expert_tensors(prefix: str, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inverse of `fuse_expert_tensors`: the published per-expert layout."""
    inter = gate_up.shape[1] // 2
    out = {}
    for e in range(gate_up.shape[0]):
        out[f"{prefix}experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
        out[f"{prefix}experts.{e}.up_proj.weight"] = gate_up[e, inter:]
        out[f"{prefix}experts.{e}.down_proj.weight"] = down[e]
    return out


def published_layout(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with every block's fused expert tensors replaced by the
    per-expert ones (what transformers' save_pretrained writes, and what vLLM reads)."""
    tensors = dict(named)
    out = []
    for name, t in named:
        if name.endswith(EXPERT_PARAMS[0]):
            prefix = name[:-len(EXPERT_PARAMS[0])]
            out += split_expert_tensors(prefix, t, tensors[prefix + EXPERT_PARAMS[1]]).items()
        elif not name.endswith(EXPERT_PARAMS[1]):
            out.append((name, t))
    return out
