"""Linear, the exact-mode Triton GEMM: fused and split launch plans of one canonical
K order (the order, the plans and why tile families may change with M are in
`rlfuse.kernels.linear.gemm`'s docstring)."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from rlfuse.kernels.backend import num_sms
from rlfuse.kernels.triton_common import dot, dot_precision, round_to, swizzle


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
        acc = dot(x, tl.trans(w), acc, PREC)
    return acc


@triton.jit
def _tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    return swizzle(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)


@triton.jit
def _tile_rows_cols(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    tm, tn = _tile_of(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    return (tm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64), (tn * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)


@triton.jit
def _tile_sum(X, W, B, rows, cols, M, N, K, sxm, swn, CHUNK_K, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """x[rows] W[cols]^T (+ b[cols]), fp32: the K chunks in the canonical order, then the bias."""
    y = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k_lo in range(0, K, CHUNK_K):
        y += _chunk(X, W, rows, cols, k_lo, tl.minimum(k_lo + CHUNK_K, K), sxm, swn, M, N,
                    BLOCK_M, BLOCK_N, BLOCK_K, PREC)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def _store_tile(Y, y, rows, cols, sym, M, N):
    """y (fp32) rounded to Y's dtype, stored at Y[rows, cols]."""
    YT = Y.dtype.element_ty
    tl.store(Y + rows[:, None] * sym + cols[None, :], round_to(y, YT).to(YT),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=['M'])  # row counts vary per step: one compile
