"""The chunked gated delta rule's backward, in Triton (the forward and its math:
`rlfuse.kernels.gated_delta.chunk` / `triton_chunk`).

Per chunk (rows i, j; forward quantities recomputed from q, k, v, g, beta and the chunk's
start state S): P = lower(q k^T D), kd = k exp(gL - gc), eL = exp(gL), v_new = u - w S,
o = (q egc) S + P v_new, S' = eL S + kd^T v_new (S' counted only after a full chunk).
Given do and dS' (the gradient reaching the state after the chunk):
  dv_new = P^T do + kd dS'
  dS     = (q egc)^T do + eL dS' - w^T dv_new             (to the previous chunk)
  dP = do v_new^T, d(q egc) = do S^T, dkd = v_new dS'^T, deL = <dS', S>,
  du = dv_new, dw = -dv_new S^T, dT = du (beta v)^T + dw (beta egc k)^T,
  dA = -T^T dT T^T (strictly lower), then through A = beta_i (k_i.k_j) D_ij, P, the
  exponentials, gc = cumsum(g) (dg = reverse cumsum of dgc), beta, and the l2 norms
  (x -> x r: dx = r dy - r^3 x (x.dy)).
Three steps:
  1. the forward's two kernels again (`chunk_prep`, `state_pass_kernel` with STORE_H):
     each chunk's state-independent quantities and its start state H;
  2. `_state_bwd_kernel`, one program per (Dv block, sequence x head): walks the chunks
     backward carrying dS, storing each chunk's dS' (dH) and finally d initial_state (the
     state's Dv columns are independent, so are their gradients);
  3. each chunk's gradients, all chunks in parallel, two forms (`gated_delta_bwd(split=)`):
     - split over Dk (`triton_chunk_bwd_split`, the default for heads over 64 wide): three
       kernels whose live tiles are (C, C) or (C, <= 64), so their dots keep the forward's
       precision (tf32 for bf16 inputs) within an H100's shared memory at Dk = 128;
     - `_chunk_bwd_kernel`, one program per (chunk, value head): recomputes the chunk,
       loops over Dv blocks accumulating the Dv sums, writes dq, dk (per value head;
       summed over a q/k head's group after), dv, dg, dbeta. It keeps about ten (C, Dk)
       fp32 tiles live: at Dk = 128 only fp32 FMA dots fit (the default below 128).
No atomics: every output element is written by one program, the group sum by torch, so
gradients are deterministic run to run. Backward numerics do not need batch invariance.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.gated_delta.chunk import CHUNK, L2_EPS
from rlfuse.kernels.gated_delta.triton_chunk import chunk_common, chunk_prep, state_pass_kernel, tile_config
from rlfuse.kernels.gated_delta.triton_chunk_bwd_split import chunk_bwd_split
from rlfuse.kernels.triton_common import dot, dot_precision

# Wide heads (Dk > 64, Qwen3.5's 128) take the split form: its tensor-core dots fit sm_90's
# shared memory where the one-kernel form falls back to fp32 FMA (5.5x slower at T = 4096 on
# an H200; docs/benchmarks.md). The one-kernel form stays for narrow heads and as its check.
SPLIT_WIDE_HEADS = True


@triton.jit(do_not_specialize=["Hv"])
def _state_bwd_kernel(WB, QG, KD, PB, EL, CU, COFF, DO, DSF, DH, DS0, so_t, so_h, Hv,
                      DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      C: tl.constexpr, HAS_DSF: tl.constexpr, PREC: tl.constexpr):
    """The reverse walk, one program per (Dv block, sequence x head): for each chunk, last
    first, its dS' (stored in DH) and the gradient passed to its start state."""
    pid_v, pid_bh = tl.program_id(0), tl.program_id(1)
    b = pid_bh // Hv
    h = pid_bh % Hv
    start = tl.load(CU + b).to(tl.int64)
    n = tl.load(CU + b + 1).to(tl.int64) - start
    coff = tl.load(COFF + b).to(tl.int64)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mk = offs_k < DK
    mv = offs_v < DV
    mkv = mk[:, None] & mv[None, :]
    kv = offs_k[:, None] * DV + offs_v[None, :]
    s_off = (b * Hv + h).to(tl.int64) * DK * DV
    if HAS_DSF:
        dS = tl.load(DSF + s_off + kv, mask=mkv, other=0.0)
    else:
        dS = tl.zeros((BK, BV), dtype=tl.float32)
    nch = tl.cdiv(n, C)
    for cc in range(0, nch):
        c = nch - 1 - cc
        rows = c * C + offs_c
        rm = rows < n
        t = start + rows
        ci = coff + c
        rk = (t[:, None] * Hv + h) * DK + offs_k[None, :]
        m2 = rm[:, None] & mk[None, :]
        w = tl.load(WB + rk, mask=m2, other=0.0)
        qg = tl.load(QG + rk, mask=m2, other=0.0)
        kd = tl.load(KD + rk, mask=m2, other=0.0)
        P = tl.load(PB + (ci * Hv + h) * C * C + offs_c[:, None] * C + offs_c[None, :])
        eL = tl.load(EL + ci * Hv + h)
        full = (c + 1) * C <= n
        dSn = tl.where(full, dS, 0.0)  # the state after a partial chunk is not an output
        tl.store(DH + (ci * Hv + h) * DK * DV + kv, dSn, mask=mkv)
        do = tl.load(DO + t[:, None] * so_t + h * so_h + offs_v[None, :], mask=rm[:, None] & mv[None, :],
                     other=0.0).to(tl.float32)
        dv_new = dot(tl.trans(P), do, None, PREC) + dot(kd, dSn, None, PREC)
        dS_prev = dot(tl.trans(qg), do, None, PREC) - dot(tl.trans(w), dv_new, None, PREC)
        dS = tl.where(full, dS_prev + eL * dSn, dS_prev + dS)
    tl.store(DS0 + s_off + kv, dS, mask=mkv)


