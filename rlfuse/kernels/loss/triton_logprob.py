"""Token log-probs from hidden states, the Triton kernels: the split-V forward with its
fold, and the chunked backward (the math, the contract and the batch-invariance rules
are in `rlfuse.kernels.loss.logprob`'s docstring)."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from rlfuse.kernels.backend import num_sms
from rlfuse.kernels.triton_common import dot, dot_precision, swizzle


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile shape of the forward (and the logits recompute of backward). split_v is a
    multiple of block_v, group a power of two. split_v 256: a V=151936 decode step
    (fold=1) has 594 programs, ~2.25 per slot on 132 SMs x 2 CTAs; group 64 keeps the
    unrolled fold of `_logprob_fold_kernel` small (64 slots). The per-dtype choices below were
    measured (see there); they must stay independent of N (batch invariance)."""
    block_n: int = 64
    block_v: int = 128
    block_d: int = 64
    split_v: int = 256
    group: int = 64
    num_warps: int = 4
    num_stages: int = 3


# Forward tiles per dtype: the fastest of a tile sweep on an H100 (bench_logprob.py --sweep;
# measurements in docs/perf-log.md). fp32 runs on CUDA cores (ieee), 8 warps: 4 spill.
_T16 = Tiles(block_n=128, block_v=256, num_warps=8)
_FWD_TILES = {torch.bfloat16: _T16, torch.float16: _T16, torch.float32: Tiles(block_d=32, num_warps=8)}
# Backward dz tiles per dtype (same sweep).
_DZ_TILES = {torch.bfloat16: _T16, torch.float16: _T16, torch.float32: Tiles(block_n=64, block_d=32, num_warps=8)}
_DZ_SCRATCH_BYTES = 64 << 20  # dz scratch (rows x vocab slice, input dtype): bounds the backward's extra memory
_MIN_SLICE_V = 8192  # vocab columns a backward slice at least: large N chunks rows instead, so the fp32
                     # dH accumulator is re-read V / 8192 times at most (~2% of backward at N = 131072)