def _linear_fused_kernel(X, W, B, Y, M, N, K, sxm, swn, sym, CHUNK_K,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PREC: tl.constexpr):
    rows, cols = _tile_rows_cols(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    y = _tile_sum(X, W, B, rows, cols, M, N, K, sxm, swn, CHUNK_K, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, PREC)
    _store_tile(Y, y, rows, cols, sym, M, N)


@triton.jit(do_not_specialize=['M'])  # row counts vary per step: one compile
def _linear_split_kernel(X, W, WS, M, N, K, sxm, swn, CHUNK_K,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, PREC: tl.constexpr):
    s = tl.program_id(1)
    rows, cols = _tile_rows_cols(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
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


@triton.jit(do_not_specialize=['M'])  # row counts vary per step: one compile
def _linear_split_last_kernel(X, W, B, Y, WS, ARRIVALS, M, N, K, S, sxm, swn, sym, CHUNK_K,
                              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PREC: tl.constexpr):
    """The split plan in one launch: program (tile, s) writes c_s to the workspace and
    counts itself in at its tile; the tile's last program to arrive adds c_0 + c_1 + ... in
    chunk order from the workspace (whichever program that is: the order never depends on
    arrival), adds the bias, stores y and sets the counter back to zero for the next launch."""
    tile, s = tl.program_id(0), tl.program_id(1)
    rows, cols = _tile_rows_cols(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_lo = s * CHUNK_K
    c = _chunk(X, W, rows, cols, k_lo, tl.minimum(k_lo + CHUNK_K, K), sxm, swn, M, N,
               BLOCK_M, BLOCK_N, BLOCK_K, PREC)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(WS + (s * M + rows[:, None]) * N + cols[None, :], c, mask=ok)  # int64: rows are
    tl.debug_barrier()  # every thread's part of c_s is written before the program counts itself in
    # acq_rel at GPU scope: this program's partial is visible to whoever arrives last, and
    # the last one sees every earlier program's partial
    arrived = tl.atomic_add(ARRIVALS + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == S - 1:
        y = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for t in range(0, S):  # the chunks in order, as the fused kernel adds them
            y += tl.load(WS + (t * M + rows[:, None]) * N + cols[None, :], mask=ok, other=0.0,
                         cache_modifier=".cg")  # from L2: other programs wrote these
        if HAS_BIAS:
            y += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        _store_tile(Y, y, rows, cols, sym, M, N)
        tl.atomic_xchg(ARRIVALS + tile, 0, sem="relaxed", scope="gpu")


# 16-bit: the canonical order (never a function of M)
EXACT_BLOCK_K = 64


EXACT_CHUNK_K = 512


DECODE_ROWS = 256  # 16-bit: M up to this runs the narrow tile family


AUTO_SPLIT = "split_last"  # the linear's automatic split plan ("split": partials, then a combine kernel)


def _tiles(dtype: torch.dtype, M: int) -> dict:
    """BLOCK_M x BLOCK_N x BLOCK_K, the K chunk, warps and stages. 16-bit: a tile family by
    M, both with the canonical BLOCK_K and CHUNK_K (the families: benchmarks/bench_exact.py
    --only sweep); fp32 (IEEE FMA dots, the test dtype): one small tile."""
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, CHUNK_K=256, num_warps=4, num_stages=2)
    if M <= DECODE_ROWS:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=EXACT_BLOCK_K, CHUNK_K=EXACT_CHUNK_K, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=EXACT_BLOCK_K, CHUNK_K=EXACT_CHUNK_K, num_warps=8, num_stages=3)


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchPlan:
    """How an (M, N, K) exact GEMM runs: tile sizes, the K chunk, S chunks, the tile count,
    "fused" or "split", the dot precision and the launch options (warps, stages)."""
    bm: int
    bn: int
    bk: int
    ck: int
    S: int
    n_tiles: int
    plan: str
    prec: str
    extra: dict


PLANS = ("fused", "split", "split_last")


def launch_plan(op: str, x, M: int, N: int, K: int, plan: str | None, tiles: dict | None,
                split: str = "split") -> LaunchPlan:
    """`plan` forces one of PLANS (tests: all give the same bits); None picks `split` (the
    caller's split plan) when the tile grid alone would leave SMs idle. `tiles` overrides
    `_tiles`."""
    t = {**_tiles(x.dtype, M), **(tiles or {})}
    bm, bn, bk, ck = t.pop("BLOCK_M"), t.pop("BLOCK_N"), t.pop("BLOCK_K"), t.pop("CHUNK_K")
    assert ck % bk == 0, "CHUNK_K must be a multiple of BLOCK_K"
    S = triton.cdiv(K, ck)
    n_tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if plan is None:
        plan = split if S > 1 and x.is_cuda and n_tiles < num_sms(x.device) else "fused"
    if plan not in PLANS:
        raise ValueError(f"{op}: plan must be one of {PLANS}, got {plan!r}")
    return LaunchPlan(bm, bn, bk, ck, S, n_tiles, plan, dot_precision(x), t)


def split_partials(x2, w, M: int, N: int, K: int, lp: LaunchPlan) -> torch.Tensor:
    """The split plan's first kernel: (S, M, N) fp32 chunk partials."""
    ws = torch.empty((lp.S, M, N), dtype=torch.float32, device=x2.device)
    _linear_split_kernel[(lp.n_tiles, lp.S)](x2, w, ws, M, N, K, x2.stride(0), w.stride(0), lp.ck, BLOCK_M=lp.bm,
                                             BLOCK_N=lp.bn, BLOCK_K=lp.bk, GROUP_M=8, PREC=lp.prec, **lp.extra)
    return ws


# (device index, stream) -> int32 arrival counters of the one-launch split plan, one per
# tile, all zero between launches (each tile's last program resets its own). One buffer
# per stream: launches on one stream run in order, on two streams they may overlap. Sized
# num_sms, the most tiles an automatic split has, and never replaced: a CUDA graph captured
# on a stream keeps its buffer's pointer.
_ARRIVALS: dict[tuple[int, int], torch.Tensor] = {}


def arrival_counters(device: torch.device, n_tiles: int) -> torch.Tensor:
    """Zeroed int32 counters for a one-launch split of `n_tiles` tiles on the current stream."""
    if device.type != "cuda" or n_tiles > num_sms(device):  # the interpreter, or a forced plan on many tiles
        return torch.zeros(n_tiles, dtype=torch.int32, device=device)
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    if key not in _ARRIVALS:
        _ARRIVALS[key] = torch.zeros(num_sms(device), dtype=torch.int32, device=device)
    return _ARRIVALS[key]


def gemm_operands(x, weight):
    """(x as (M, K) rows, weight, the (M, N) output) with unit last strides, as the GEMM
    kernels index them; the output is allocated, not written."""
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    return x2, w, torch.empty((x2.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)


def linear_exact_triton(x, weight, bias=None, *, plan: str | None = None, tiles: dict | None = None):
    """The exact-mode forward. `plan` forces one of PLANS (tests: all give the same bits);
    None picks the one-launch split ("split_last") when the tile grid alone would leave SMs
    idle, else "fused"."""
    K = x.shape[-1]
    N = weight.shape[0]
    if weight.shape != (N, K) or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)}: expected weight (N, K), bias (N,)")
    if x.dtype != weight.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"linear: x and weight must share one of fp16/bf16/fp32, got {x.dtype}, {weight.dtype}")
    x2, w, y = gemm_operands(x, weight)
    M = x2.shape[0]
    if M == 0:
        return y.view(*x.shape[:-1], N)
    lp = launch_plan("linear", x, M, N, K, plan, tiles, split=AUTO_SPLIT)
    b = bias if bias is not None else y  # unused pointer when HAS_BIAS is False
    if lp.plan == "fused":
        _linear_fused_kernel[(lp.n_tiles,)](x2, w, b, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0), lp.ck,
                                            HAS_BIAS=bias is not None, BLOCK_M=lp.bm, BLOCK_N=lp.bn, BLOCK_K=lp.bk,
                                            GROUP_M=8, PREC=lp.prec, **lp.extra)
    elif lp.plan == "split_last":
        ws = torch.empty((lp.S, M, N), dtype=torch.float32, device=x2.device)
        _linear_split_last_kernel[(lp.n_tiles, lp.S)](
            x2, w, b, y, ws, arrival_counters(x2.device, lp.n_tiles), M, N, K, lp.S, x2.stride(0), w.stride(0),
            y.stride(0), lp.ck, HAS_BIAS=bias is not None, BLOCK_M=lp.bm, BLOCK_N=lp.bn, BLOCK_K=lp.bk, GROUP_M=8,
            PREC=lp.prec, **lp.extra)
    else:
        ws = split_partials(x2, w, M, N, K, lp)
        _linear_combine_kernel[(triton.cdiv(M * N, 1024),)](ws, b, y, M, N, lp.S, y.stride(0),
                                                            HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4)
    return y.view(*x.shape[:-1], N)
