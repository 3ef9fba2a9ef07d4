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
Two launch plans compute exactly that sum, so either may be chosen from M:
  * fused: one program per (BLOCK_M x BLOCK_N) tile walks all S chunks itself;
  * split: one program per (tile, chunk) writes c_s (fp32) to a workspace and a second
    kernel adds the S partials in order. Small M (decode) uses it to fill the GPU,
    since without it a tile grid of cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N) is only a few
    dozen programs.
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
import triton
import triton.language as tl

from rlfuse.kernels._triton_common import num_sms, round_to
from rlfuse.kernels.backend import is_exact, resolve_backend
from rlfuse.kernels.invariant import matmul_nt


def linear_exact_ref(x, weight, bias=None):
    x2 = x.reshape(-1, x.shape[-1])
    y = matmul_nt(x2, weight)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------- Triton kernels
@triton.jit
def _dot_acc(a, b, acc, PREC: tl.constexpr):
    # PREC "interp": Triton's CPU interpreter multiplies bf16 as raw uint16, so there the
    # operands go up to fp32 first (same products, fp32 sums).
    if PREC == "interp":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _chunk(X, W, rows, cols, k_lo, k_hi, sxm, swn, M, N,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """c = sum over k in [k_lo, k_hi) of x[rows, k] w[cols, k], fp32 from zero, BLOCK_K at a time."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kin = ks < k_hi
        x = tl.load(X + rows[:, None] * sxm + ks[None, :], mask=(rows < M)[:, None] & kin[None, :], other=0.0)
        w = tl.load(W + cols[:, None] * swn + ks[None, :], mask=(cols < N)[:, None] & kin[None, :], other=0.0)
        acc = _dot_acc(x, tl.trans(w), acc, PREC)
    return acc


@triton.jit
def _tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # GROUP_M row tiles at a time, rows fastest: programs running together share W tiles in L2
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_n
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(n_m - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit(do_not_specialize=['M'])  # row counts vary per step: one compile
def _linear_fused_kernel(X, W, B, Y, M, N, K, sxm, swn, sym, CHUNK_K,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PREC: tl.constexpr):
    tm, tn = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = (tm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tn * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    y = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k_lo in range(0, K, CHUNK_K):
        y += _chunk(X, W, rows, cols, k_lo, tl.minimum(k_lo + CHUNK_K, K), sxm, swn, M, N,
                    BLOCK_M, BLOCK_N, BLOCK_K, PREC)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    YT = Y.dtype.element_ty
    tl.store(Y + rows[:, None] * sym + cols[None, :], round_to(y, YT).to(YT),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=['M'])  # row counts vary per step: one compile
def _linear_split_kernel(X, W, WS, M, N, K, sxm, swn, CHUNK_K,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, PREC: tl.constexpr):
    s = tl.program_id(1)
    tm, tn = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = (tm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tn * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k_lo = s * CHUNK_K
    c = _chunk(X, W, rows, cols, k_lo, tl.minimum(k_lo + CHUNK_K, K), sxm, swn, M, N,
               BLOCK_M, BLOCK_N, BLOCK_K, PREC)
    tl.store(WS + (s * M + rows[:, None]) * N + cols[None, :], c,
             mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=['M'])  # row counts vary per step: one compile
def _linear_combine_kernel(WS, B, Y, M, N, S, sym, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    y = tl.zeros((BLOCK,), tl.float32)
    for s in range(0, S):  # the chunks in order, as the fused kernel adds them
        y += tl.load(WS + s * M * N + offs, mask=ok, other=0.0)
    cols = offs % N
    if HAS_BIAS:
        y += tl.load(B + cols, mask=ok, other=0.0).to(tl.float32)
    YT = Y.dtype.element_ty
    tl.store(Y + (offs // N) * sym + cols, round_to(y, YT).to(YT), mask=ok)


# ---------------------------------------------------------------- launchers
EXACT_BLOCK_K, EXACT_CHUNK_K = 64, 512  # 16-bit: the canonical order (never a function of M)
DECODE_ROWS = 256  # 16-bit: M up to this runs the narrow tile family


def _tiles(dtype: torch.dtype, M: int) -> dict:
    """BLOCK_M x BLOCK_N x BLOCK_K, the K chunk, warps and stages. 16-bit: a tile family by
    M, both with the canonical BLOCK_K and CHUNK_K (the families: benchmarks/bench_exact.py
    --only sweep); fp32 (IEEE FMA dots, the test dtype): one small tile."""
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, CHUNK_K=256, num_warps=4, num_stages=2)
    if M <= DECODE_ROWS:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=EXACT_BLOCK_K, CHUNK_K=EXACT_CHUNK_K, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=EXACT_BLOCK_K, CHUNK_K=EXACT_CHUNK_K, num_warps=8, num_stages=3)


def _dot_precision(x: torch.Tensor) -> str:
    if x.device.type != "cuda":
        return "interp"
    return "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def linear_exact_triton(x, weight, bias=None, *, plan: str | None = None, tiles: dict | None = None):
    """The exact-mode forward. `plan` forces "fused" or "split" (tests: both give the same
    bits); None picks split when the tile grid alone would leave most SMs idle."""
    K = x.shape[-1]
    N = weight.shape[0]
    if weight.shape != (N, K) or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)}: expected weight (N, K), bias (N,)")
    if x.dtype != weight.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"linear: x and weight must share one of fp16/bf16/fp32, got {x.dtype}, {weight.dtype}")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y.view(*x.shape[:-1], N)
    t = {**_tiles(x.dtype, M), **(tiles or {})}
    bm, bn, bk, ck = t.pop("BLOCK_M"), t.pop("BLOCK_N"), t.pop("BLOCK_K"), t.pop("CHUNK_K")
    assert ck % bk == 0, "CHUNK_K must be a multiple of BLOCK_K"
    S = triton.cdiv(K, ck)
    n_tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if plan is None:
        plan = "split" if S > 1 and x.is_cuda and n_tiles < num_sms(x.device) else "fused"
    b = bias if bias is not None else y  # unused pointer when HAS_BIAS is False
    prec = _dot_precision(x)
    if plan == "fused":
        _linear_fused_kernel[(n_tiles,)](x2, w, b, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0), ck,
                                         HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                         GROUP_M=8, PREC=prec, **t)
    elif plan == "split":
        ws = torch.empty((S, M, N), dtype=torch.float32, device=x.device)
        _linear_split_kernel[(n_tiles, S)](x2, w, ws, M, N, K, x2.stride(0), w.stride(0), ck,
                                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PREC=prec, **t)
        _linear_combine_kernel[(triton.cdiv(M * N, 1024),)](ws, b, y, M, N, S, y.stride(0),
                                                            HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4)
    else:
        raise ValueError(f"linear: plan must be 'fused' or 'split', got {plan!r}")
    return y.view(*x.shape[:-1], N)


class _ExactLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, use_triton):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear_exact_triton(x, weight, bias) if use_triton else linear_exact_ref(x, weight, bias)

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
    use_triton = resolve_backend("linear", x) == "triton"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _ExactLinear.apply(x, weight, bias, use_triton)
    return linear_exact_triton(x, weight, bias) if use_triton else linear_exact_ref(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Public op: F.linear in fast numerics; the batch-invariant forward in exact numerics."""
    return linear_exact(x, weight, bias) if is_exact() else F.linear(x, weight, bias)
