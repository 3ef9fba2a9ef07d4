"""The chunked gated delta rule's per-chunk gradients split over Dk, in Triton: step 2 of
`triton_chunk_bwd.gated_delta_bwd` for wide heads (its docstring has the math). Why: the
one-kernel form (`_chunk_bwd_kernel`) keeps about ten (C, Dk) fp32 tiles live; at Dk = 128
its tensor-core dots need 262-320 KB of shared memory, over an H100's 227 KB. Here every
live tile is (C, C) or (C, <= 64), so the dots keep the forward's precision (tf32 for
bf16 inputs) at Qwen3.5's 128-wide heads (tests/kernel_audit.py compiles them for sm_90).

Inputs: the prep buffers (w, u, kd = k exp(gL - gc), P and T per chunk), each chunk's
start state H and the gradient dH reaching the state after it (`_state_bwd_kernel`).
  1. `_chunk_bwd_vside_kernel`, one program per (chunk, value head), Dv blocks in turn,
     each reducing over Dk in blocks: v_new = u - w S and dv_new = P^T do + kd dS' (stored,
     fp32, for kernel 2), dv = beta T^T dv_new, and the sums over Dv: dP = do v_new^T,
     dT_v = dv_new (beta v)^T, dbeta_v = rowsum((T^T dv_new) v), deL = <dS', S>.
  2. `_chunk_bwd_kside_kernel`, one program per (chunk, value head, Dk block), Dv blocks
     in turn: d(q egc) = do S^T, dkd = v_new dS'^T, dw = -dv_new S^T (fp32, for kernel 3).
  3. `_chunk_bwd_finish_kernel`, one program per (chunk, value head), two passes over Dk
     blocks. Pass 1 sums the raw products (q, k before their l2 norms) k k^T, q k^T, dw k^T
     and the row sums q.d(q egc), k.dkd, q.q, k.k: enough for dT = dT_v + dw (beta egc k)^T,
     dA, the (C, C) terms, dg and dbeta; and, each row dot product written through those
     (C, C) products, for the l2 norm's x.dy of dq and dk (x.dy = sum_j dqk_ij (x_i.k_j)
     + ...), so pass 2 computes each Dk block of dq and dk and applies the norm at once.
Every output element is written by one program and every sum runs in a fixed order (no
atomics): the gradients are the same bits run to run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.gated_delta.chunk import CHUNK, L2_EPS
from rlfuse.kernels.triton_common import dot


def split_tiles(Dk: int, Dv: int) -> tuple[int, int]:
    """(BK, BV): the Dk and Dv block widths, from the head sizes only. 64 x 32 keeps every
    kernel's live tiles at (C, C) and (C, <= 64) (tests/test_kernel_resources.py); 16 is
    the smallest `tl.dot` side on the GPU (smaller heads are masked up)."""
    return min(64, max(16, triton.next_power_of_2(Dk))), min(32, max(16, triton.next_power_of_2(Dv)))


@triton.jit
def _chunk_rows(CU, CSEQ, CIDX, ci, C: tl.constexpr):
    """Chunk slot ci: its sequence b (-1 past the last chunk), the rows' token indices t
    and which are inside the sequence (rm)."""
    b = tl.load(CSEQ + ci).to(tl.int64)
    c = tl.load(CIDX + ci).to(tl.int64)
    start = tl.load(CU + tl.maximum(b, 0)).to(tl.int64)
    n = tl.load(CU + tl.maximum(b, 0) + 1).to(tl.int64) - start
    rows = c * C + tl.arange(0, C)
    return b, start + rows, rows < n


@triton.jit(do_not_specialize=["Hv"])
def _chunk_bwd_vside_kernel(V, BETA, CU, CSEQ, CIDX, WB, UB, KD, PB, TB, H, DH, DO, VN, DVN, DV_, DPB, DTB,
                            DBV, DEL, sv_t, sv_h, sb_t, sb_h, so_t, so_h, Hv, DK: tl.constexpr,
                            DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                            PREC: tl.constexpr):
    ci, h = tl.program_id(0), tl.program_id(1)
    b, t, rm = _chunk_rows(CU, CSEQ, CIDX, ci, C)
    if b < 0:  # past the last chunk (the grid is sized by an upper bound: no host sync)
        return
    offs_c = tl.arange(0, C)
    cc = (ci * Hv + h).to(tl.int64) * C * C + offs_c[:, None] * C + offs_c[None, :]
    P = tl.load(PB + cc)
    Tm = tl.load(TB + cc)
    beta = tl.load(BETA + t * sb_t + h * sb_h, mask=rm, other=0.0).to(tl.float32)
    h_off = (ci * Hv + h).to(tl.int64) * DK * DV
    dP = tl.zeros((C, C), dtype=tl.float32)
    dT = tl.zeros((C, C), dtype=tl.float32)
    dbeta = tl.zeros((C,), dtype=tl.float32)
    deL = tl.sum(tl.zeros((C,), dtype=tl.float32), 0)
    for v0 in range(0, DV, BV):
        offs_v = v0 + tl.arange(0, BV)
        mv = offs_v < DV
        mrv = rm[:, None] & mv[None, :]
        tv = (t[:, None] * Hv + h) * DV + offs_v[None, :]  # the (T, Hv, Dv) fp32 buffers
        do = tl.load(DO + t[:, None] * so_t + h * so_h + offs_v[None, :], mask=mrv, other=0.0).to(tl.float32)
        v_new = tl.load(UB + tv, mask=mrv, other=0.0)
        dv_new = dot(tl.trans(P), do, None, PREC)
        for k0 in range(0, DK, BK):  # the Dk reductions, BK columns of w, kd and rows of S, dS' at a time
            offs_k = k0 + tl.arange(0, BK)
            mk = offs_k < DK
            tk = (t[:, None] * Hv + h) * DK + offs_k[None, :]
            m2 = rm[:, None] & mk[None, :]
            kv = h_off + offs_k[:, None] * DV + offs_v[None, :]
            S = tl.load(H + kv, mask=mk[:, None] & mv[None, :], other=0.0)
            dSn = tl.load(DH + kv, mask=mk[:, None] & mv[None, :], other=0.0)
            v_new -= dot(tl.load(WB + tk, mask=m2, other=0.0), S, None, PREC)
            dv_new = dot(tl.load(KD + tk, mask=m2, other=0.0), dSn, dv_new, PREC)
            deL += tl.sum(tl.sum(dSn * S, 1), 0)
        tl.store(VN + tv, v_new, mask=mrv)
        tl.store(DVN + tv, dv_new, mask=mrv)
        v = tl.load(V + t[:, None] * sv_t + h * sv_h + offs_v[None, :], mask=mrv, other=0.0).to(tl.float32)
        dP = dot(do, tl.trans(v_new), dP, PREC)
        dT = dot(dv_new, tl.trans(beta[:, None] * v), dT, PREC)
        dbv = dot(tl.trans(Tm), dv_new, None, PREC)  # u = T (beta v)
        dbeta += tl.sum(dbv * v, 1)
        tl.store(DV_ + tv, dbv * beta[:, None], mask=mrv)
    tl.store(DPB + cc, dP)
    tl.store(DTB + cc, dT)
    tl.store(DBV + t * Hv + h, dbeta, mask=rm)
    tl.store(DEL + ci * Hv + h, deL)


@triton.jit(do_not_specialize=["Hv"])
def _chunk_bwd_kside_kernel(CU, CSEQ, CIDX, H, DH, DO, VN, DVN, DQG, DKD, DW, so_t, so_h, Hv,
                            DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            C: tl.constexpr, PREC: tl.constexpr):
    ci, h, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, t, rm = _chunk_rows(CU, CSEQ, CIDX, ci, C)
    if b < 0:
        return
    offs_k = pid_k * BK + tl.arange(0, BK)
    mk = offs_k < DK
    h_off = (ci * Hv + h).to(tl.int64) * DK * DV
    dqg = tl.zeros((C, BK), dtype=tl.float32)
    dkd = tl.zeros((C, BK), dtype=tl.float32)
    dw_neg = tl.zeros((C, BK), dtype=tl.float32)
    for v0 in range(0, DV, BV):
        offs_v = v0 + tl.arange(0, BV)
        mv = offs_v < DV
        mrv = rm[:, None] & mv[None, :]
        tv = (t[:, None] * Hv + h) * DV + offs_v[None, :]
        kv = h_off + offs_k[:, None] * DV + offs_v[None, :]
        S = tl.load(H + kv, mask=mk[:, None] & mv[None, :], other=0.0)
        dSn = tl.load(DH + kv, mask=mk[:, None] & mv[None, :], other=0.0)
        do = tl.load(DO + t[:, None] * so_t + h * so_h + offs_v[None, :], mask=mrv, other=0.0).to(tl.float32)
        dqg = dot(do, tl.trans(S), dqg, PREC)
        dkd = dot(tl.load(VN + tv, mask=mrv, other=0.0), tl.trans(dSn), dkd, PREC)
        dw_neg = dot(tl.load(DVN + tv, mask=mrv, other=0.0), tl.trans(S), dw_neg, PREC)
    tk = (t[:, None] * Hv + h) * DK + offs_k[None, :]
    m2 = rm[:, None] & mk[None, :]
    tl.store(DQG + tk, dqg, mask=m2)
    tl.store(DKD + tk, dkd, mask=m2)
    tl.store(DW + tk, -dw_neg, mask=m2)


@triton.jit(do_not_specialize=["Hv", "n_rep"])
def _chunk_bwd_finish_kernel(Q, K, G, BETA, CU, CSEQ, CIDX, TB, DPB, DTB, DBV, DEL, DQG, DKD, DW, DQ, DK_, DG, DB,
                             sq_t, sq_h, sk_t, sk_h, sg_t, sg_h, sb_t, sb_h, Hv, n_rep, scale, eps,
                             DK: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr):
    ci, h = tl.program_id(0), tl.program_id(1)
    b, t, rm = _chunk_rows(CU, CSEQ, CIDX, ci, C)
    if b < 0:
        return
    hk = h // n_rep
    offs_c = tl.arange(0, C)
    lower = offs_c[:, None] >= offs_c[None, :]
    strict = offs_c[:, None] > offs_c[None, :]
    cc = (ci * Hv + h).to(tl.int64) * C * C + offs_c[:, None] * C + offs_c[None, :]
    g = tl.load(G + t * sg_t + h * sg_h, mask=rm, other=0.0).to(tl.float32)
    beta = tl.load(BETA + t * sb_t + h * sb_h, mask=rm, other=0.0).to(tl.float32)
    gc = tl.cumsum(g, 0)
    decay = tl.where(lower, tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0)), 0.0)
    egc = tl.exp(gc)
    gL = tl.sum(tl.where(offs_c == C - 1, gc, 0.0), 0)
    ekd = tl.exp(gL - gc)
    bes = beta * egc  # bek = (beta egc) k, w = T bek
    Tm = tl.load(TB + cc)
    # pass 1: raw products and row sums (qr, kr: q and k before the l2 norms)
    kkr = tl.zeros((C, C), dtype=tl.float32)
    qkr = tl.zeros((C, C), dtype=tl.float32)
    dwk = tl.zeros((C, C), dtype=tl.float32)      # dw kr^T
    ssq = tl.zeros((C,), dtype=tl.float32)
    ssk = tl.zeros((C,), dtype=tl.float32)
    sqg = tl.zeros((C,), dtype=tl.float32)        # qr . d(q egc)
    skd = tl.zeros((C,), dtype=tl.float32)        # kr . dkd
    for k0 in range(0, DK, BK):
        offs_k = k0 + tl.arange(0, BK)
        m2 = rm[:, None] & (offs_k < DK)[None, :]
        tk = (t[:, None] * Hv + h) * DK + offs_k[None, :]
        qr = tl.load(Q + t[:, None] * sq_t + hk * sq_h + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
        kr = tl.load(K + t[:, None] * sk_t + hk * sk_h + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
        ssq += tl.sum(qr * qr, 1)
        ssk += tl.sum(kr * kr, 1)
        kkr = dot(kr, tl.trans(kr), kkr, PREC)
        qkr = dot(qr, tl.trans(kr), qkr, PREC)
        dwk = dot(tl.load(DW + tk, mask=m2, other=0.0), tl.trans(kr), dwk, PREC)
        sqg += tl.sum(tl.load(DQG + tk, mask=m2, other=0.0) * qr, 1)
        skd += tl.sum(tl.load(DKD + tk, mask=m2, other=0.0) * kr, 1)
    rq = 1.0 / tl.sqrt(ssq + eps)
    rk = 1.0 / tl.sqrt(ssk + eps)
    qs = rq * scale  # q = qr qs, k = kr rk
    kk = kkr * rk[:, None] * rk[None, :]
    qk = qkr * qs[:, None] * rk[None, :]
    # w = T bek: dT += dw bek^T; kr_i . (T^T dw)_i = sum_j T_ji (dw kr^T)_ji
    dT = tl.load(DTB + cc) + dwk * (bes * rk)[None, :]
    sbk = tl.sum(Tm * dwk, 0)                     # kr . d(bek)
    dbeta = tl.load(DBV + t * Hv + h, mask=rm, other=0.0) + sbk * rk * egc
    degc = beta * sbk * rk + sqg * qs
    # T = (I + A)^-1, A = strict(beta_i (k_i . k_j) D_ij)
    dA = tl.where(strict, -dot(dot(tl.trans(Tm), dT, None, PREC), tl.trans(Tm), None, PREC), 0.0)
    dbeta += tl.sum(dA * kk * decay, 1)
    dkk = dA * beta[:, None] * decay
    dD = dA * beta[:, None] * kk
    # P = lower(q k^T D)
    dP = tl.where(lower, tl.load(DPB + cc), 0.0)
    dqk = dP * decay
    dD += dP * qk
    # kd = k exp(gL - gc), eL = exp(gL), q egc, D = exp(gc_i - gc_j), gc = cumsum(g)
    dkd_g = skd * rk * ekd
    dgL = tl.sum(dkd_g, 0) + tl.load(DEL + ci * Hv + h) * tl.exp(gL)
    dgc = degc * egc - dkd_g
    E = tl.where(lower, dD * decay, 0.0)
    dgc += tl.sum(E, 1) - tl.sum(E, 0)
    dgc += tl.where(offs_c == C - 1, dgL, 0.0)
    tl.store(DG + t * Hv + h, tl.sum(dgc, 0) - tl.cumsum(dgc, 0) + dgc, mask=rm)  # reverse cumsum
    tl.store(DB + t * Hv + h, dbeta, mask=rm)
    # the l2 norms, y = x r: dx = r dy - r^3 x (x . dy), x . dy through the (C, C) products:
    # dq = scale (dqk k + d(q egc) egc); dk = T^T dw bes + dK2 k + dqk^T q + dkd ekd
    dK2 = dkk + tl.trans(dkk)
    xq = scale * (tl.sum(dqk * qkr * rk[None, :], 1) + egc * sqg)
    xk = bes * sbk + tl.sum(dK2 * kkr * rk[None, :], 1) + tl.sum(dqk * qkr * qs[:, None], 0) + ekd * skd
    cq = rq * rq * rq * xq
    ck = rk * rk * rk * xk
    # pass 2: each Dk block of dq and dk, normalized
    for k0 in range(0, DK, BK):
        offs_k = k0 + tl.arange(0, BK)
        m2 = rm[:, None] & (offs_k < DK)[None, :]
        tk = (t[:, None] * Hv + h) * DK + offs_k[None, :]
        qr = tl.load(Q + t[:, None] * sq_t + hk * sq_h + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
        kr = tl.load(K + t[:, None] * sk_t + hk * sk_h + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
        k = kr * rk[:, None]
        dq = dot(dqk, k, None, PREC) + tl.load(DQG + tk, mask=m2, other=0.0) * egc[:, None]
        dq = dq * scale
        dk = dot(tl.trans(Tm), tl.load(DW + tk, mask=m2, other=0.0), None, PREC) * bes[:, None]
        dk = dot(dK2, k, dk, PREC)
        dk = dot(tl.trans(dqk), qr * qs[:, None], dk, PREC)
        dk += tl.load(DKD + tk, mask=m2, other=0.0) * ekd[:, None]
        tl.store(DQ + tk, rq[:, None] * dq - cq[:, None] * qr, mask=m2)
        tl.store(DK_ + tk, rk[:, None] * dk - ck[:, None] * kr, mask=m2)


def chunk_bwd_split(q, k, v, g, beta, cu_seqlens, scale: float, do, prep: dict, Hbuf, dH, prec: str):
    """The per-chunk gradients from the prep buffers (`chunk_prep(..., store_t=True)`, taken
    out of `prep` and freed as soon as kernel 1 is done), the start states Hbuf and dH:
    dq, dk (T, Hv, Dk) per value head, dv (T, Hv, Dv), dg, dbeta (T, Hv), all fp32."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    dev = v.device
    BK, BV = split_tiles(Dk, Dv)
    cseq, cidx, NC = prep["cseq"], prep["cidx"], prep["NC"]
    wb, ub, _, kd, pb, _ = prep.pop("buffers")
    tb = prep.pop("T")
    f32 = dict(dtype=torch.float32, device=dev)
    vn, dvn, dv = (torch.empty(T, Hv, Dv, **f32) for _ in range(3))
    dpb, dtb = torch.empty(NC, Hv, CHUNK, CHUNK, **f32), torch.empty(NC, Hv, CHUNK, CHUNK, **f32)
    dbv, dg, db = (torch.empty(T, Hv, **f32) for _ in range(3))
    dEL = torch.empty(NC, Hv, **f32)
    # num_stages 1: no pipelined copies of the fp32 tiles. 8 warps: with 4, ptxas (sm_90, CUDA 13.4)
    # spills 0.7-6 KB a thread in the three kernels at Dk = Dv = 128; with 8, 0-2.7 KB
    cfg = dict(num_warps=8, num_stages=1)
    _chunk_bwd_vside_kernel[(NC, Hv)](
        v, beta, cu_seqlens, cseq, cidx, wb, ub, kd, pb, tb, Hbuf, dH, do, vn, dvn, dv, dpb, dtb, dbv, dEL,
        v.stride(0), v.stride(1), beta.stride(0), beta.stride(1), do.stride(0), do.stride(1), Hv,
        DK=Dk, DV=Dv, BK=BK, BV=BV, C=CHUNK, PREC=prec, **cfg)
    del wb, ub, kd, pb
    dqg, dkd, dw = (torch.empty(T, Hv, Dk, **f32) for _ in range(3))
    _chunk_bwd_kside_kernel[(NC, Hv, triton.cdiv(Dk, BK))](
        cu_seqlens, cseq, cidx, Hbuf, dH, do, vn, dvn, dqg, dkd, dw, do.stride(0), do.stride(1), Hv,
        DK=Dk, DV=Dv, BK=BK, BV=BV, C=CHUNK, PREC=prec, **cfg)
    del vn, dvn
    dq, dk = torch.empty(T, Hv, Dk, **f32), torch.empty(T, Hv, Dk, **f32)
    _chunk_bwd_finish_kernel[(NC, Hv)](
        q, k, g, beta, cu_seqlens, cseq, cidx, tb, dpb, dtb, dbv, dEL, dqg, dkd, dw, dq, dk, dg, db,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), g.stride(1), beta.stride(0),
        beta.stride(1), Hv, Hv // Hk, scale, L2_EPS, DK=Dk, BK=BK, C=CHUNK, PREC=prec, **cfg)
    return dq, dk, dv, dg, db
