"""LoRA linear, the exact-mode Triton path: the base GEMM with the adapter's expand in its
epilogue, so steps 1, 3 and 4 of `rlfuse.kernels.linear.lora` are one kernel (two with the split
plan) and round once:
    y = round( [x W^T in linear's canonical K order] (+ b) + s * (z B^T) ),  z = x_a A^T
z (the shrink) comes from the exact linear (`linear_exact`), rounded to x.dtype.
z B^T is one `dot` over the rank, padded to BLOCK_R >= 16 with zeros: a single k-block,
so an element's value does not depend on the tile's height or width (the property the
exact linear's tile families rely on), and the fused and split plans give the same bits.
Launch plans and tile families are the exact linear's (`rlfuse.kernels.linear.triton_gemm`).
The backward is torch's (dx = dy W, dW = dy^T x, db = sum dy, dz = s dy B, dB = s dy^T z).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.linear.gemm import linear_exact
from rlfuse.kernels.linear.triton_gemm import (
    _store_tile,
    _tile_rows_cols,
    _tile_sum,
    gemm_operands,
    launch_plan,
    split_partials,
)
from rlfuse.kernels.triton_common import dot


@triton.jit
def _lora_term(Z, BW, rows, cols, M, N, R, szm, sbn, BLOCK_R: tl.constexpr, PREC: tl.constexpr):
    """(BLOCK_M, BLOCK_N) fp32: z[rows] . B[cols] over the rank, one padded k-block."""
    rs = tl.arange(0, BLOCK_R)
    rin = rs < R
    z = tl.load(Z + rows[:, None] * szm + rs[None, :], mask=(rows < M)[:, None] & rin[None, :], other=0.0)
    b = tl.load(BW + cols[:, None] * sbn + rs[None, :], mask=(cols < N)[:, None] & rin[None, :], other=0.0)
    return dot(z, tl.trans(b), None, PREC)


@triton.jit(do_not_specialize=['M'])  # row counts vary per step: one compile
def _lora_fused_kernel(X, W, B, Z, BW, Y, M, N, K, R, sxm, swn, sym, szm, sbn, CHUNK_K, scale,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr, PREC: tl.constexpr):
    rows, cols = _tile_rows_cols(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    y = _tile_sum(X, W, B, rows, cols, M, N, K, sxm, swn, CHUNK_K, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, PREC)
    y += scale * _lora_term(Z, BW, rows, cols, M, N, R, szm, sbn, BLOCK_R, PREC)
    _store_tile(Y, y, rows, cols, sym, M, N)


@triton.jit(do_not_specialize=['M'])  # row counts vary per step: one compile
def _lora_combine_kernel(WS, B, Z, BW, Y, M, N, S, R, sym, szm, sbn, scale, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                         GROUP_M: tl.constexpr, PREC: tl.constexpr):
    """The split plan's second kernel, in tiles (linear's is flat): the S chunk partials in
    order, the bias, the adapter term -- the fused kernel's sequence of fp32 additions."""
    rows, cols = _tile_rows_cols(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    y = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for s in range(0, S):
        y += tl.load(WS + (s * M + rows[:, None]) * N + cols[None, :], mask=ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y += scale * _lora_term(Z, BW, rows, cols, M, N, R, szm, sbn, BLOCK_R, PREC)
    _store_tile(Y, y, rows, cols, sym, M, N)


def lora_expand_triton(x, weight, bias, z, lora_b, scale: float, *, plan: str | None = None,
                       tiles: dict | None = None):
    """y = round(x W^T (+ b) + s z B^T): the base GEMM with the expand in its epilogue.
    x (..., K), z (..., r) its shrink; `plan` and `tiles` as `linear_exact_triton`'s."""
    K, N, R = x.shape[-1], weight.shape[0], lora_b.shape[1]
    x2, w, y = gemm_operands(x, weight)
    z2 = z.reshape(-1, R)
    z2 = z2 if z2.stride(-1) == 1 else z2.contiguous()
    bw = lora_b if lora_b.stride(-1) == 1 else lora_b.contiguous()
    M = x2.shape[0]
    if M == 0:
        return y.view(*x.shape[:-1], N)
    lp = launch_plan("lora_linear", x, M, N, K, plan, tiles)
    b = bias if bias is not None else y  # unused pointer when HAS_BIAS is False
    common = dict(HAS_BIAS=bias is not None, BLOCK_M=lp.bm, BLOCK_N=lp.bn,
                  BLOCK_R=max(16, triton.next_power_of_2(R)), GROUP_M=8, PREC=lp.prec)
    if lp.plan == "fused":
        _lora_fused_kernel[(lp.n_tiles,)](x2, w, b, z2, bw, y, M, N, K, R, x2.stride(0), w.stride(0), y.stride(0),
                                          z2.stride(0), bw.stride(0), lp.ck, float(scale), BLOCK_K=lp.bk, **common,
                                          **lp.extra)
    else:
        ws = split_partials(x2, w, M, N, K, lp)
        _lora_combine_kernel[(lp.n_tiles,)](ws, b, z2, bw, y, M, N, lp.S, R, y.stride(0), z2.stride(0),
                                            bw.stride(0), float(scale), **common, num_warps=lp.extra["num_warps"])
    return y.view(*x.shape[:-1], N)


class _ExactLoRAExpand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, z, lora_b, scale):
        ctx.save_for_backward(x, weight, z, lora_b)
        ctx.has_bias, ctx.scale = bias is not None, scale
        return lora_expand_triton(x, weight, bias, z, lora_b, scale)

    @staticmethod
    def backward(ctx, dy):
        x, weight, z, lora_b = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        need = ctx.needs_input_grad
        dx = (dy2 @ weight).view(x.shape) if need[0] else None
        dw = dy2.t() @ x.reshape(-1, x.shape[-1]) if need[1] else None
        db = dy2.sum(0) if ctx.has_bias and need[2] else None
        dz = ((dy2 @ lora_b) * ctx.scale).view(z.shape) if need[3] else None
        dbw = (dy2.t() @ z.reshape(-1, z.shape[-1])) * ctx.scale if need[4] else None
        return dx, dw, db, dz, dbw, None


def lora_linear_exact_triton(x, weight, bias, lora_a, lora_b, scale: float, x_a=None):
    """The exact-mode LoRA linear: the shrink by the exact linear, then the fused base +
    expand; differentiable (torch backward)."""
    z = linear_exact(x if x_a is None else x_a, lora_a)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, z, lora_b)):
        return _ExactLoRAExpand.apply(x, weight, bias, z, lora_b, scale)
    return lora_expand_triton(x, weight, bias, z, lora_b, scale)
