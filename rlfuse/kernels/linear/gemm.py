"""Linear layer y = x W^T + b, with a batch-invariant path for exact numerics.

Contract: x (..., K), weight (N, K), bias (N,) or None, one float dtype; y (..., N) in
x.dtype. Differentiable w.r.t. x, weight and bias.

Numerics "fast": `torch.nn.functional.linear` (cuBLAS on GPU). cuBLAS chooses its
algorithm, tiles and split-K from the shape, so row m of y changes in the last bits
with the number of rows M: the engine's decode (M = batch) and the trainer's packed
forward (M = all tokens) disagree.

Numerics "exact": every output element is reduced in one canonical order that depends
on K alone, never on M or on the row's place in the batch:
    K is cut into S = cdiv(K, CHUNK_K) chunks; chunk s is accumulated in fp32 from zero,
    BLOCK_K columns at a time (tl.dot), and the chunks are summed left to right:
        y = ((c_0 + c_1) + c_2) + ... ;  y += bias (fp32);  y -> x.dtype
Three launch plans compute exactly that sum, so any may be chosen from M:
  * fused: one program per (BLOCK_M x BLOCK_N) tile walks all S chunks itself;
  * split: one program per (tile, chunk) writes c_s (fp32) to a workspace and a second
    kernel adds the S partials in order (the LoRA expand's epilogue runs in that second
    kernel);
  * split_last: the same programs in one launch: each counts itself in at its tile (an
    atomic counter) after writing c_s, and the tile's last to arrive adds c_0 + c_1 + ...
    from the workspace in chunk order, whichever chunk it computed itself; it resets
    the counter, so the counters stay zero between launches (one buffer per stream).
Small M (decode) splits, to fill the GPU: without it a tile grid of cdiv(M, BLOCK_M) x
cdiv(N, BLOCK_N) is only a few dozen programs; the linear picks split_last (a launch and
a workspace pass fewer than split).
The canonical order is fixed by BLOCK_K and CHUNK_K alone: a tile's height and width
change which rows and columns a program owns, not the sequence of fp32 accumulations an
element sees (the matrix instruction chains its k-steps on the accumulator). So the 16-bit
path may pick a tile family from M -- narrow tiles for decode-sized M, wide ones for
prefill and training -- and keep the bits; tests compare the families bitwise, on the
GPU and under the CPU interpreter.
The backward (dx = dy W, dW = dy^T x, db = sum dy) runs through torch: gradients need
no batch invariance.

The exact PyTorch reference (`linear_exact_ref`) sums each row's products by pairwise
halving (`rlfuse.kernels.invariant.matmul_nt`): batch-invariant too, in its own order,
so on CPU the engine and the trainer agree bitwise under the torch backend as well.
Tests: `python -m pytest -q tests/test_exact_numerics.py -k linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.invariant import matmul_nt


def linear_exact_ref(x, weight, bias=None):
    x2 = x.reshape(-1, x.shape[-1])
    y = matmul_nt(x2, weight)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


class _ExactLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, forward):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return forward(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = (dy2 @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = dy2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def linear_exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The batch-invariant forward (Triton or the exact reference, by backend); torch backward."""
    forward = (triton_ops("linear.triton_gemm").linear_exact_triton if resolve_backend("linear", x) == "triton"
               else linear_exact_ref)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _ExactLinear.apply(x, weight, bias, forward)
    return forward(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Public op: F.linear in fast numerics; the batch-invariant forward in exact numerics."""
    return linear_exact(x, weight, bias) if is_exact() else F.linear(x, weight, bias)


def _fused_grads(ctx, dy, x, weight, needs_x, needs_w, needs_b):
    """The gradients of y = x W^T + b where W (and b) join the parts of sizes ctx.sizes:
    dx = dy W over the whole N (one GEMM), each part its rows of dW = dy^T x and db = sum dy."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = (dy2 @ weight).view(x.shape) if needs_x else None
    dws = list((dy2.t() @ x.reshape(-1, x.shape[-1])).split(ctx.sizes)) if needs_w else [None] * ctx.n_parts
    dbs = []
    if ctx.has_bias:
        dbs = list(dy2.sum(0).split(ctx.sizes)) if needs_b else [None] * ctx.n_parts
    return dx, dws, dbs


class _FusedLinear(torch.autograd.Function):
    """One GEMM over `weight`, the row-concatenation of `parts` (which are views of it):
    the gradient of each part is its rows of dW (and of db)."""

    @staticmethod
    def forward(ctx, x, weight, bias, n_parts, *parts):
        ctx.save_for_backward(x, *parts)  # the parts, not the buffer: their version counters guard in-place edits
        ctx.weight, ctx.has_bias, ctx.n_parts = weight, bias is not None, n_parts
        ctx.sizes = [p.shape[0] for p in parts[:n_parts]]
        return linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        needs, n = ctx.needs_input_grad, ctx.n_parts
        dx, dws, dbs = _fused_grads(ctx, dy, ctx.saved_tensors[0], ctx.weight, needs[0], any(needs[4:4 + n]),
                                    any(needs[4 + n:]))
        return dx, None, None, None, *dws, *dbs


def linear_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """`linear(x, weight, bias)` where weight (N, K) is the row-concatenation of `weights`
    (N_i, K) and bias of `biases`, held as views of one buffer (`rlfuse.model.fuse`): the
    forward is one GEMM; gradients go to the parts (their rows of dW = dy^T x, of db =
    sum dy), dx = dy W. In exact numerics the forward's bits equal the separate
    `linear(x, weights[i], biases[i])` outputs side by side (an element's K order does not
    depend on N); the gradients equal theirs up to the GEMMs' rounding (one dx GEMM over
    N instead of a sum of per-part ones)."""
    parts = tuple(weights) + (tuple(biases) if bias is not None else ())
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in parts)):
        return _FusedLinear.apply(x, weight, bias, len(weights), *parts)
    return linear(x, weight, bias)


