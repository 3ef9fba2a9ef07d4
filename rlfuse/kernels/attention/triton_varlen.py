"""Varlen causal attention, the Triton kernels: the forward, the backward (delta, dK/dV,
dQ) and the tile update `attend_tile` that `paged_attention`'s kernel shares (the
contract, the math and the exact-mode rules are in `rlfuse.kernels.attention.varlen`'s
docstring)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.attention.varlen import KV_BLOCK, SharedPrefix, exact_tile_rows
from rlfuse.kernels.triton_common import dot, dot_precision

LOG2E = 1.4426950408889634  # kernels spell log2(e) and ln(2) as literals (jit globals)


@triton.jit
def attend_tile(acc, l_i, m_i, q, k, v, cols, row_pos, hi, qk_scale, MASK: tl.constexpr, PREC: tl.constexpr):
    """One KV tile of the online softmax, shared by this forward and `paged_attention`, so
    that in exact numerics a query row sees the same arithmetic through either kernel.
    q (M, Dh), k and v (N, Dh) loaded; cols (N,) key positions, row_pos (M,) query
    positions; with MASK, key j is visible to row i iff cols[j] <= row_pos[i] and cols[j] < hi."""
    s = dot(q, tl.trans(k), None, PREC) * qk_scale  # (M, N) fp32, log2 units
    if MASK:
        s = tl.where((cols[None, :] <= row_pos[:, None]) & (cols[None, :] < hi), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay at p = 0
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, None, PREC)
    return acc, l_i, m_new


@triton.jit
def _kv_ptrs(K, V, k_ptrs, v_ptrs, start_n, offs_n, offs_d, row0, prow0, P, skt, svt, kv_off_k, kv_off_v,
             SHARED: tl.constexpr):
    """Pointers to the key tile at logical keys start_n + offs_n: unshared, rows row0 + key;
    with a shared prefix of P keys at rows prow0.., logical key j < P at prow0 + j and the
    segment's own key j at row0 + j - P (the module docstring of rlfuse.kernels.attention.varlen)."""
    if SHARED:
        cols = start_n + offs_n
        rows = tl.where(cols < P, prow0 + cols, row0 + cols - P)
        kp = K + rows[:, None] * skt + kv_off_k + offs_d[None, :]
        vp = V + rows[:, None] * svt + kv_off_v + offs_d[None, :]
    else:
        kp = k_ptrs + start_n * skt
        vp = v_ptrs + start_n * svt
    return kp, vp


@triton.jit
def _fwd_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, L, qk_scale,
              MASK: tl.constexpr, PREC: tl.constexpr):
    """One key tile; offs_m and L in logical positions (a shared prefix counted)."""
    cols = start_n + offs_n
    if MASK:
        k = tl.load(k_ptrs, mask=cols[:, None] < L, other=0.0)
        v = tl.load(v_ptrs, mask=cols[:, None] < L, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return attend_tile(acc, l_i, m_i, q, k, v, cols, offs_m, L, qk_scale, MASK, PREC)


@triton.jit(do_not_specialize=['n_tok'])  # row counts vary per step: one compile
def _attn_fwd_kernel(Q, K, V, O, LSE, CU, PSTART, PLEN, sqt, sqh, skt, skh, svt, svh, sot, soh, n_tok,
                     n_rep, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, PREC: tl.constexpr, ALL_MASKED: tl.constexpr,
                     SHARED: tl.constexpr):
    pid_m, hq, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(CU + b)
    L = tl.load(CU + b + 1) - start
    start_m = pid_m * BLOCK_M
    if start_m >= L:
        return
    hk = hq // n_rep
    row0 = start.to(tl.int64)
    if SHARED:  # logical positions: the prefix's P keys come first
        P = tl.load(PLEN + b)
        prow0 = tl.load(PSTART + b).to(tl.int64)
    else:
        P = 0
        prow0 = row0
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (row0 + offs_m[:, None]) * sqt + hq * sqh + offs_d[None, :],
                mask=offs_m[:, None] < L, other=0.0)
    k_ptrs = K + (row0 + offs_n[:, None]) * skt + hk * skh + offs_d[None, :]
    v_ptrs = V + (row0 + offs_n[:, None]) * svt + hk * svh + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    pos_m = P + offs_m
    # keys < full_end are visible to every row: no mask needed (exact numerics masks every
    # tile, as paged_attention does, whose tiles split differently between masked and not)
    full_end = 0 if ALL_MASKED else ((P + start_m) // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        kp, vp = _kv_ptrs(K, V, k_ptrs, v_ptrs, start_n, offs_n, offs_d, row0, prow0, P, skt, svt,
                          hk * skh, hk * svh, SHARED)
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, kp, vp, start_n, pos_m, offs_n, P + L, qk_scale, False, PREC)
    for start_n in range(full_end, tl.minimum(P + start_m + BLOCK_M, P + L), BLOCK_N):
        kp, vp = _kv_ptrs(K, V, k_ptrs, v_ptrs, start_n, offs_n, offs_d, row0, prow0, P, skt, svt,
                          hk * skh, hk * svh, SHARED)
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, kp, vp, start_n, pos_m, offs_n, P + L, qk_scale, True, PREC)
    o = acc / l_i[:, None]
    row_ok = offs_m < L
    tl.store(O + (row0 + offs_m[:, None]) * sot + hq * soh + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + hq * n_tok + row0 + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)


