"""LoRA linear, the Triton path: the base GEMM with the adapter's expand in its epilogue,
so steps 1, 3 and 4 of `rlfuse.kernels.linear.lora` are one kernel and round once:
    y = round( [x W^T in linear's canonical K order] (+ b) + s_a * (z B_a^T) ),  z = x_a A^T
z (the shrink, every adapter's and every part's columns side by side) comes from one
linear over the stacked A's, rounded to x.dtype (`lora_linear` computes it).

The epilogue (`_lora_epilogue`), per (BLOCK_M x BLOCK_N) tile:
  1. each row's adapter a (-1: none; all 0 without an index), each column's part p (the
     fused projection it belongs to: q, k or v; gate or up);
  2. for each adapter present in the tile and each part: d = z[rows, (a, p) columns] .
     B_a[cols]^T, one `dot` over the rank padded to BLOCK_R >= 16 with zeros (a single
     k-block: an element's value does not depend on the tile's height or width, as the
     exact linear's tile families require);
  3. y = y + s_a * d where the row is a's and the column p's (a select: each element is
     updated once, by its own adapter and part; others add nothing, not even a zero);
     rows without an adapter keep the base's y.
So a row's bits depend on its own x, its adapter and the weights alone: a batch mixing
adapters gives each row what a batch of its adapter alone gives.

Launch plans (the exact linear's, `rlfuse.kernels.linear.triton_gemm`): fused (one program
per tile walks every K chunk), split (chunk partials, then a combine kernel that runs the
epilogue) and split_last (one launch: the tile's last chunk program to arrive sums the
partials in chunk order and runs the epilogue); decode-sized M takes split_last.
Fast numerics (`lora_add_triton`): the base comes from cuBLAS, rounded, and one kernel adds
the expand in place: y = round(base + s_a z B_a^T).
The backward is torch's (dx = dy W, dW = dy^T x, db = sum dy, dz = s dy B, dB = s dy^T z),
one adapter only (adapter banks serve, they do not train).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.linear.gemm import linear_exact
from rlfuse.kernels.linear.triton_gemm import (
    _chunk,
    _store_tile,
    _tile_rows_cols,
    _tile_sum,
    arrival_counters,
    gemm_operands,
    launch_plan,
    split_partials,
)
from rlfuse.kernels.triton_common import dot, dot_precision, round_to


@triton.jit
def _lora_epilogue(y, Z, BW, SC, AD, rows, cols, M, N, R, NA, szm, sba, sbn, P1, P2, P3, scale,
                   HAS_ADAPTER: tl.constexpr, PARTS: tl.constexpr, BLOCK_R: tl.constexpr, PREC: tl.constexpr):
    """y (BLOCK_M, BLOCK_N) fp32 plus each row's adapter term (module docstring, steps 1-3).
    Parts end at P1, P2, P3, N (the unused ends = N). Each element is updated once, by its
    own adapter and part (y + s * d); no second accumulator tile stays live (registers)."""
    rs = tl.arange(0, BLOCK_R)
    rin = rs < R
    rok = rows < M
    part = (cols >= P1).to(tl.int32) + (cols >= P2).to(tl.int32) + (cols >= P3).to(tl.int32)
    if HAS_ADAPTER:
        arow = tl.load(AD + rows, mask=rok, other=-1).to(tl.int32)
        s = tl.load(SC + arow, mask=arow >= 0, other=0.0)[:, None]
        for a in range(0, NA):
            is_a = arow == a
            if tl.max(is_a.to(tl.int32), 0) > 0:  # adapters absent from the tile cost nothing
                for p in tl.static_range(PARTS):
                    z = tl.load(Z + rows[:, None] * szm + (a * PARTS + p) * R + rs[None, :],
                                mask=rok[:, None] & rin[None, :], other=0.0)
                    inp = (part == p) & (cols < N)
                    b = tl.load(BW + a * sba + cols[:, None] * sbn + rs[None, :],
                                mask=inp[:, None] & rin[None, :], other=0.0)
                    d = dot(z, tl.trans(b), None, PREC)
                    y = tl.where(is_a[:, None] & inp[None, :], y + s * d, y)
    else:
        for p in tl.static_range(PARTS):
            z = tl.load(Z + rows[:, None] * szm + p * R + rs[None, :], mask=rok[:, None] & rin[None, :], other=0.0)
            inp = (part == p) & (cols < N)
            b = tl.load(BW + cols[:, None] * sbn + rs[None, :], mask=inp[:, None] & rin[None, :], other=0.0)
            d = dot(z, tl.trans(b), None, PREC)
            y = tl.where(inp[None, :], y + scale * d, y)
    return y


@triton.jit(do_not_specialize=['M'])  # row counts vary per step: one compile
def _lora_fused_kernel(X, W, B, Z, BW, SC, AD, Y, M, N, K, R, NA, sxm, swn, sym, szm, sba, sbn, P1, P2, P3, CHUNK_K,
                       scale, HAS_BIAS: tl.constexpr, HAS_ADAPTER: tl.constexpr, PARTS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                       GROUP_M: tl.constexpr, PREC: tl.constexpr):
    rows, cols = _tile_rows_cols(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    y = _tile_sum(X, W, B, rows, cols, M, N, K, sxm, swn, CHUNK_K, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, PREC)
    y = _lora_epilogue(y, Z, BW, SC, AD, rows, cols, M, N, R, NA, szm, sba, sbn, P1, P2, P3, scale,
                       HAS_ADAPTER, PARTS, BLOCK_R, PREC)
    _store_tile(Y, y, rows, cols, sym, M, N)


@triton.jit(do_not_specialize=['M'])  # row counts vary per step: one compile
def _lora_combine_kernel(WS, B, Z, BW, SC, AD, Y, M, N, S, R, NA, sym, szm, sba, sbn, P1, P2, P3, scale,
                         HAS_BIAS: tl.constexpr, HAS_ADAPTER: tl.constexpr, PARTS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                         GROUP_M: tl.constexpr, PREC: tl.constexpr):
    """The split plan's second kernel, in tiles (linear's is flat): the S chunk partials in
    order, the bias, the epilogue -- the fused kernel's sequence of fp32 additions."""
    rows, cols = _tile_rows_cols(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    y = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for s in range(0, S):
        y += tl.load(WS + (s * M + rows[:, None]) * N + cols[None, :], mask=ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y = _lora_epilogue(y, Z, BW, SC, AD, rows, cols, M, N, R, NA, szm, sba, sbn, P1, P2, P3, scale,
                       HAS_ADAPTER, PARTS, BLOCK_R, PREC)
    _store_tile(Y, y, rows, cols, sym, M, N)


@triton.jit(do_not_specialize=['M'])  # row counts vary per step: one compile
def _lora_split_last_kernel(X, W, B, Z, BW, SC, AD, Y, WS, ARRIVALS, M, N, K, S, R, NA, sxm, swn, sym, szm, sba,
                            sbn, P1, P2, P3, CHUNK_K, scale, HAS_BIAS: tl.constexpr, HAS_ADAPTER: tl.constexpr,
                            PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
                            PREC: tl.constexpr):
    """The split plan in one launch (as `triton_gemm._linear_split_last_kernel`, whose
    comments give the memory-order argument): the tile's last program to arrive adds the
    chunk partials in order, the bias and the adapter epilogue, and resets the counter."""
    tile, s = tl.program_id(0), tl.program_id(1)
    rows, cols = _tile_rows_cols(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_lo = s * CHUNK_K
    c = _chunk(X, W, rows, cols, k_lo, tl.minimum(k_lo + CHUNK_K, K), sxm, swn, M, N,
               BLOCK_M, BLOCK_N, BLOCK_K, PREC)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(WS + (s * M + rows[:, None]) * N + cols[None, :], c, mask=ok)
    tl.debug_barrier()
    arrived = tl.atomic_add(ARRIVALS + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == S - 1:
        y = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for t in range(0, S):
            y += tl.load(WS + (t * M + rows[:, None]) * N + cols[None, :], mask=ok, other=0.0,
                         cache_modifier=".cg")
        if HAS_BIAS:
            y += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        y = _lora_epilogue(y, Z, BW, SC, AD, rows, cols, M, N, R, NA, szm, sba, sbn, P1, P2, P3, scale,
                           HAS_ADAPTER, PARTS, BLOCK_R, PREC)
        _store_tile(Y, y, rows, cols, sym, M, N)
        tl.atomic_xchg(ARRIVALS + tile, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=['M'])  # row counts vary per step: one compile
def _lora_add_kernel(Y, Z, BW, SC, AD, M, N, R, NA, sym, szm, sba, sbn, P1, P2, P3, scale,
                     HAS_ADAPTER: tl.constexpr, PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr, PREC: tl.constexpr):
    """Fast numerics: Y (the base, rounded) += the adapter epilogue, in place."""
    rows, cols = _tile_rows_cols(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    y = tl.load(Y + rows[:, None] * sym + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    y = _lora_epilogue(y, Z, BW, SC, AD, rows, cols, M, N, R, NA, szm, sba, sbn, P1, P2, P3, scale,
                       HAS_ADAPTER, PARTS, BLOCK_R, PREC)
    YT = Y.dtype.element_ty
    tl.store(Y + rows[:, None] * sym + cols[None, :], round_to(y, YT).to(YT), mask=ok)


def _epilogue_args(z, lora_b, scale, sizes, adapter, N: int, y) -> tuple[list, dict, dict]:
    """(pointers, scalar arguments, constexprs) of `_lora_epilogue` for a launch."""
    bw = lora_b if lora_b.dim() == 3 else lora_b.unsqueeze(0)  # (NA, N, R)
    bw = bw if bw.stride(-1) == 1 and bw.stride(-2) == bw.shape[-1] else bw.contiguous()
    NA, R = bw.shape[0], bw.shape[2]
    z2 = z.reshape(-1, z.shape[-1])
    z2 = z2 if z2.stride(-1) == 1 else z2.contiguous()
    sizes = tuple(sizes) if sizes is not None else (N,)
    assert 1 <= len(sizes) <= 4 and sum(sizes) == N, sizes
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))] + [N, N, N]
    has_adapter = adapter is not None
    sc = scale if isinstance(scale, torch.Tensor) else y  # unused pointers stand in for absent tensors
    args = [z2, bw, sc, adapter if has_adapter else y]
    ints = dict(R=R, NA=NA, szm=z2.stride(0), sba=bw.stride(0), sbn=bw.stride(1), P1=ends[0], P2=ends[1], P3=ends[2],
                scale=0.0 if isinstance(scale, torch.Tensor) else float(scale))
    const = dict(HAS_ADAPTER=has_adapter, PARTS=len(sizes), BLOCK_R=max(16, triton.next_power_of_2(R)))
    return args, ints, const


def lora_expand_triton(x, weight, bias, z, lora_b, scale, *, sizes=None, adapter=None, plan: str | None = None,
                       tiles: dict | None = None):
    """y = round(x W^T (+ b) + s_a z B_a^T): the base GEMM with the expand in its epilogue.
    x (..., K); z (..., NA * P * r) its shrink; lora_b (N, r) or (NA, N, r); scale a float,
    or (NA,) fp32 with `adapter` (M,) (each row's adapter, -1 none); `sizes` the P <= 4
    parts' widths; `plan` and `tiles` as `linear_exact_triton`'s."""
    K, N = x.shape[-1], weight.shape[0]
    x2, w, y = gemm_operands(x, weight)
    M = x2.shape[0]
    if M == 0:
        return y.view(*x.shape[:-1], N)
    (z2, bw, sc, ad), e, const = _epilogue_args(z, lora_b, scale, sizes, adapter, N, y)
    lp = launch_plan("lora_linear", x, M, N, K, plan, tiles, split="split_last")
    b = bias if bias is not None else y  # unused pointer when HAS_BIAS is False
    common = dict(HAS_BIAS=bias is not None, BLOCK_M=lp.bm, BLOCK_N=lp.bn, GROUP_M=8, PREC=lp.prec, **const)
    ep = (e["P1"], e["P2"], e["P3"])
    if lp.plan == "fused":
        _lora_fused_kernel[(lp.n_tiles,)](x2, w, b, z2, bw, sc, ad, y, M, N, K, e["R"], e["NA"], x2.stride(0),
                                          w.stride(0), y.stride(0), e["szm"], e["sba"], e["sbn"], *ep, lp.ck,
                                          e["scale"], BLOCK_K=lp.bk, **common, **lp.extra)
    elif lp.plan == "split_last":
        ws = torch.empty((lp.S, M, N), dtype=torch.float32, device=x2.device)
        _lora_split_last_kernel[(lp.n_tiles, lp.S)](
            x2, w, b, z2, bw, sc, ad, y, ws, arrival_counters(x2.device, lp.n_tiles), M, N, K, lp.S, e["R"], e["NA"],
            x2.stride(0), w.stride(0), y.stride(0), e["szm"], e["sba"], e["sbn"], *ep, lp.ck, e["scale"],
            BLOCK_K=lp.bk, **common, **lp.extra)
    else:
        ws = split_partials(x2, w, M, N, K, lp)
        _lora_combine_kernel[(lp.n_tiles,)](ws, b, z2, bw, sc, ad, y, M, N, lp.S, e["R"], e["NA"], y.stride(0),
                                            e["szm"], e["sba"], e["sbn"], *ep, e["scale"], **common,
                                            num_warps=lp.extra["num_warps"])
    return y.view(*x.shape[:-1], N)


def lora_add_triton(base, z, lora_b, scale, *, sizes=None, adapter=None):
    """Fast numerics: base (..., N) (x W^T + b, rounded, e.g. from cuBLAS) += s_a z B_a^T in
    place, one kernel; returns base. Arguments as `lora_expand_triton`'s."""
    N = base.shape[-1]
    y = base.view(-1, N)  # may be strided: the base columns of a joined [base | z] output
    assert y.stride(-1) == 1, "lora_add_triton: the base must have unit column stride"
    M = y.shape[0]
    if M == 0:
        return base
    (z2, bw, sc, ad), e, const = _epilogue_args(z, lora_b, scale, sizes, adapter, N, y)
    bm, bn = (32, 32) if base.dtype == torch.float32 else (64, 64)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _lora_add_kernel[grid](y, z2, bw, sc, ad, M, N, e["R"], e["NA"], y.stride(0), e["szm"], e["sba"], e["sbn"],
                           e["P1"], e["P2"], e["P3"], e["scale"], BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8,
                           PREC=dot_precision(base), num_warps=4, **const)
    return base


def _parts_of(sizes, N):
    sizes = tuple(sizes) if sizes is not None else (N,)
    ends = [0]
    for s in sizes:
        ends.append(ends[-1] + s)
    return [(ends[i], ends[i + 1]) for i in range(len(sizes))]


class _ExactLoRAExpand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, z, lora_b, scale, sizes):
        ctx.save_for_backward(x, weight, z, lora_b)
        ctx.has_bias, ctx.scale, ctx.sizes = bias is not None, scale, sizes
        return lora_expand_triton(x, weight, bias, z, lora_b, scale, sizes=sizes)

    @staticmethod
    def backward(ctx, dy):
        x, weight, z, lora_b = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        z2 = z.reshape(-1, z.shape[-1])
        need = ctx.needs_input_grad
        dx = (dy2 @ weight).view(x.shape) if need[0] else None
        dw = dy2.t() @ x.reshape(-1, x.shape[-1]) if need[1] else None
        db = dy2.sum(0) if ctx.has_bias and need[2] else None
        r = lora_b.shape[1]
        spans = _parts_of(ctx.sizes, weight.shape[0])
        dz = dbw = None
        if need[3]:  # part p's z columns see only its output columns
            dz = torch.cat([dy2[:, lo:hi] @ lora_b[lo:hi] for lo, hi in spans], 1).mul_(ctx.scale).view(z.shape)
        if need[4]:
            dbw = torch.cat([dy2[:, lo:hi].t() @ z2[:, p * r:(p + 1) * r] for p, (lo, hi) in enumerate(spans)])
            dbw = dbw * ctx.scale
        return dx, dw, db, dz, dbw, None, None


def lora_linear_exact_triton(x, weight, bias, lora_a, lora_b, scale, x_a=None, *, sizes=None, adapter=None):
    """The exact-mode LoRA linear: the shrink by the exact linear over every adapter's and
    part's A at once, then the fused base + expand; differentiable (torch backward) for one
    adapter (lora_a 2-D)."""
    z = linear_exact(x if x_a is None else x_a, lora_a.reshape(-1, lora_a.shape[-1]))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, z, lora_b)):
        if lora_b.dim() == 3 or adapter is not None:
            raise ValueError("lora_linear: an adapter bank (stacked A and B, per-row adapters) is for inference; "
                             "train one adapter at a time")
        return _ExactLoRAExpand.apply(x, weight, bias, z, lora_b, scale, sizes)
    return lora_expand_triton(x, weight, bias, z, lora_b, scale, sizes=sizes, adapter=adapter)
