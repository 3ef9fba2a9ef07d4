"""MoE routing: softmax top-k over router logits, and the token-to-expert sort.

Contract: logits (T, E) any float dtype (the router GEMM's output), k <= E.
`topk_softmax(logits, k, norm)` -> (weights (T, k) fp32, experts (T, k) int64):
    p = softmax(logits) in fp32                     (T, E)
    experts[t] = the k largest p[t], descending; ties go to the lower expert index
    weights[t, j] = p[t, experts[t, j]]              / sum_j p[t, experts[t, j]] if norm
The weights stay fp32 (transformers casts them to the logits' dtype before the combine;
fp32 makes the combine one rounding, not two). Differentiable w.r.t. logits through the
weights, as in transformers; the choice of experts carries no gradient.

Steps (every one depends on the row alone, so routing is batch-invariant in both
numerics -- the router logits' bits are the exact linear's job):
  1. m = max_e l[e];  q = exp(l - m);  s = sum_e q (fp32);  p = q / s
  2. k rounds of argmax over the not-yet-taken experts (the lowest index among equals)
  3. norm: the k values summed left to right (slot order), each divided by that sum
The exact reference sums step 1 by pairwise halving and applies exp through
`invariant.pointwise` (CPU exp rounds its SIMD body and tail differently); the fast
reference uses torch's softmax. The Triton kernel does one row a program, E padded to a
power of two with -inf.

`sort_by_expert(experts, E)` -> (order (T k,), offsets (E+1,), slot_pos (T, k)), int64:
the (token, slot) pairs, flattened as t k + j, stably sorted by expert id: sorted row r
holds pair order[r] (token order[r] // k), expert e owns sorted rows offsets[e] :
offsets[e+1] (empty for an expert with no token), and pair (t, j) sits at sorted row
slot_pos[t, j]. Integer ops in torch (a stable sort, a binary search, a scatter of a
permutation): exact and deterministic on any device, no host sync.
Tests: python -m pytest -q tests/test_kernel_moe.py -k routing
"""

from __future__ import annotations

import dataclasses

import torch

from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.invariant import pairwise_sum, pointwise


@dataclasses.dataclass(frozen=True, slots=True)
class Routing:
    """One MoE layer's routing of T tokens, k experts each, over E experts."""
    weights: torch.Tensor    # (T, k) fp32
    experts: torch.Tensor    # (T, k) int64
    order: torch.Tensor      # (T k,) int64: sorted row -> pair t k + j
    offsets: torch.Tensor    # (E+1,) int64: expert e's sorted rows
    slot_pos: torch.Tensor   # (T, k) int64: pair (t, j) -> sorted row

    @property
    def top_k(self) -> int:
        return self.experts.shape[1]

    @property
    def counts(self) -> torch.Tensor:
        """(E,) int64: (token, slot) pairs routed to each expert."""
        return self.offsets[1:] - self.offsets[:-1]


def _check(logits: torch.Tensor, k: int) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"moe routing: logits must be a float (T, E) tensor, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"moe routing: top-k must be an integer in [1, num_experts = {logits.shape[1]}], got {k!r}")


def _select(p: torch.Tensor, k: int, norm: bool, exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2-3 on fp32 probabilities p (T, E)."""
    # a stable descending sort puts equal values in index order: ties go to the lower index
    # (torch.topk does not promise which of two equal values it returns)
    experts = torch.sort(p, dim=-1, descending=True, stable=True).indices[:, :k]
    v = p.gather(1, experts)
    if norm:
        if exact:
            s = v[:, 0]
            for j in range(1, k):  # slot order, left to right
                s = s + v[:, j]
            v = v / s[:, None]
        else:
            v = v / v.sum(-1, keepdim=True)
    return v, experts


def topk_softmax_ref(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast reference (torch's softmax)."""
    _check(logits, k)
    return _select(torch.softmax(logits.float(), dim=-1), k, norm, exact=False)


def topk_softmax_exact_ref(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch-invariant reference: each row reduced in an order fixed by E."""
    _check(logits, k)
    l = logits.float()
    q = pointwise(torch.exp, l - l.amax(-1, keepdim=True))
    p = q / pairwise_sum(q, -1)[:, None]
    return _select(p, k, norm, exact=True)


def topk_softmax(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Public op: (weights (T, k) fp32, experts (T, k) int64); see the module docstring."""
    _check(logits, k)
    if resolve_backend("moe_routing", logits) == "triton":  # one row a program: invariant in both numerics
        return triton_ops("moe.triton_routing").topk_softmax(logits, k, norm)
    return (topk_softmax_exact_ref if is_exact() else topk_softmax_ref)(logits, k, norm)


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, offsets, slot_pos) of `experts` (T, k); see the module docstring."""
    flat = experts.reshape(-1)
    keys, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=keys.dtype)
    offsets = torch.searchsorted(keys, bounds)  # first sorted row of expert e (left side)
    slot_pos = torch.empty_like(order)
    slot_pos[order] = torch.arange(order.numel(), device=order.device)  # a permutation: no two writes collide
    return order, offsets, slot_pos.view(experts.shape)


def routing_mismatch(experts_a: torch.Tensor, experts_b: torch.Tensor) -> torch.Tensor:
    """The fraction of rows (token-layer pairs) whose top-k expert *sets* differ between two
    routings (T, k) of the same tokens, e.g. the rollout's and the trainer's: the metric
    `moe/routing_mismatch`. A 0-dim fp32 tensor (no host sync)."""
    if experts_a.shape != experts_b.shape:
        raise ValueError(f"routing_mismatch: expert choices of shapes {tuple(experts_a.shape)} and "
                         f"{tuple(experts_b.shape)}; expected the same (T, k)")
    differ = (experts_a.sort(-1).values != experts_b.sort(-1).values).any(-1)
    return differ.float().mean() if differ.numel() else differ.new_zeros((), dtype=torch.float32)


def route(logits: torch.Tensor, k: int, norm: bool) -> Routing:
    """topk_softmax, then sort_by_expert: everything the experts and the combine need."""
    weights, experts = topk_softmax(logits, k, norm)
    order, offsets, slot_pos = sort_by_expert(experts, logits.shape[1])
    return Routing(weights, experts, order, offsets, slot_pos)