@triton.jit(do_not_specialize=['n_tok'])  # row counts vary per step: one compile
def _attn_bwd_delta_kernel(O, DO, DELTA, sot, soh, sdt, sdh, n_tok,
                           HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < n_tok
    o = tl.load(O + rows[:, None].to(tl.int64) * sot + h * soh + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + rows[:, None].to(tl.int64) * sdt + h * sdh + offs_d[None, :], mask=ok[:, None], other=0.0)
    tl.store(DELTA + h * n_tok + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


@triton.jit
def _bwd_dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, plen_ptr, start_m, offs_m, offs_n, L,
                   sqt, sdt, qk_scale, MASK: tl.constexpr, READERS: tl.constexpr, PREC: tl.constexpr):
    """MASK: causal within the segment; READERS: rows of readers of this segment as a
    prefix, each seeing the first plen[row] keys (`SharedPrefix.row_length`)."""
    rows = start_m + offs_m
    ok = rows < L
    q = tl.load(q_ptrs + start_m * sqt, mask=ok[:, None], other=0.0)
    do = tl.load(do_ptrs + start_m * sdt, mask=ok[:, None], other=0.0)
    # rows past the sequence get lse = +inf, hence p = 0: they contribute nothing
    lse = tl.load(lse_ptr + rows, mask=ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(delta_ptr + rows, mask=ok, other=0.0)
    pT = tl.exp2(dot(k, tl.trans(q), None, PREC) * qk_scale - lse[None, :])  # (N, M)
    if MASK:
        pT = tl.where(rows[None, :] >= offs_n[:, None], pT, 0.0)
    if READERS:
        plen = tl.load(plen_ptr + rows, mask=ok, other=0)
        pT = tl.where(offs_n[:, None] < plen[None, :], pT, 0.0)
    dv += dot(pT.to(do.dtype), do, None, PREC)
    dpT = dot(v, tl.trans(do), None, PREC)
    dsT = pT * (dpT - delta[None, :])
    dk += dot(dsT.to(q.dtype), q, None, PREC)
    return dk, dv


@triton.jit(do_not_specialize=['n_tok'])  # row counts vary per step: one compile
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU, READERS_END, ROW_PLEN, sqt, sqh, skt, skh, svt, svh,
                          sdt, sdh, sdkt, sdkh, sdvt, sdvh, n_tok, n_rep, qk_scale, sm_scale,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          PREC: tl.constexpr, SHARED: tl.constexpr):
    pid_n, hk, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(CU + b)
    L = tl.load(CU + b + 1) - start
    start_n = pid_n * BLOCK_N
    if start_n >= L:
        return
    row0 = start.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_ok = offs_n[:, None] < L
    k = tl.load(K + (row0 + offs_n[:, None]) * skt + hk * skh + offs_d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(V + (row0 + offs_n[:, None]) * svt + hk * svh + offs_d[None, :], mask=kv_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    diag_lo = (start_n // BLOCK_M) * BLOCK_M
    diag_hi = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M  # query blocks from here see all keys
    for g in range(0, n_rep):  # the query heads of this kv head, summed in a fixed order
        hq = hk * n_rep + g
        q_ptrs = Q + (row0 + offs_m[:, None]) * sqt + hq * sqh + offs_d[None, :]
        do_ptrs = DO + (row0 + offs_m[:, None]) * sdt + hq * sdh + offs_d[None, :]
        lse_ptr = LSE + hq * n_tok + row0
        delta_ptr = DELTA + hq * n_tok + row0
        plen_ptr = ROW_PLEN + row0
        for start_m in range(diag_lo, tl.minimum(diag_hi, L), BLOCK_M):
            dk, dv = _bwd_dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, plen_ptr, start_m,
                                    offs_m, offs_n, L, sqt, sdt, qk_scale, True, False, PREC)
        for start_m in range(diag_hi, L, BLOCK_M):
            dk, dv = _bwd_dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, plen_ptr, start_m,
                                    offs_m, offs_n, L, sqt, sdt, qk_scale, False, False, PREC)
        if SHARED:  # the readers of this segment as a prefix: rows L..R_end (local), each its first keys
            r_end = tl.load(READERS_END + b) - start
            for start_m in range(L, r_end, BLOCK_M):
                dk, dv = _bwd_dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, plen_ptr, start_m,
                                        offs_m, offs_n, r_end, sqt, sdt, qk_scale, False, True, PREC)
    tl.store(DK + (row0 + offs_n[:, None]) * sdkt + hk * sdkh + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + (row0 + offs_n[:, None]) * sdvt + hk * sdvh + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _bwd_dq_step(dq, q, do, lse, delta, k_ptrs, v_ptrs, start_n, offs_m, offs_n, L, qk_scale,
                 MASK: tl.constexpr, PREC: tl.constexpr):
    cols = start_n + offs_n
    if MASK:
        k = tl.load(k_ptrs, mask=cols[:, None] < L, other=0.0)
        v = tl.load(v_ptrs, mask=cols[:, None] < L, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    p = tl.exp2(dot(q, tl.trans(k), None, PREC) * qk_scale - lse[:, None])  # (M, N)
    if MASK:
        p = tl.where(cols[None, :] <= offs_m[:, None], p, 0.0)
    dp = dot(do, tl.trans(v), None, PREC)
    ds = p * (dp - delta[:, None])
    dq += dot(ds.to(k.dtype), k, None, PREC)
    return dq


@triton.jit(do_not_specialize=['n_tok'])  # row counts vary per step: one compile
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU, PSTART, PLEN, sqt, sqh, skt, skh, svt, svh, sdt, sdh,
                        sdqt, sdqh, n_tok, n_rep, qk_scale, sm_scale, HEAD_DIM: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, SHARED: tl.constexpr):
    pid_m, hq, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(CU + b)
    L = tl.load(CU + b + 1) - start
    start_m = pid_m * BLOCK_M
    if start_m >= L:
        return
    hk = hq // n_rep
    row0 = start.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_m < L
    q = tl.load(Q + (row0 + offs_m[:, None]) * sqt + hq * sqh + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + (row0 + offs_m[:, None]) * sdt + hq * sdh + offs_d[None, :], mask=ok[:, None], other=0.0)
    lse = tl.load(LSE + hq * n_tok + row0 + offs_m, mask=ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + hq * n_tok + row0 + offs_m, mask=ok, other=0.0)
    k_ptrs = K + (row0 + offs_n[:, None]) * skt + hk * skh + offs_d[None, :]
    v_ptrs = V + (row0 + offs_n[:, None]) * svt + hk * svh + offs_d[None, :]
    if SHARED:  # logical positions, as in the forward
        P = tl.load(PLEN + b)
        prow0 = tl.load(PSTART + b).to(tl.int64)
    else:
        P = 0
        prow0 = row0
    pos_m = P + offs_m
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_end = ((P + start_m) // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        kp, vp = _kv_ptrs(K, V, k_ptrs, v_ptrs, start_n, offs_n, offs_d, row0, prow0, P, skt, svt,
                          hk * skh, hk * svh, SHARED)
        dq = _bwd_dq_step(dq, q, do, lse, delta, kp, vp, start_n, pos_m, offs_n, P + L, qk_scale, False, PREC)
    for start_n in range(full_end, tl.minimum(P + start_m + BLOCK_M, P + L), BLOCK_N):
        kp, vp = _kv_ptrs(K, V, k_ptrs, v_ptrs, start_n, offs_n, offs_d, row0, prow0, P, skt, svt,
                          hk * skh, hk * svh, SHARED)
        dq = _bwd_dq_step(dq, q, do, lse, delta, kp, vp, start_n, pos_m, offs_n, P + L, qk_scale, True, PREC)
    tl.store(DQ + (row0 + offs_m[:, None]) * sdqt + hq * sdqh + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=ok[:, None])


def _configs(head_dim: int, itemsize: int) -> dict:
    """Tile sizes and launch settings. 16-bit: tiles without register spills in the sm_90a
    build; the Dh-128 backward tiles are the fastest of `bench_attention.py --sweep-bwd` on
    an H100 (numbers in docs/perf-log.md); Dh 64 / 256 and the forward are not timed yet.
    fp32 runs IEEE FMA dots (a test dtype): small tiles, again chosen for no spills."""
    if itemsize == 4:
        return {"fwd": dict(BLOCK_M=32, num_warps=8, num_stages=2),
                "dkdv": dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1),
                "dq": dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)}
    small, huge = head_dim <= 64, head_dim > 128
    return {"fwd": dict(BLOCK_M=64 if huge else 128, num_warps=4 if small else 8, num_stages=2 if huge else 3),
            "dkdv": dict(BLOCK_M=32, BLOCK_N=128 if small else (32 if huge else 64),
                         num_warps=4 if head_dim == 128 else 8, num_stages=2),
            "dq": dict(BLOCK_M=64, BLOCK_N=32 if huge else 64, num_warps=4 if head_dim <= 128 else 8, num_stages=2)}


