"""Causal attention over packed variable-length sequences (the trainer's forward).

Contract: q (T, Hq, Dh), k and v (T, Hkv, Dh) with Hq % Hkv == 0 (GQA: query head h
reads kv head h // (Hq // Hkv)); `cu_seqlens` (B+1,) int32 cumulative lengths, so
sequence b owns rows cu_seqlens[b]:cu_seqlens[b+1]; `max_seqlen` a Python int (no host
sync to find it; it only sizes the grid). Row i of sequence b attends to rows 0..i of
the same sequence. Output (T, Hq, Dh) in q.dtype; softmax in fp32 with scale `scale`
(default Dh^-0.5). Rows outside every sequence (i >= cu_seqlens[-1]) are left unwritten
in the output and in dq/dk/dv (no memset spent on them): callers cover all T rows
(`Packed.from_lengths` does).
`return_lse=True` also returns lse (Hq, T) fp32, the natural-log log-sum-exp of the
scaled scores of each row (flash-attn layout), lse[h, i] = log sum_{j<=i} exp(scale q_i.k_j).

Triton path (FlashAttention-2 scheme, Dh a power of two in [16, 256], bf16/fp16/fp32):
  forward   grid (query block, Hq, B); row block M keeps running max m, sum l, acc:
            s = (q k^T) * scale * log2(e);  m' = max(m, rowmax s);  p = exp2(s - m')
            l = l * exp2(m - m') + rowsum p;  acc = acc * exp2(m - m') + p v
            o = acc / l,  lse = (m + log2 l) * ln 2.
            KV is read in blocks of KV_BLOCK keys, from key 0 upwards, in a fixed order;
            `paged_attention` walks its cache in the same KV_BLOCK-sized blocks, so a
            later batch-invariant mode can make prefill and decode agree bitwise (today
            they agree to rounding only: the dot tile shapes differ).
            Blocks left of the diagonal run without masks; diagonal blocks apply
            causal and length masks (mask-free and masked blocks give identical bits).
  backward  delta = rowsum(dO * O) (kernel 1); dK, dV (kernel 2, one program per
            KV block and kv head, looping over the query heads of its GQA group and the
            query blocks at or below the diagonal:  p = exp2(s - lse log2 e),
            dv += p^T dO,  ds = p (dO v^T - delta),  dk += ds^T q * scale);
            dQ (kernel 3, one program per query block and head: dq += ds k * scale).
            No atomics: the gradients are deterministic run to run.
fp32 inputs use IEEE fp32 dots (no TF32) so they can be checked tightly.

The reference loops over sequences with `scaled_dot_product_attention`; it reads
`cu_seqlens` on the host (allowed for a reference, never in a fast path).
Tests: `python -m pytest -q tests/test_kernel_attention.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rlfuse.kernels.backend import is_exact, resolve_backend
from rlfuse.kernels.invariant import pairwise_sum, pointwise

KV_BLOCK = 64  # keys per step in the forward and in paged_attention (see module docstring)
_LOG2E = 1.4426950408889634  # kernels spell log2(e) and ln(2) as literals (jit globals)


def varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen: int, scale: float | None = None,
                         *, return_lse: bool = False):
    n_rep = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # float64 for gold runs
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=lse_dtype, device=q.device) if return_lse else None
    bounds = cu_seqlens.tolist()  # host sync: reference only
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        qb = q[s:e].transpose(0, 1)  # (Hq, L, Dh)
        kb = k[s:e].transpose(0, 1).repeat_interleave(n_rep, dim=0)
        vb = v[s:e].transpose(0, 1).repeat_interleave(n_rep, dim=0)
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        out[s:e] = ob.transpose(0, 1)
        if return_lse:
            sc = (qb.to(lse_dtype) @ kb.to(lse_dtype).transpose(1, 2)) * scale  # (Hq, L, L)
            sc = sc.masked_fill(~torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).tril(), float("-inf"))
            lse[:, s:e] = torch.logsumexp(sc, dim=-1)
    return (out, lse) if return_lse else out


def attend_exact_ref(q, k, v, q_pos, scale: float):
    """Exact-numerics attention of query rows against one sequence's keys 0..L-1.
    q (R, Hq, Dh), k and v (L, Hkv, Dh), q_pos (R,) positions: row i sees keys <= q_pos[i].
    Softmax with batch-invariant pieces (`rlfuse.kernels.invariant`): masked scores give
    p = 0 exactly, and pairwise sums ignore trailing zeros, so a row's result does not
    depend on L, R, or the other rows -- the varlen and paged references agree bitwise.
    Returns o (R, Hq, Dh) in q.dtype and lse (Hq, R) fp32 (fp64 for fp64 inputs)."""
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_rep = q.shape[1] // k.shape[1]
    R, L, Dh = q.shape[0], k.shape[0], q.shape[2]
    out = torch.empty(q.shape, dtype=ct, device=q.device)
    lse = torch.empty((q.shape[1], R), dtype=ct, device=q.device)
    visible = torch.arange(L, device=q.device)[None, :] <= q_pos[:, None]  # (R, L)
    rows = max(1, (1 << 22) // max(1, L * Dh))  # products held at once: (rows, L, Dh)
    for h in range(q.shape[1]):
        kh, vh = k[:, h // n_rep].to(ct), v[:, h // n_rep].to(ct)  # (L, Dh)
        for i in range(0, R, rows):
            qh = q[i:i + rows, h].to(ct)
            s = pairwise_sum(qh[:, None, :] * kh[None, :, :], -1) * scale  # (r, L)
            s = s.masked_fill(~visible[i:i + rows], float("-inf"))
            m = s.max(-1, keepdim=True).values
            p = pointwise(torch.exp, s - m)
            l_ = pairwise_sum(p, -1)
            out[i:i + rows, h] = pairwise_sum(p[:, :, None] * vh[None, :, :], 1) / l_[:, None]
            lse[h, i:i + rows] = m[:, 0] + pointwise(torch.log, l_)
    return out.to(q.dtype), lse


def varlen_attention_exact_ref(q, k, v, cu_seqlens, max_seqlen: int, scale: float | None = None,
                               *, return_lse: bool = False):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float64 if q.dtype == torch.float64
                     else torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()  # host sync: reference only
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            out[s:e], lse[:, s:e] = attend_exact_ref(q[s:e], k[s:e], v[s:e],
                                                     torch.arange(e - s, device=q.device), scale)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- Triton kernels
@triton.jit
def tl_dot(a, b, PREC: tl.constexpr):  # shared with paged_attention; PREC from dot_precision(x)
    # PREC "interp": Triton's CPU interpreter multiplies bf16 tensors as raw uint16
    # (Triton 3.9), so on CPU the operands go up to fp32 first: same products, fp32 sums.
    if PREC == "interp":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def attend_tile(acc, l_i, m_i, q, k, v, cols, row_pos, hi, qk_scale, MASK: tl.constexpr, PREC: tl.constexpr):
    """One KV tile of the online softmax, shared by this forward and `paged_attention`, so
    that in exact numerics a query row sees the same arithmetic through either kernel.
    q (M, Dh), k and v (N, Dh) loaded; cols (N,) key positions, row_pos (M,) query
    positions; with MASK, key j is visible to row i iff cols[j] <= row_pos[i] and cols[j] < hi."""
    s = tl_dot(q, tl.trans(k), PREC) * qk_scale  # (M, N) fp32, log2 units
    if MASK:
        s = tl.where((cols[None, :] <= row_pos[:, None]) & (cols[None, :] < hi), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay at p = 0
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl_dot(p.to(v.dtype), v, PREC)
    return acc, l_i, m_new


@triton.jit
def _fwd_step(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, L, qk_scale,
              MASK: tl.constexpr, PREC: tl.constexpr):
    cols = start_n + offs_n
    if MASK:
        k = tl.load(k_ptrs, mask=cols[:, None] < L, other=0.0)
        v = tl.load(v_ptrs, mask=cols[:, None] < L, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return attend_tile(acc, l_i, m_i, q, k, v, cols, offs_m, L, qk_scale, MASK, PREC)


@triton.jit(do_not_specialize=['n_tok'])  # row counts vary per step: one compile
def _fwd_kernel(Q, K, V, O, LSE, CU, sqt, sqh, skt, skh, svt, svh, sot, soh, n_tok,
                n_rep, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, PREC: tl.constexpr, ALL_MASKED: tl.constexpr):
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
    q = tl.load(Q + (row0 + offs_m[:, None]) * sqt + hq * sqh + offs_d[None, :],
                mask=offs_m[:, None] < L, other=0.0)
    k_ptrs = K + (row0 + offs_n[:, None]) * skt + hk * skh + offs_d[None, :]
    v_ptrs = V + (row0 + offs_n[:, None]) * svt + hk * svh + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # keys < full_end are visible to every row: no mask needed (exact numerics masks every
    # tile, as paged_attention does, whose tiles split differently between masked and not)
    full_end = 0 if ALL_MASKED else (start_m // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_ptrs + start_n * skt, v_ptrs + start_n * svt,
                                  start_n, offs_m, offs_n, L, qk_scale, False, PREC)
    for start_n in range(full_end, tl.minimum(start_m + BLOCK_M, L), BLOCK_N):
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_ptrs + start_n * skt, v_ptrs + start_n * svt,
                                  start_n, offs_m, offs_n, L, qk_scale, True, PREC)
    o = acc / l_i[:, None]
    row_ok = offs_m < L
    tl.store(O + (row0 + offs_m[:, None]) * sot + hq * soh + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + hq * n_tok + row0 + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)


@triton.jit(do_not_specialize=['n_tok'])  # row counts vary per step: one compile
def _bwd_delta_kernel(O, DO, DELTA, sot, soh, sdt, sdh, n_tok,
                      HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < n_tok
    o = tl.load(O + rows[:, None].to(tl.int64) * sot + h * soh + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + rows[:, None].to(tl.int64) * sdt + h * sdh + offs_d[None, :], mask=ok[:, None], other=0.0)
    tl.store(DELTA + h * n_tok + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


@triton.jit
def _bwd_dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m, offs_m, offs_n, L,
                   sqt, sdt, qk_scale, MASK: tl.constexpr, PREC: tl.constexpr):
    rows = start_m + offs_m
    ok = rows < L
    q = tl.load(q_ptrs + start_m * sqt, mask=ok[:, None], other=0.0)
    do = tl.load(do_ptrs + start_m * sdt, mask=ok[:, None], other=0.0)
    # rows past the sequence get lse = +inf, hence p = 0: they contribute nothing
    lse = tl.load(lse_ptr + rows, mask=ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(delta_ptr + rows, mask=ok, other=0.0)
    pT = tl.exp2(tl_dot(k, tl.trans(q), PREC) * qk_scale - lse[None, :])  # (N, M)
    if MASK:
        pT = tl.where(rows[None, :] >= offs_n[:, None], pT, 0.0)
    dv += tl_dot(pT.to(do.dtype), do, PREC)
    dpT = tl_dot(v, tl.trans(do), PREC)
    dsT = pT * (dpT - delta[None, :])
    dk += tl_dot(dsT.to(q.dtype), q, PREC)
    return dk, dv


@triton.jit(do_not_specialize=['n_tok'])  # row counts vary per step: one compile
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU, sqt, sqh, skt, skh, svt, svh,
                     sdt, sdh, sdkt, sdkh, sdvt, sdvh, n_tok, n_rep, qk_scale, sm_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PREC: tl.constexpr):
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
        for start_m in range(diag_lo, tl.minimum(diag_hi, L), BLOCK_M):
            dk, dv = _bwd_dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m,
                                    offs_m, offs_n, L, sqt, sdt, qk_scale, True, PREC)
        for start_m in range(diag_hi, L, BLOCK_M):
            dk, dv = _bwd_dkdv_step(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m,
                                    offs_m, offs_n, L, sqt, sdt, qk_scale, False, PREC)
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
    p = tl.exp2(tl_dot(q, tl.trans(k), PREC) * qk_scale - lse[:, None])  # (M, N)
    if MASK:
        p = tl.where(cols[None, :] <= offs_m[:, None], p, 0.0)
    dp = tl_dot(do, tl.trans(v), PREC)
    ds = p * (dp - delta[:, None])
    dq += tl_dot(ds.to(k.dtype), k, PREC)
    return dq


@triton.jit(do_not_specialize=['n_tok'])  # row counts vary per step: one compile
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU, sqt, sqh, skt, skh, svt, svh, sdt, sdh,
                   sdqt, sdqh, n_tok, n_rep, qk_scale, sm_scale, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
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
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_end = (start_m // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        dq = _bwd_dq_step(dq, q, do, lse, delta, k_ptrs + start_n * skt, v_ptrs + start_n * svt,
                          start_n, offs_m, offs_n, L, qk_scale, False, PREC)
    for start_n in range(full_end, tl.minimum(start_m + BLOCK_M, L), BLOCK_N):
        dq = _bwd_dq_step(dq, q, do, lse, delta, k_ptrs + start_n * skt, v_ptrs + start_n * svt,
                          start_n, offs_m, offs_n, L, qk_scale, True, PREC)
    tl.store(DQ + (row0 + offs_m[:, None]) * sdqt + hq * sdqh + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=ok[:, None])


# ---------------------------------------------------------------- launchers
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


def supports_head_dim(head_dim: int) -> bool:
    """The head_dim rule of the Triton attention kernels (this varlen forward and
    `paged_attention`): a power of two in [16, 256]."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def _check(q, k, v, cu_seqlens):
    T, Hq, D = q.shape
    if k.shape != v.shape or k.shape[0] != T or k.shape[2] != D or Hq % k.shape[1]:
        raise ValueError(f"varlen_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "expected q (T, Hq, Dh), k and v (T, Hkv, Dh) with Hq % Hkv == 0")
    if not supports_head_dim(D):
        raise ValueError(f"varlen_attention: head_dim {D} must be a power of two in [16, 256]")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"varlen_attention: q, k, v must share one of fp16/bf16/fp32, "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(f"varlen_attention: cu_seqlens must be 1-D int32, "
                         f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")


def _lastdim_contig(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def dot_precision(x):
    if x.device.type != "cuda":
        return "interp"
    return "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def exact_config(itemsize: int) -> dict:
    """The one attention tile of exact numerics, for this forward and for every call of
    `paged_attention` (prefill and decode): BLOCK_M query rows x KV_BLOCK keys x Dh, every
    tile masked, no FMA contraction (so a mask's presence cannot change a row's rounding).
    64 rows: one warpgroup's matrix-instruction height on Hopper."""
    return dict(BLOCK_M=32 if itemsize == 4 else 64, num_warps=4, num_stages=2, enable_fp_fusion=False)


def varlen_fwd(q, k, v, cu_seqlens, max_seqlen: int, scale: float, *, config: dict | None = None,
               out: torch.Tensor | None = None, lse: torch.Tensor | None = None, exact: bool = False):
    """Launch the forward: returns o (T, Hq, Dh) and lse (Hq, T) fp32, written into
    `out` / `lse` when given. `config` overrides the tile settings (tests, tuning sweeps);
    `exact` runs the exact-numerics tile (`exact_config`)."""
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
    _fwd_kernel[grid](q, k, v, o, lse, cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                      v.stride(0), v.stride(1), o.stride(0), o.stride(1), T, Hq // k.shape[1],
                      scale * _LOG2E, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, PREC=dot_precision(q),
                      ALL_MASKED=exact, **cfg)
    return o, lse


def varlen_bwd(do, q, k, v, o, lse, cu_seqlens, max_seqlen: int, scale: float, *,
               config: dict | None = None, grads: tuple | None = None):
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
    _bwd_delta_kernel[(triton.cdiv(T, 64), Hq)](o, do, delta, o.stride(0), o.stride(1), do.stride(0),
                                                do.stride(1), T, HEAD_DIM=D, BLOCK=64)
    common = dict(HEAD_DIM=D, PREC=dot_precision(q))
    c = dict(cfgs["dkdv"])
    bm, bn = c.pop("BLOCK_M"), c.pop("BLOCK_N")
    _bwd_dkdv_kernel[(triton.cdiv(max_seqlen, bn), Hkv, B)](
        q, k, v, do, lse, delta, dk, dv, cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0),
        dv.stride(1), T, Hq // Hkv, scale * _LOG2E, scale, BLOCK_M=bm, BLOCK_N=bn, **common, **c)
    c = dict(cfgs["dq"])
    bm, bn = c.pop("BLOCK_M"), c.pop("BLOCK_N")
    _bwd_dq_kernel[(triton.cdiv(max_seqlen, bm), Hq, B)](
        q, k, v, do, lse, delta, dq, cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), do.stride(0), do.stride(1), dq.stride(0), dq.stride(1), T, Hq // Hkv,
        scale * _LOG2E, scale, BLOCK_M=bm, BLOCK_N=bn, **common, **c)
    return dq, dk, dv


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale, exact):
        q, k, v = _lastdim_contig(q), _lastdim_contig(k), _lastdim_contig(v)
        o, lse = varlen_fwd(q, k, v, cu_seqlens, max_seqlen, scale, exact=exact)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = varlen_bwd(do, q, k, v, o, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)
        return dq, dk, dv, None, None, None, None


def varlen_attention(q, k, v, cu_seqlens, max_seqlen: int, scale: float | None = None,
                     *, return_lse: bool = False):
    """Public op (contract in the module docstring); picks the backend and the numerics."""
    exact = is_exact()
    if resolve_backend("varlen_attention", q) == "triton":
        _check(q, k, v, cu_seqlens)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        o, lse = _VarlenAttention.apply(q, k, v, cu_seqlens, int(max_seqlen), scale, exact)
        return (o, lse) if return_lse else o
    ref = varlen_attention_exact_ref if exact else varlen_attention_ref
    return ref(q, k, v, cu_seqlens, max_seqlen, scale, return_lse=return_lse)