@triton.jit(do_not_specialize=["Hv", "n_rep", "NC"])
def _chunk_bwd_kernel(Q, K, V, G, BETA, CU, CSEQ, CIDX, H, DH, DO, DQ, DK_, DV_, DG, DB,
                      sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h, so_t, so_h,
                      Hv, n_rep, NC, scale, eps, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr):
    ci, h = tl.program_id(0), tl.program_id(1)
    b = tl.load(CSEQ + ci).to(tl.int64)
    if b < 0:  # past the last chunk (the grid is sized by an upper bound: no host sync)
        return
    c = tl.load(CIDX + ci).to(tl.int64)
    hk = h // n_rep
    start = tl.load(CU + b).to(tl.int64)
    n = tl.load(CU + b + 1).to(tl.int64) - start
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    mk = offs_k < DK
    rows = c * C + offs_c
    rm = rows < n
    t = start + rows
    qr, kr, rq, rk, q, k, beta, gc, decay, egc, kk, Tm, bek, w, qk, P, ekd, gL = chunk_common(
        Q, K, G, BETA, t, rm, hk, h, sq_t, sq_h, sk_t, sk_h, sg_t, sg_h, sb_t, sb_h, scale, eps,
        offs_c, offs_k, mk, C, PREC)
    kd = k * ekd[:, None]
    dT = tl.zeros((C, C), dtype=tl.float32)
    dP = tl.zeros((C, C), dtype=tl.float32)
    dqg = tl.zeros((C, BK), dtype=tl.float32)
    dkd = tl.zeros((C, BK), dtype=tl.float32)
    dw = tl.zeros((C, BK), dtype=tl.float32)
    dbeta = tl.zeros((C,), dtype=tl.float32)
    deL = tl.sum(tl.zeros((C,), dtype=tl.float32), 0)
    h_off = (ci * Hv + h).to(tl.int64) * DK * DV
    for v0 in range(0, DV, BV):
        offs_v = v0 + tl.arange(0, BV)
        mv = offs_v < DV
        mkv = mk[:, None] & mv[None, :]
        kv = offs_k[:, None] * DV + offs_v[None, :]
        S = tl.load(H + h_off + kv, mask=mkv, other=0.0)
        dSn = tl.load(DH + h_off + kv, mask=mkv, other=0.0)
        v = tl.load(V + t[:, None] * sv_t + h * sv_h + offs_v[None, :], mask=rm[:, None] & mv[None, :],
                    other=0.0).to(tl.float32)
        do = tl.load(DO + t[:, None] * so_t + h * so_h + offs_v[None, :], mask=rm[:, None] & mv[None, :],
                     other=0.0).to(tl.float32)
        bv = beta[:, None] * v
        v_new = dot(Tm, bv, None, PREC) - dot(w, S, None, PREC)
        dv_new = dot(tl.trans(P), do, None, PREC) + dot(kd, dSn, None, PREC)
        dP += dot(do, tl.trans(v_new), None, PREC)
        dqg += dot(do, tl.trans(S), None, PREC)
        dkd += dot(v_new, tl.trans(dSn), None, PREC)
        deL += tl.sum(tl.sum(dSn * S, 1), 0)
        dw -= dot(dv_new, tl.trans(S), None, PREC)
        dT += dot(dv_new, tl.trans(bv), None, PREC)
        dbv = dot(tl.trans(Tm), dv_new, None, PREC)
        dbeta += tl.sum(dbv * v, 1)
        tl.store(DV_ + t[:, None] * sv_t + h * sv_h + offs_v[None, :], (dbv * beta[:, None]),
                 mask=rm[:, None] & mv[None, :])
    lower = offs_c[:, None] >= offs_c[None, :]
    strict = offs_c[:, None] > offs_c[None, :]
    # w = T bek
    dT += dot(dw, tl.trans(bek), None, PREC)
    dbek = dot(tl.trans(Tm), dw, None, PREC)
    dk = dbek * (beta * egc)[:, None]
    dbeta += tl.sum(dbek * k, 1) * egc
    degc = beta * tl.sum(dbek * k, 1)
    # T = (I + A)^-1
    dA = tl.where(strict, -dot(dot(tl.trans(Tm), dT, None, PREC), tl.trans(Tm), None, PREC), 0.0)
    dbeta += tl.sum(dA * kk * decay, 1)
    dkk = dA * beta[:, None] * decay
    dD = dA * beta[:, None] * kk
    dk += dot(dkk + tl.trans(dkk), k, None, PREC)
    # P = lower(q k^T D)
    dP = tl.where(lower, dP, 0.0)
    dqk = dP * decay
    dD += dP * qk
    dq = dot(dqk, k, None, PREC)
    dk += dot(tl.trans(dqk), q, None, PREC)
    # (q egc), kd = k exp(gL - gc), eL = exp(gL)
    dq += dqg * egc[:, None]
    degc += tl.sum(dqg * q, 1)
    dk += dkd * ekd[:, None]
    dkd_g = tl.sum(dkd * kd, 1)
    dgL = tl.sum(dkd_g, 0) + deL * tl.exp(gL)
    dgc = degc * egc - dkd_g
    E = tl.where(lower, dD * decay, 0.0)
    dgc += tl.sum(E, 1) - tl.sum(E, 0)
    dgc += tl.where(offs_c == C - 1, dgL, 0.0)
    dg = tl.sum(dgc, 0) - tl.cumsum(dgc, 0) + dgc  # reverse cumsum
    # l2 norms: y = x r (q also scaled): dx = r dy - r^3 x (x . dy)
    dq = dq * scale
    dq = rq[:, None] * dq - (rq * rq * rq * tl.sum(qr * dq, 1))[:, None] * qr
    dk = rk[:, None] * dk - (rk * rk * rk * tl.sum(kr * dk, 1))[:, None] * kr
    m2 = rm[:, None] & mk[None, :]
    tl.store(DQ + (t[:, None] * Hv + h) * DK + offs_k[None, :], dq, mask=m2)
    tl.store(DK_ + (t[:, None] * Hv + h) * DK + offs_k[None, :], dk, mask=m2)
    tl.store(DG + t * Hv + h, dg, mask=rm)
    tl.store(DB + t * Hv + h, dbeta, mask=rm)