class _JoinedLinear(torch.autograd.Function):
    """`_FusedLinear` over parts that share no buffer: the forward joins them for its one
    GEMM and drops the joined copy; the backward joins the weights again for dx. Only the
    parts are saved, so no second copy of the weights lives from forward to backward."""

    @staticmethod
    def forward(ctx, x, n_parts, has_bias, *parts):
        weights, biases = parts[:n_parts], parts[n_parts:]
        ctx.save_for_backward(x, *weights)
        ctx.has_bias, ctx.n_parts, ctx.sizes = has_bias, n_parts, [w.shape[0] for w in weights]
        return linear(x, torch.cat(weights), torch.cat(biases) if has_bias else None)

    @staticmethod
    def backward(ctx, dy):
        x, *weights = ctx.saved_tensors
        needs, n = ctx.needs_input_grad, ctx.n_parts
        weight = torch.cat(weights) if needs[0] else None  # transient: freed when backward returns
        dx, dws, dbs = _fused_grads(ctx, dy, x, weight, needs[0], any(needs[3:3 + n]), any(needs[3 + n:]))
        return dx, None, None, *dws, *dbs


def linear_fused_parts(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                       biases: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """`linear_fused` for parts held apart (an FSDP2-sharded model's gathered weights,
    `rlfuse.model.fuse_sharded`): y = linear(x, cat(weights), cat(biases)), one GEMM; the
    same math as `linear_fused` over a buffer holding those rows (bitwise: same forward
    GEMM, same dx and dW GEMMs), at the price of a copy of the weights per forward and
    per backward, neither kept between them."""
    parts = tuple(weights) + (tuple(biases) if biases is not None else ())
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in parts)):
        return _JoinedLinear.apply(x, len(weights), biases is not None, *parts)
    return linear(x, torch.cat(weights), None if biases is None else torch.cat(biases))
