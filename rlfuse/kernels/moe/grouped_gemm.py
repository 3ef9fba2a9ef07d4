"""Grouped GEMM over expert-sorted rows: y[r] = x[r] W[e]^T for the rows r of expert e.

Contract: x (M, K) rows sorted by expert (`routing.sort_by_expert`), weight (E, N, K),
offsets (E+1,) int64 with expert e owning rows offsets[e] : offsets[e+1] (possibly none;
offsets[E] = M); one float dtype; y (M, N) in x.dtype. Differentiable w.r.t. x and weight:
    dx[r]  = dy[r] W[e]                   (M, K)
    dW[e]  = sum_{r of e} dy[r]^T x[r]    (E, N, K); zero for an expert with no row
The experts' gate/up projection is one call with weight (E, 2I, D) (gate rows first, as
transformers stores `experts.gate_up_proj`), the down projection one with (E, D, I).

Numerics: the Triton kernel, in both numerics, reduces every element in the exact linear's
canonical order (`rlfuse.kernels.linear`: K cut into CHUNK_K chunks, each accumulated from
zero BLOCK_K at a time, the chunks added left to right), which depends on (K, dtype) only.
So a row's output depends on its own x row and its expert's weight alone -- not on which
other tokens share the batch or the expert, nor on how many rows an expert received (no
split over rows, no split-K by load) -- and it equals `linear(x[r], W[e])` of exact
numerics bit for bit. The torch backend runs F.linear per expert in fast numerics (batch-
variant on CPU, like the dense linear) and `matmul_nt` per expert in exact numerics.

Steps (Triton):
  1. tile table, on the device (no host sync): expert e gets cdiv(count_e, BLOCK_M) row
     tiles starting at offsets[e]; the grid has cdiv(M, BLOCK_M) + E row-tile slots (a
     bound on the tiles any routing needs), the unused ones exit at once;
  2. forward: program (slot, column tile) sums its tile of x W[e]^T in the canonical
     order (the exact linear's tile function) and rounds once to the output dtype;
  3. dx: the same grid with W[e] read transposed (contraction over N);
  4. dW: program (expert, N tile, K tile) walks its expert's rows BLOCK_R at a time.
The backward is deterministic (fixed loops, no atomics); it need not be batch-invariant.

The references read the offsets on the host (a reference's host sync, never the Triton path's).
Tests: python -m pytest -q tests/test_kernel_moe.py -k grouped
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.invariant import matmul_nt


def _check(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"grouped_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}: expected x (M, K) "
                         f"and weight (E, N, K)")
    if offsets.shape != (weight.shape[0] + 1,) or offsets.dtype != torch.int64:
        raise ValueError(f"grouped_linear: offsets must be int64 (E+1,) = ({weight.shape[0] + 1},), got "
                         f"{offsets.dtype} {tuple(offsets.shape)}")
    if x.dtype != weight.dtype or not x.is_floating_point():
        raise ValueError(f"grouped_linear: x and weight must share one float dtype, got {x.dtype}, {weight.dtype}")


def _spans(offsets: torch.Tensor) -> list[tuple[int, int, int]]:
    # host sync: the references slice per expert (the Triton path reads offsets on the device)
    o = offsets.tolist()
    return [(e, o[e], o[e + 1]) for e in range(len(o) - 1) if o[e + 1] > o[e]]


def grouped_linear_ref(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Fast reference: F.linear per expert."""
    y = x.new_zeros((x.shape[0], weight.shape[1]))
    for e, a, b in _spans(offsets):
        y[a:b] = F.linear(x[a:b], weight[e])
    return y


def grouped_linear_exact_ref(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Exact reference: each row's products summed by pairwise halving over K."""
    y = x.new_zeros((x.shape[0], weight.shape[1]))
    for e, a, b in _spans(offsets):
        y[a:b] = matmul_nt(x[a:b], weight[e]).to(x.dtype)
    return y


def grouped_linear_backward_ref(dy, x, weight, offsets, need_dx: bool, need_dw: bool):
    """(dx, dW) by torch GEMMs per expert (the references' backward)."""
    dx = torch.zeros_like(x) if need_dx else None
    dw = torch.zeros_like(weight) if need_dw else None
    for e, a, b in _spans(offsets):
        if need_dx:
            dx[a:b] = dy[a:b] @ weight[e]
        if need_dw:
            dw[e] = dy[a:b].t() @ x[a:b]
    return dx, dw


class _GroupedLinearRef(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offsets, forward):
        ctx.save_for_backward(x, weight, offsets)
        return forward(x, weight, offsets)

    @staticmethod
    def backward(ctx, dy):
        x, weight, offsets = ctx.saved_tensors
        dx, dw = grouped_linear_backward_ref(dy, x, weight, offsets, ctx.needs_input_grad[0],
                                             ctx.needs_input_grad[1])
        return dx, dw, None, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Public op: y (M, N); see the module docstring. Triton in both numerics (its order is
    the canonical one either way); the torch backend runs the fast or the exact reference."""
    _check(x, weight, offsets)
    if resolve_backend("moe_grouped_gemm", x) == "triton":
        return triton_ops("moe.triton_grouped_gemm").grouped_linear(x, weight, offsets)
    forward = grouped_linear_exact_ref if is_exact() else grouped_linear_ref
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _GroupedLinearRef.apply(x, weight, offsets, forward)
    return forward(x, weight, offsets)