def gated_delta_bwd(q, k, v, g, beta, cu_seqlens, initial_state, scale: float, do, dsf, split: bool | None = None):
    """dq, dk, dv, dg, dbeta, d initial_state (None where no initial state was given); no
    host sync (the chunk grid is sized by the bound T // 64 + B). `split`: the per-chunk
    gradients by the Dk-split kernels (`triton_chunk_bwd_split`) or by the one-kernel
    `_chunk_bwd_kernel`; None: the split for wide heads (Dk > 64) when `SPLIT_WIDE_HEADS`, else
    one kernel (benchmarks/kernels/bench_gated_delta.py times both)."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    B = cu_seqlens.shape[0] - 1
    dev = v.device
    if B == 0 or T == 0:
        z = torch.zeros_like
        return (z(q), z(k), z(v), z(g), z(beta), None if initial_state is None
                else (dsf.float().clone() if dsf is not None else z(initial_state, dtype=torch.float32)))
    q, k, v, do = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, do))
    s0 = initial_state.float().contiguous() if initial_state is not None else None
    dsf = dsf.float().contiguous() if dsf is not None else None
    cfg = tile_config(Dk, Dv, exact=False)
    BK, BV = cfg.pop("BK"), cfg.pop("BV")
    prec = dot_precision(v)  # the forward's
    # The one-kernel form keeps about ten (C, BK) fp32 tiles live. At BK 128 its tensor-core
    # (tf32) dots need 262-320 KB of shared memory for any BV / warp count, over the H100's
    # 227 KB, so there it runs fp32 FMA dots ("ieee") with BV 16 (220 KB). The split kernels
    # keep (C, C) and (C, <= 64) tiles only and run the forward's precision at any width
    # (tests/kernel_audit.py compiles both for sm_90).
    wide = BK >= 128
    split = (wide and SPLIT_WIDE_HEADS) if split is None else split
    # 1. the forward's state-independent pass, then its state pass storing each chunk's start state
    prep = chunk_prep(q, k, v, g, beta, cu_seqlens, scale, BK, BV, cfg, store_t=split)
    coff, cseq, cidx, NC = prep["coff"], prep["cseq"], prep["cidx"], prep["NC"]
    wb, ub, qg, kd, pb, el = prep["buffers"]
    Hbuf = torch.empty(NC, Hv, Dk, Dv, dtype=torch.float32, device=dev)
    dH = torch.empty_like(Hbuf)
    ds0 = torch.empty(B, Hv, Dk, Dv, dtype=torch.float32, device=dev)
    state_pass_kernel[(triton.cdiv(Dv, BV), B * Hv)](
        *prep["buffers"], cu_seqlens, coff, s0 if s0 is not None else ds0, do, ds0, Hbuf, cu_seqlens, cu_seqlens,
        do.stride(0), do.stride(1), Hv, DK=Dk, DV=Dv, BK=BK, BV=BV, C=CHUNK, HAS_S0=s0 is not None, STORE_SF=False,
        STORE_O=False, STORE_H=True, PREC=prec, **cfg)
    # 2. the reverse walk: each chunk's dS' and d initial_state
    _state_bwd_kernel[(triton.cdiv(Dv, BV), B * Hv)](
        wb, qg, kd, pb, el, cu_seqlens, coff, do, dsf if dsf is not None else ds0, dH, ds0, do.stride(0),
        do.stride(1), Hv, DK=Dk, DV=Dv, BK=BK, BV=BV, C=CHUNK, HAS_DSF=dsf is not None, PREC=prec, **cfg)
    del wb, ub, qg, kd, pb, el
    # 3. each chunk's gradients, all chunks in parallel
    if split:
        dq, dk, dv, dg, db = chunk_bwd_split(q, k, v, g, beta, cu_seqlens, scale, do, prep, Hbuf, dH, prec)
    else:
        del prep
        dq, dk, dv, dg, db = _chunk_bwd_fused(q, k, v, g, beta, cu_seqlens, cseq, cidx, NC, scale, do, Hbuf, dH,
                                              prec)
    rep = Hv // Hk
    dq = dq.view(T, Hk, rep, Dk).sum(2)  # a q/k head's gradient: the sum over its value heads, in order
    dk = dk.view(T, Hk, rep, Dk).sum(2)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype),
            ds0 if initial_state is not None else None)


def _chunk_bwd_fused(q, k, v, g, beta, cu_seqlens, cseq, cidx, NC, scale, do, Hbuf, dH, prec):
    """`_chunk_bwd_kernel`'s launch: dq, dk (T, Hv, Dk) per value head, dv, dg, dbeta fp32."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    dev = v.device
    BK, BV = max(16, triton.next_power_of_2(Dk)), min(32, max(16, triton.next_power_of_2(Dv)))
    dq = torch.empty(T, Hv, Dk, dtype=torch.float32, device=dev)
    dk = torch.empty_like(dq)
    dv = torch.empty(T, Hv, Dv, dtype=torch.float32, device=dev)
    dg = torch.empty(T, Hv, dtype=torch.float32, device=dev)
    db = torch.empty_like(dg)
    # the kernel writes dv with v's strides and reads do with its own: give it both contiguous
    vc, doc = v.contiguous(), do.contiguous()
    wide = BK >= 128  # fp32 FMA dots with BV 16 to fit shared memory (see gated_delta_bwd)
    _chunk_bwd_kernel[(NC, Hv)](
        q, k, vc, g, beta, cu_seqlens, cseq, cidx, Hbuf, dH, doc, dq, dk, dv, dg, db,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vc.stride(0), vc.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), doc.stride(0), doc.stride(1),
        Hv, Hv // Hk, NC, scale, L2_EPS, DK=Dk, DV=Dv, BK=BK, BV=16 if wide else BV, C=CHUNK,
        PREC="ieee" if wide and prec == "tf32" else prec, num_warps=8, num_stages=1)
    return dq, dk, dv, dg, db