def _lastdim_contig(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def exact_config(itemsize: int) -> dict:
    """The one attention tile of exact numerics, for this forward and for every call of
    `paged_attention` (prefill and decode): BLOCK_M query rows x KV_BLOCK keys x Dh, every
    tile masked, no FMA contraction (so a mask's presence cannot change a row's rounding).
    64 rows: one warpgroup's matrix-instruction height on Hopper."""
    return dict(BLOCK_M=exact_tile_rows(itemsize), num_warps=4, num_stages=2, enable_fp_fusion=False)


def varlen_fwd(q, k, v, cu_seqlens, max_seqlen: int, scale: float, *, config: dict | None = None,
               out: torch.Tensor | None = None, lse: torch.Tensor | None = None, exact: bool = False,
               prefix: SharedPrefix | None = None):
    """Launch the forward: returns o (T, Hq, Dh) and lse (Hq, T) fp32, written into
    `out` / `lse` when given. `config` overrides the tile settings (tests, tuning sweeps);
    `exact` runs the exact-numerics tile (`exact_config`); `prefix` a shared prefix."""
    q, k, v = _lastdim_contig(q), _lastdim_contig(k), _lastdim_contig(v)
    T, Hq, D = q.shape
    o = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty((Hq, T), dtype=torch.float32, device=q.device) if lse is None else lse
    assert o.shape == q.shape and o.stride(-1) == 1 and lse.shape == (Hq, T) and lse.is_contiguous()
    B = cu_seqlens.shape[0] - 1
    if T == 0 or B <= 0 or max_seqlen <= 0:
        return o, lse
    base = exact_config(q.element_size()) if exact else _configs(D, q.element_size())["fwd"]
    cfg = {**base, **(config or {})}
    bm = cfg.pop("BLOCK_M")
    bn = cfg.pop("BLOCK_N", KV_BLOCK)
    grid = (triton.cdiv(max_seqlen, bm), Hq, B)
    pstart, plen = (prefix.start, prefix.length) if prefix is not None else (cu_seqlens, cu_seqlens)
    _attn_fwd_kernel[grid](q, k, v, o, lse, cu_seqlens, pstart, plen, q.stride(0), q.stride(1), k.stride(0),
                           k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1), T, Hq // k.shape[1],
                           scale * LOG2E, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, PREC=dot_precision(q),
                           ALL_MASKED=exact, SHARED=prefix is not None, **cfg)
    return o, lse


