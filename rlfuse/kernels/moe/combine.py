"""Dispatch and combine: tokens into expert-sorted rows, and the weighted sum back.

Contract (a `routing.Routing` r of T tokens, k slots each):
  gather_rows(x (T, D), r) -> xs (T k, D):  xs[row] = x[r.order[row] // k]
      backward: dx[t] = rnd(sum_j dxs[r.slot_pos[t, j]])  (the k copies in slot order, in
      fp32: no scatter-add, deterministic on every device)
  combine(ys (T k, N), r) -> out (T, N) in ys.dtype:
      out[t] = rnd( sum_{j = 0..k-1} r.weights[t, j] * ys[r.slot_pos[t, j]] )
      the products and the sum in fp32, the k slots added left to right, one rounding; so a
      token's output depends on its own k expert rows and weights only (batch-invariant in
      both numerics). transformers instead rounds each weighted expert output to the model
      dtype and adds them in expert order: equal in fp32 up to the order of the adds.
      backward: dys[r.slot_pos[t, j]] = rnd(w[t, j] dout[t]),  dw[t, j] = dout[t] . ys[slot_pos[t, j]]
        (fp32), both deterministic.
The combine's forward has a Triton kernel (one token's column block a program, the slots
in the same order); everything else is torch indexing.
Tests: python -m pytest -q tests/test_kernel_moe.py -k combine
"""

from __future__ import annotations

import torch

from rlfuse.kernels.backend import resolve_backend, triton_ops
from rlfuse.kernels.moe.routing import Routing


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, slot_pos):
        ctx.save_for_backward(slot_pos)
        return x.index_select(0, order // slot_pos.shape[1])

    @staticmethod
    def backward(ctx, dxs):
        (slot_pos,) = ctx.saved_tensors
        T, k = slot_pos.shape
        parts = dxs.index_select(0, slot_pos.reshape(-1)).view(T, k, -1)
        dx = parts[:, 0].float()
        for j in range(1, k):  # the k copies of a token, in slot order, in fp32
            dx = dx + parts[:, j].float()
        return dx.to(dxs.dtype), None, None


def gather_rows(x: torch.Tensor, r: Routing) -> torch.Tensor:
    """xs (T k, D): each token's row once per slot, in expert-sorted order."""
    if x.dim() != 2 or x.shape[0] != r.slot_pos.shape[0]:
        raise ValueError(f"gather_rows: x must be (T, D) with T = {r.slot_pos.shape[0]} tokens, got {tuple(x.shape)}")
    return _GatherRows.apply(x, r.order, r.slot_pos)


def combine_ref(ys: torch.Tensor, weights: torch.Tensor, slot_pos: torch.Tensor) -> torch.Tensor:
    """The reference (exact and fast alike: fp32 products and adds are IEEE operations)."""
    acc = weights[:, 0, None] * ys[slot_pos[:, 0]].float()
    for j in range(1, slot_pos.shape[1]):
        acc = acc + weights[:, j, None] * ys[slot_pos[:, j]].float()
    return acc.to(ys.dtype)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ys, weights, slot_pos, forward):
        ctx.save_for_backward(ys, weights, slot_pos)
        return forward(ys, weights, slot_pos)

    @staticmethod
    def backward(ctx, dout):
        ys, weights, slot_pos = ctx.saved_tensors
        T, k = slot_pos.shape
        flat = slot_pos.reshape(-1)
        dys = dw = None
        if ctx.needs_input_grad[0]:
            per_pair = (weights[:, :, None] * dout.float()[:, None, :]).to(ys.dtype).view(T * k, -1)
            dys = torch.empty_like(per_pair).index_copy_(0, flat, per_pair)  # a permutation: no two rows collide
        if ctx.needs_input_grad[1]:
            dw = (dout.float()[:, None, :] * ys.index_select(0, flat).float().view(T, k, -1)).sum(-1)
        return dys, dw, None, None


def combine(ys: torch.Tensor, r: Routing) -> torch.Tensor:
    """out (T, N): each token's k expert rows weighted by its routing weights; see the docstring."""
    T, k = r.slot_pos.shape
    if ys.dim() != 2 or ys.shape[0] != T * k:
        raise ValueError(f"combine: ys must be (T k, N) with T k = {T * k} rows, got {tuple(ys.shape)}")
    forward = (triton_ops("moe.triton_combine").combine_fwd if resolve_backend("moe_combine", ys) == "triton"
               else combine_ref)
    if torch.is_grad_enabled() and (ys.requires_grad or r.weights.requires_grad):
        return _Combine.apply(ys, r.weights, r.slot_pos, forward)
    return forward(ys, r.weights, r.slot_pos)