@triton.jit
def _logits_tile(H, W, rows, cols, D, s_hn, s_hd, s_wv, s_wd,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                 EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """(BLOCK_N, BLOCK_V) fp32 = H[rows] @ W[cols]^T; rows/cols int64, already clamped in range."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    hp = H + rows[:, None] * s_hn
    wp = W + cols[None, :] * s_wv
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        if EVEN_D:
            h = tl.load(hp + ds[None, :] * s_hd)
            w = tl.load(wp + ds[:, None] * s_wd)
        else:
            h = tl.load(hp + ds[None, :] * s_hd, mask=ds[None, :] < D, other=0.0)
            w = tl.load(wp + ds[:, None] * s_wd, mask=ds[:, None] < D, other=0.0)
        acc = dot(h, w, acc, DOT_PREC)
    return acc


@triton.jit
def _merge(M, S, T, E, m, s, t, e):
    """Fold split state (m, s, t, e) into (M, S, T, E); (-inf, 0, 0, 0) is the identity.
    Explicit fma: this runs in the forward kernel (fold=group) and in `_logprob_fold_kernel`
    (fold=1), and must round the same in both, whatever the compiler would contract."""
    Mn = tl.maximum(M, m)
    Ms = tl.where(Mn == float("-inf"), 0.0, Mn)  # identity + identity: no nan
    a = tl.exp(M - Ms)
    b = tl.exp(m - Ms)
    return Mn, tl.fma(S, a, s * b), T + t, tl.fma(E, a, e * b)


@triton.jit(do_not_specialize=['N', 'P', 'NP'])  # row counts vary per step: one compile
def _logprob_fwd_kernel(H, W, Y, INVT, PART, N, V, D, P, NP, inv_t_scalar, s_hn, s_hd, s_wv, s_wd,
                        PER_ROW_T: tl.constexpr, ENTROPY: tl.constexpr, FOLD: tl.constexpr, SPLIT_V: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                        EVEN_D: tl.constexpr, GROUP_R: tl.constexpr, DOT_PREC: tl.constexpr):
    r, p = swizzle(tl.program_id(0), tl.cdiv(N, BLOCK_N), P, GROUP_R)
    rows = r * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)  # clamped: unmasked loads, results discarded
    if PER_ROW_T:
        inv_t = tl.load(INVT + rows_c)
    else:
        inv_t = tl.full((BLOCK_N,), inv_t_scalar, tl.float32)
    tgt = tl.load(Y + rows_c).to(tl.int32)  # V < 2^31
    ninf = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    zero = tl.zeros((BLOCK_N,), tl.float32)
    M, S, T, E = ninf, zero, zero, zero
    for f in range(FOLD):
        v_start = (p * FOLD + f) * SPLIT_V
        v_end = tl.minimum(v_start + SPLIT_V, V)  # <= v_start past the vocab: no tile, identity
        m, s, t, e = ninf, zero, zero, zero
        for v0 in range(v_start, v_end, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            cmask = cols < V
            acc = _logits_tile(H, W, rows_c, tl.minimum(cols, V - 1).to(tl.int64), D, s_hn, s_hd, s_wv, s_wd,
                               BLOCK_N, BLOCK_V, BLOCK_D, EVEN_D, DOT_PREC)
            # columns past V: a finite -1e30 (exp -> 0 and 0 * z = 0 in the entropy sum, no nan)
            z = tl.where(cmask[None, :], acc * inv_t[:, None], -1e30)
            mn = tl.maximum(m, tl.max(z, 1))  # a real logit: the tile has >= 1 column
            alpha = tl.exp(m - mn)
            pz = tl.exp(z - mn[:, None])
            s = s * alpha + tl.sum(pz, 1)
            if ENTROPY:
                e = e * alpha + tl.sum(pz * z, 1)
            t += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), 1)
            m = mn
        M, S, T, E = _merge(M, S, T, E, m, s, t, e)
    rmask = rows < N
    off = rows.to(tl.int64) * P + p  # PART (3 or 4, N, P); NP = N * P from the host:
    # an int argument equal to 1 arrives as a constexpr, which has no .to()
    tl.store(PART + off, M, mask=rmask)
    tl.store(PART + NP + off, S, mask=rmask)
    tl.store(PART + 2 * NP + off, T, mask=rmask)
    if ENTROPY:
        tl.store(PART + 3 * NP + off, E, mask=rmask)


@triton.jit(do_not_specialize=['N', 'P', 'NPI', 'NPO'])  # row counts vary per step: one compile
def _logprob_fold_kernel(PIN, POUT, LOGP, ENT, LSE, N, P, NPI, NPO,
                         C: tl.constexpr, ENTROPY: tl.constexpr, FINAL: tl.constexpr, BLOCK: tl.constexpr):
    """Folds partials PIN (3|4, N, P) left to right, C slots per program: program (r, g)
    takes slots [g C, g C + C) (past P: identity) of BLOCK rows, an unrolled fold with
    one load per slot and statistic (the loads do not depend on the fold, so they issue
    ahead of it; a (BLOCK, C) tile with per-slot extraction would cost O(C^2)).
    FINAL: C >= P, one program per
    row block, writes logp / entropy / lse; else writes POUT (3|4, N, cdiv(P, C))."""
    g = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < N
    base = PIN + rows.to(tl.int64) * P + g * C
    ninf = tl.full((BLOCK,), float("-inf"), tl.float32)
    zero = tl.zeros((BLOCK,), tl.float32)
    M, S, T, E = ninf, zero, zero, zero
    for j in tl.static_range(C):
        ok = rmask & (tl.full((BLOCK,), g * C + j, tl.int32) < P)
        e = tl.load(base + 3 * NPI + j, mask=ok, other=0.0) if ENTROPY else zero
        M, S, T, E = _merge(M, S, T, E, tl.load(base + j, mask=ok, other=float("-inf")),
                            tl.load(base + NPI + j, mask=ok, other=0.0), tl.load(base + 2 * NPI + j, mask=ok, other=0.0),
                            e)
    if FINAL:
        S = tl.where(rmask, S, 1.0)  # rows past N: keep log/div quiet
        lse = M + tl.log(S)
        tl.store(LOGP + rows, T - lse, mask=rmask)
        tl.store(LSE + rows, lse, mask=rmask)
        if ENTROPY:
            tl.store(ENT + rows, lse - tl.math.div_rn(E, S), mask=rmask)
    else:
        G = tl.num_programs(1)
        out = POUT + rows.to(tl.int64) * G + g
        tl.store(out, M, mask=rmask)
        tl.store(out + NPO, S, mask=rmask)
        tl.store(out + 2 * NPO, T, mask=rmask)
        if ENTROPY:
            tl.store(out + 3 * NPO, E, mask=rmask)


def _check(hidden, weight, targets):
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"token_logprobs: hidden (N, D) and weight (V, D) expected, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"token_logprobs: targets shape {tuple(targets.shape)} != ({hidden.shape[0]},)")
    if hidden.dtype != weight.dtype or hidden.dtype not in _FWD_TILES:
        raise ValueError(f"token_logprobs (triton): hidden and weight must share a dtype in "
                         f"{list(_FWD_TILES)}, got {hidden.dtype} and {weight.dtype}")


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    # Rows may have any stride (read in place); elements along D must be adjacent for
    # vectorized, pipelined loads (Triton specializes a stride of 1). Else one copy.
    return x if x.stride(1) == 1 else x.contiguous()


def _t_args(inv_t: torch.Tensor):
    """(pointer tensor or None, scalar) kernel arguments for inv_T."""
    if inv_t.ndim:
        return inv_t, 1.0
    return None, float(inv_t)  # 0-d CPU tensor: no device sync; exact as a Triton fp32 arg


def token_logprobs_fwd_triton(hidden, weight, targets, inv_t, return_entropy=False, *, tiles=None,
                              fold=None, out=None):
    """-> (logp, entropy or None, lse), each (N,) fp32. `out` = (logp, entropy, lse)
    buffers to write (static buffers for CUDA graphs); `fold` forces 1 or tiles.group."""
    _check(hidden, weight, targets)
    hidden, weight = _unit_stride(hidden), _unit_stride(weight)
    N, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    tl_ = tiles or _FWD_TILES[hidden.dtype]
    if out is None:
        f32 = dict(dtype=torch.float32, device=dev)
        out = (torch.empty(N, **f32), torch.empty(N, **f32) if return_entropy else None, torch.empty(N, **f32))
    logp, ent, lse = out
    if N == 0:
        return logp, ent, lse
    splits = triton.cdiv(V, tl_.split_v)
    groups = triton.cdiv(splits, tl_.group)
    R = triton.cdiv(N, tl_.block_n)
    if fold is None:  # one program per (row block, split) until the grid fills the GPU twice over
        fold = 1 if R * groups < 2 * num_sms(dev) else tl_.group
    P = triton.cdiv(splits, fold)
    part = torch.empty((4 if return_entropy else 3, N, P), dtype=torch.float32, device=dev)
    t_ptr, t_val = _t_args(inv_t)
    _logprob_fwd_kernel[(R * P,)](
        hidden, weight, targets, t_ptr, part, N, V, D, P, N * P, t_val,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        PER_ROW_T=t_ptr is not None, ENTROPY=return_entropy, FOLD=fold, SPLIT_V=tl_.split_v,
        BLOCK_N=tl_.block_n, BLOCK_V=tl_.block_v, BLOCK_D=tl_.block_d, EVEN_D=D % tl_.block_d == 0,
        GROUP_R=8, DOT_PREC=dot_precision(hidden),
        num_warps=tl_.num_warps, num_stages=tl_.num_stages)
    nstat = part.shape[0]
    if fold == 1:  # splits -> groups, the same left fold the forward kernel does in registers
        gpart = torch.empty((nstat, N, groups), dtype=torch.float32, device=dev)
        _logprob_fold_kernel[(triton.cdiv(N, 16), groups)](part, gpart, None, None, None, N, P, N * P, N * groups,
                                                           C=tl_.group, ENTROPY=return_entropy, FINAL=False, BLOCK=16)
        part, P = gpart, groups
    _logprob_fold_kernel[(triton.cdiv(N, 32), 1)](part, None, logp, ent if return_entropy else logp, lse, N, P,
                                                  N * P, 0, C=triton.next_power_of_2(P), ENTROPY=return_entropy,
                                                  FINAL=True, BLOCK=32)
    return logp, ent, lse


@triton.jit(do_not_specialize=['row0', 'n_rows', 'col0', 'n_cols'])  # shapes vary per step: one compile
def _logprob_dz_kernel(H, W, Y, INVT, LSE, ENT, GLP, GENT, DZ, row0, n_rows, col0, n_cols, V, D, inv_t_scalar,
                       s_hn, s_hd, s_wv, s_wd, s_dz,
                       PER_ROW_T: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                       EVEN_D: tl.constexpr, GROUP_R: tl.constexpr, DOT_PREC: tl.constexpr):
    """dz of rows [row0, row0 + n_rows) x vocab columns [col0, col0 + n_cols) into DZ (n_rows, n_cols)."""
    r, c = swizzle(tl.program_id(0), tl.cdiv(n_rows, BLOCK_N), tl.cdiv(n_cols, BLOCK_V), GROUP_R)
    lrows = r * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of the chunk
    rows_c = row0 + tl.minimum(lrows, n_rows - 1).to(tl.int64)
    lcols = c * BLOCK_V + tl.arange(0, BLOCK_V)  # columns of the slice
    cols = col0 + lcols
    acc = _logits_tile(H, W, rows_c, tl.minimum(cols, V - 1).to(tl.int64), D, s_hn, s_hd, s_wv, s_wd,
                       BLOCK_N, BLOCK_V, BLOCK_D, EVEN_D, DOT_PREC)
    if PER_ROW_T:
        inv_t = tl.load(INVT + rows_c)
    else:
        inv_t = tl.full((BLOCK_N,), inv_t_scalar, tl.float32)
    z = acc * inv_t[:, None]
    lse = tl.load(LSE + rows_c)
    p = tl.exp(z - lse[:, None])
    dz = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    if HAS_GLP:
        g = tl.load(GLP + rows_c)
        tgt = tl.load(Y + rows_c).to(tl.int32)
        dz = g[:, None] * (tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0) - p)
    if HAS_GENT:
        ge = tl.load(GENT + rows_c)
        c0 = lse - tl.load(ENT + rows_c)  # E_p[z]
        dz += ge[:, None] * p * (c0[:, None] - z)
    dz = dz * inv_t[:, None]
    mask = (lrows < n_rows)[:, None] & (lcols < n_cols)[None, :]
    tl.store(DZ + lrows.to(tl.int64)[:, None] * s_dz + lcols[None, :], dz.to(DZ.dtype.element_ty), mask=mask)


def _mm_fp32(out, a, b, first: bool):
    """out (fp32) = a @ b (first) or += a @ b, a and b in the input dtype. On CUDA with 16-bit
    inputs: one cuBLAS GEMM with fp32 output accumulating in place (addmm out_dtype; several
    times faster than a Triton tile kernel for dW, docs/perf-log.md); fp32 inputs: an IEEE fp32
    GEMM (torch keeps TF32 off for matmuls unless the user turns it on); CPU (the interpreter
    tests): the same product in fp32."""
    if out.device.type == "cuda" and a.dtype != torch.float32:
        if first:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
        else:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        return
    a, b = a.float(), b.float()
    if first:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)


def _bwd_plan(N, V, esize, tz, chunk_rows, slice_v):
    """(rows a chunk C, vocab columns a slice Vc): dz (C, Vc) fits `_DZ_SCRATCH_BYTES`; the
    widest slice that takes every row at once, at least `_MIN_SLICE_V` columns (then rows are
    chunked). Multiples of the dz tile. Shapes only: no numbers depend on the data."""
    if slice_v is None:
        slice_v = _DZ_SCRATCH_BYTES // (max(N, 1) * esize) // tz.block_v * tz.block_v
        slice_v = max(slice_v, _MIN_SLICE_V)
    slice_v = min(slice_v, V)
    if chunk_rows is None:
        chunk_rows = max(tz.block_n, _DZ_SCRATCH_BYTES // (slice_v * esize) // tz.block_n * tz.block_n)
    return min(chunk_rows, max(N, 1)), slice_v


def token_logprobs_bwd_triton(g_logp, g_ent, hidden, weight, targets, inv_t, lse, ent, *,
                              need_dh=True, need_dw=True, chunk_rows=None, slice_v=None, tiles=None,
                              alloc=torch.empty):
    """-> (dH like hidden or None, dW like weight or None). g_logp / g_ent (N,) or None.
    `chunk_rows` / `slice_v` force the row chunk and vocab slice (tests reach several of each
    at small shapes); `alloc` makes every buffer (tests pass a NaN-filling one).

    Vocab slices outer, row chunks inner: dW[slice] is complete after its slice (fp32
    accumulation over the row chunks in a (Vc, D) buffer, rounded once into dW), so no
    fp32 (V, D) copy of the head exists; dH accumulates over the slices in an fp32 (N, D)
    buffer (16-bit inputs; fp32 inputs accumulate in dH itself). Extra memory beyond dH
    and dW: dz (C, Vc) + fp32 (Vc, D) + fp32 (N, D)."""
    hidden, weight = _unit_stride(hidden), _unit_stride(weight)
    N, D = hidden.shape
    V = weight.shape[0]
    dev, dt = hidden.device, hidden.dtype
    f32 = torch.float32
    tz = tiles or _DZ_TILES[dt]
    C, Vc = _bwd_plan(N, V, hidden.element_size(), tz, chunk_rows, slice_v)
    dh = alloc((N, D), dtype=dt, device=dev) if need_dh else None
    dw = alloc((V, D), dtype=dt, device=dev) if need_dw else None
    if N == 0:
        return (dh.zero_() if need_dh else None, dw.zero_() if need_dw else None)
    dh32 = (dh if dt == f32 else alloc((N, D), dtype=f32, device=dev)) if need_dh else None
    dw32 = (None if dt == f32 else alloc((Vc, D), dtype=f32, device=dev)) if need_dw else None
    dz_buf = alloc((C * Vc,), dtype=dt, device=dev)
    t_ptr, t_val = _t_args(inv_t)
    prec = dot_precision(hidden)
    glp = g_logp.float().contiguous() if g_logp is not None else None
    gent = g_ent.float().contiguous() if g_ent is not None else None
    for v0 in range(0, V, Vc):  # host loops over shapes only
        nv = min(Vc, V - v0)
        dw_acc = dw[v0:v0 + nv] if dw32 is None and need_dw else (dw32[:nv] if need_dw else None)
        for r0 in range(0, N, C):
            n = min(C, N - r0)
            dz = dz_buf[:n * nv].view(n, nv)
            _logprob_dz_kernel[(triton.cdiv(n, tz.block_n) * triton.cdiv(nv, tz.block_v),)](
                hidden, weight, targets, t_ptr, lse, ent, glp, gent, dz, r0, n, v0, nv, V, D, t_val,
                hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), dz.stride(0),
                PER_ROW_T=t_ptr is not None, HAS_GLP=glp is not None, HAS_GENT=gent is not None,
                BLOCK_N=tz.block_n, BLOCK_V=tz.block_v, BLOCK_D=tz.block_d, EVEN_D=D % tz.block_d == 0,
                GROUP_R=8, DOT_PREC=prec, num_warps=tz.num_warps, num_stages=tz.num_stages)
            if need_dh:
                _mm_fp32(dh32[r0:r0 + n], dz, weight[v0:v0 + nv], first=v0 == 0)
            if need_dw:
                _mm_fp32(dw_acc, dz.t(), hidden[r0:r0 + n], first=r0 == 0)
        if dw32 is not None:
            dw[v0:v0 + nv].copy_(dw_acc)
    if need_dh and dh32 is not dh:
        dh.copy_(dh32)
    return dh, dw


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, return_entropy):
        logp, ent, lse = token_logprobs_fwd_triton(hidden, weight, targets, inv_t, return_entropy)
        ctx.save_for_backward(hidden, weight, targets, inv_t, lse, ent)
        ctx.return_entropy = return_entropy
        ctx.set_materialize_grads(False)  # an unused output's grad stays None: no dead work
        return (logp, ent) if return_entropy else logp

    @staticmethod
    def backward(ctx, g_logp, g_ent=None):
        hidden, weight, targets, inv_t, lse, ent = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None, None
        dh, dw = token_logprobs_bwd_triton(g_logp, g_ent if ctx.return_entropy else None, hidden, weight,
                                           targets, inv_t, lse, ent, need_dh=ctx.needs_input_grad[0],
                                           need_dw=ctx.needs_input_grad[1])
        return dh, dw, None, None, None


def token_logprobs(hidden, weight, targets, inv_t, return_entropy: bool = False):
    """The op on the Triton backend (autograd where a gradient is needed); inv_t from
    `rlfuse.kernels.loss.logprob._inv_temperature`."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _TokenLogprobs.apply(hidden, weight, targets, inv_t, return_entropy)
    logp, ent, _ = token_logprobs_fwd_triton(hidden, weight, targets, inv_t, return_entropy)
    return (logp, ent) if return_entropy else logp