def varlen_bwd(do, q, k, v, o, lse, cu_seqlens, max_seqlen: int, scale: float, *,
               config: dict | None = None, grads: tuple | None = None, prefix: SharedPrefix | None = None):
    """Launch the backward: returns dq, dk, dv (dk, dv summed over each GQA group), written
    into `grads` = (dq, dk, dv) when given. `config` = {"dkdv": {...}, "dq": {...}}."""
    do = _lastdim_contig(do)
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if grads is None:
        grads = (torch.empty(q.shape, dtype=q.dtype, device=q.device),
                 torch.empty(k.shape, dtype=k.dtype, device=k.device),
                 torch.empty(v.shape, dtype=v.dtype, device=v.device))
    dq, dk, dv = grads
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape and all(g.stride(-1) == 1 for g in grads)
    B = cu_seqlens.shape[0] - 1
    if T == 0 or B <= 0 or max_seqlen <= 0:
        return dq, dk, dv
    cfgs = _configs(D, q.element_size())
    for name, over in (config or {}).items():
        cfgs[name] = {**cfgs[name], **over}
    delta = torch.empty((Hq, T), dtype=torch.float32, device=q.device)
    _attn_bwd_delta_kernel[(triton.cdiv(T, 64), Hq)](o, do, delta, o.stride(0), o.stride(1), do.stride(0),
                                                     do.stride(1), T, HEAD_DIM=D, BLOCK=64)
    common = dict(HEAD_DIM=D, PREC=dot_precision(q), SHARED=prefix is not None)
    # the prefix tensors where the kernels read them, else any int32 pointer (never read)
    pstart, plen, readers_end, row_plen = prefix if prefix is not None else (cu_seqlens,) * 4
    c = dict(cfgs["dkdv"])
    bm, bn = c.pop("BLOCK_M"), c.pop("BLOCK_N")
    _attn_bwd_dkdv_kernel[(triton.cdiv(max_seqlen, bn), Hkv, B)](
        q, k, v, do, lse, delta, dk, dv, cu_seqlens, readers_end, row_plen, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0),
        dv.stride(1), T, Hq // Hkv, scale * LOG2E, scale, BLOCK_M=bm, BLOCK_N=bn, **common, **c)
    c = dict(cfgs["dq"])
    bm, bn = c.pop("BLOCK_M"), c.pop("BLOCK_N")
    _attn_bwd_dq_kernel[(triton.cdiv(max_seqlen, bm), Hq, B)](
        q, k, v, do, lse, delta, dq, cu_seqlens, pstart, plen, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), do.stride(0), do.stride(1), dq.stride(0), dq.stride(1), T, Hq // Hkv,
        scale * LOG2E, scale, BLOCK_M=bm, BLOCK_N=bn, **common, **c)
    return dq, dk, dv


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale, exact, prefix):
        q, k, v = _lastdim_contig(q), _lastdim_contig(k), _lastdim_contig(v)
        o, lse = varlen_fwd(q, k, v, cu_seqlens, max_seqlen, scale, exact=exact, prefix=prefix)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.max_seqlen, ctx.scale, ctx.prefix = max_seqlen, scale, prefix
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = varlen_bwd(do, q, k, v, o, lse, cu_seqlens, ctx.max_seqlen, ctx.scale, prefix=ctx.prefix)
        return dq, dk, dv, None, None, None, None, None


def varlen_attention(q, k, v, cu_seqlens, max_seqlen: int, scale: float, exact: bool,
                     prefix: SharedPrefix | None = None):
    """The op on the Triton backend: (o, lse), differentiable in q, k, v."""
    return _VarlenAttention.apply(q, k, v, cu_seqlens, max_seqlen, scale, exact, prefix)
