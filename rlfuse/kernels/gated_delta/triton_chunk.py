"""The chunked gated delta rule, the Triton half: the forward kernel, its launcher and the
autograd Function (contract, math and the exactness argument: `rlfuse.kernels.gated_delta.chunk`).

Forward: one program per (Dv block, sequence x value head) walks its sequence's chunks in
order, the state block S (Dk, BV) fp32 in registers. Per chunk (64 rows, every chunk
masked the same way, rows past the end loaded as zeros): l2-normalize q and k rows, the
in-chunk cumsum of g, A, T = (I + A)^-1 by forward substitution (row i from rows < i), u,
w, v_new, o, and the state update kept only when the chunk is full. The Dv columns of the
state are independent in the delta rule, so splitting Dv across programs changes nothing
in a column's arithmetic. Tile shapes (BK, BV) depend on (Dk, Dv) only; exact numerics
turns FMA contraction off, so a row's rounding cannot depend on how the compiler fuses.

Backward: `triton_chunk_bwd` (its docstring has the math): a state pass per (sequence,
head, Dv block) and per-chunk gradient kernels (split over Dk at wide heads:
`triton_chunk_bwd_split`), deterministic (no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.backend import triton_ops
from rlfuse.kernels.gated_delta.chunk import CHUNK, L2_EPS
from rlfuse.kernels.triton_common import dot, dot_precision, round_to


@triton.jit
def _unit_lower_inverse(A, offs_c, C: tl.constexpr, BLK: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for A (C, C) strictly lower, every step lower-triangular (row i of each
    product reads rows <= i only; the other terms are exact zeros):
      1. the diagonal BLK x BLK blocks by forward substitution, all blocks at once: for
         i = 1 .. BLK-1 the rows at in-block position i get T_r = e_r - sum_j Ad_rj T_j
         (Ad: A's diagonal blocks); Td = (I + Ad)^-1;
      2. with Al = A - Ad (strictly block-lower), I + A = (I + Ad)(I + M), M = Td Al,
         M^(C/BLK) = 0, so for C/BLK = 4: T = (I + M)^-1 Td = (I - M)(I + M^2) Td."""
    eye = tl.where(offs_c[:, None] == offs_c[None, :], 1.0, 0.0)
    same = (offs_c[:, None] // BLK) == (offs_c[None, :] // BLK)
    Ad = tl.where(same, A, 0.0)
    Td = eye
    for i in range(1, BLK):
        sel = (offs_c % BLK) == i
        Td = tl.where(sel[:, None], eye - dot(tl.where(sel[:, None], Ad, 0.0), Td, None, PREC), Td)
    M = dot(Td, tl.where(same, 0.0, A), None, PREC)
    X = Td + dot(dot(M, M, None, PREC), Td, None, PREC)
    return X - dot(M, X, None, PREC)


@triton.jit
def chunk_common(Q, K, G, BETA, t, rm, hk, h, sq_t, sq_h, sk_t, sk_h, sg_t, sg_h, sb_t, sb_h, scale, eps,
                 offs_c, offs_k, mk, C: tl.constexpr, PREC: tl.constexpr):
    """Load one chunk (rows t, valid where rm) and compute its Dv-independent quantities
    (steps 1, 2 and 4 of the math): raw q, k and their inverse norms (the backward's l2
    step), normalized q (scaled) and k, beta, gc, D, exp(gc), k k^T, T, beta exp(gc) k,
    w, q k^T, P = lower(q k^T D), exp(gL - gc), gL. The forward and both backward kernels
    call this one function, so the backward recomputes the forward's bits."""
    qr = tl.load(Q + t[:, None] * sq_t + hk * sq_h + offs_k[None, :], mask=rm[:, None] & mk[None, :],
                 other=0.0).to(tl.float32)
    kr = tl.load(K + t[:, None] * sk_t + hk * sk_h + offs_k[None, :], mask=rm[:, None] & mk[None, :],
                 other=0.0).to(tl.float32)
    g = tl.load(G + t * sg_t + h * sg_h, mask=rm, other=0.0).to(tl.float32)
    beta = tl.load(BETA + t * sb_t + h * sb_h, mask=rm, other=0.0).to(tl.float32)
    rq = 1.0 / tl.sqrt(tl.sum(qr * qr, 1) + eps)
    rk = 1.0 / tl.sqrt(tl.sum(kr * kr, 1) + eps)
    q = qr * rq[:, None] * scale
    k = kr * rk[:, None]
    lower = offs_c[:, None] >= offs_c[None, :]
    strict = offs_c[:, None] > offs_c[None, :]
    gc = tl.cumsum(g, 0)
    decay = tl.where(lower, tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0)), 0.0)
    egc = tl.exp(gc)
    kk = dot(k, tl.trans(k), None, PREC)
    A = tl.where(strict, beta[:, None] * kk * decay, 0.0)
    Tm = _unit_lower_inverse(A, offs_c, C, 16, PREC)
    bek = (beta * egc)[:, None] * k
    w = dot(Tm, bek, None, PREC)
    qk = dot(q, tl.trans(k), None, PREC)
    P = tl.where(lower, qk * decay, 0.0)
    gL = tl.sum(tl.where(offs_c == C - 1, gc, 0.0), 0)
    ekd = tl.exp(gL - gc)
    return qr, kr, rq, rk, q, k, beta, gc, decay, egc, kk, Tm, bek, w, qk, P, ekd, gL


@triton.jit(do_not_specialize=["Hv", "n_rep"])
def _chunk_prep_kernel(Q, K, V, G, BETA, CU, CSEQ, CIDX, WB, UB, QG, KD, PB, EL, TB, SLOT, SLEN,
                       sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h,
                       Hv, n_rep, scale, eps, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr, HAS_SLOT: tl.constexpr = False,
                       STORE_T: tl.constexpr = False):
    """Everything of a chunk that does not depend on its start state, one program per
    (chunk, value head), all chunks at once: w, u = T (beta v), q exp(gc), k exp(gL - gc)
    (rows of the chunk, fp32), P (C, C) and exp(gL); with STORE_T (the split backward)
    also T (C, C). HAS_SLOT (the engine's exact decode
    step, one C-row segment per sequence): the inputs are per-slot tails (N, C, ...), the
    segment's rows are read from slot SLOT[b], its first SLEN[b] rows (the others load as
    the zeros a shorter sequence is padded with); the outputs stay at the segment's rows."""
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
    if HAS_SLOT:  # where the inputs are read: the slot's tail rows
        src = tl.load(SLOT + b).to(tl.int64) * C + rows
        rm_src = rows < tl.load(SLEN + b).to(tl.int64)
    else:
        src = t
        rm_src = rm
    _, _, _, _, q, k, beta, gc, decay, egc, kk, Tm, bek, w, qk, P, ekd, gL = chunk_common(
        Q, K, G, BETA, src, rm_src, hk, h, sq_t, sq_h, sk_t, sk_h, sg_t, sg_h, sb_t, sb_h, scale, eps,
        offs_c, offs_k, mk, C, PREC)
    rk = (t[:, None] * Hv + h) * DK + offs_k[None, :]
    m2 = rm[:, None] & mk[None, :]
    tl.store(WB + rk, w, mask=m2)
    tl.store(QG + rk, q * egc[:, None], mask=m2)
    tl.store(KD + rk, k * ekd[:, None], mask=m2)
    tl.store(PB + (ci * Hv + h).to(tl.int64) * C * C + offs_c[:, None] * C + offs_c[None, :], P)
    tl.store(EL + ci * Hv + h, tl.exp(gL))
    if STORE_T:
        tl.store(TB + (ci * Hv + h).to(tl.int64) * C * C + offs_c[:, None] * C + offs_c[None, :], Tm)
    for v0 in range(0, DV, BV):
        offs_v = v0 + tl.arange(0, BV)
        mv = offs_v < DV
        v = tl.load(V + src[:, None] * sv_t + h * sv_h + offs_v[None, :], mask=rm_src[:, None] & mv[None, :],
                    other=0.0).to(tl.float32)
        u = dot(Tm, beta[:, None] * v, None, PREC)                     # 2. u = T (beta v)
        tl.store(UB + (t[:, None] * Hv + h) * DV + offs_v[None, :], u, mask=rm[:, None] & mv[None, :])


@triton.jit(do_not_specialize=["Hv"])
def state_pass_kernel(WB, UB, QG, KD, PB, EL, CU, COFF, S0, O, SF, H, SLOT, SLEN, so_t, so_h, Hv,
                      DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      C: tl.constexpr, HAS_S0: tl.constexpr, STORE_SF: tl.constexpr, STORE_O: tl.constexpr,
                      STORE_H: tl.constexpr, PREC: tl.constexpr, HAS_SLOT: tl.constexpr = False):
    """The state pass, one program per (Dv block, sequence x value head), chunks in order:
    v_new = u - w S, o = (q exp(gc)) S + P v_new, S <- exp(gL) S + kd^T v_new (full chunks).
    The backward runs it again with STORE_H (each chunk's start state into H) and no o.
    HAS_SLOT (the engine's exact decode step, `triton_chunk_decode`): S0 = SF is a pool of
    states, sequence b's at slot SLOT[b], read and written back in place; a chunk counts as
    full within the first SLEN[b] rows only, and the slot is written only when one was (else
    it keeps its state)."""
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
    if HAS_SLOT:
        s_row = tl.load(SLOT + b).to(tl.int64)
        n_state = tl.load(SLEN + b).to(tl.int64)
    else:
        s_row = b.to(tl.int64)
        n_state = n
    s_ptrs = (s_row * Hv + h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    if HAS_S0:
        S = tl.load(S0 + s_ptrs, mask=mk[:, None] & mv[None, :], other=0.0)
    else:
        S = tl.zeros((BK, BV), dtype=tl.float32)
    for c in range(0, tl.cdiv(n, C)):
        rows = c * C + offs_c
        rm = rows < n
        t = start + rows
        ci = coff + c
        if STORE_H:
            tl.store(H + (ci * Hv + h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :], S,
                     mask=mk[:, None] & mv[None, :])
        rk = (t[:, None] * Hv + h) * DK + offs_k[None, :]
        m2 = rm[:, None] & mk[None, :]
        mvr = rm[:, None] & mv[None, :]
        w = tl.load(WB + rk, mask=m2, other=0.0)
        qg = tl.load(QG + rk, mask=m2, other=0.0)
        u = tl.load(UB + (t[:, None] * Hv + h) * DV + offs_v[None, :], mask=mvr, other=0.0)
        P = tl.load(PB + (ci * Hv + h) * C * C + offs_c[:, None] * C + offs_c[None, :])
        eL = tl.load(EL + ci * Hv + h)
        # 3. v_new = u - w S;  4. o = (q exp(gc)) S + P v_new
        v_new = u - dot(w, S, None, PREC)
        if STORE_O:
            o = dot(qg, S, None, PREC) + dot(P, v_new, None, PREC)
            OT: tl.constexpr = O.dtype.element_ty
            tl.store(O + t[:, None] * so_t + h * so_h + offs_v[None, :], round_to(o, OT).to(OT), mask=mvr)
        # 5. the state after the chunk, only if the chunk is full (the contract's S): a partial
        # chunk keeps S, so its kd^T v_new dot is skipped (63 of 64 exact decode steps)
        if (c + 1) * C <= n_state:
            kd = tl.load(KD + rk, mask=m2, other=0.0)
            S = eL * S + dot(tl.trans(kd), v_new, None, PREC)
    if STORE_SF:
        if HAS_SLOT:
            if n_state >= C:  # else no full chunk: the slot already holds the state
                tl.store(SF + s_ptrs, S, mask=mk[:, None] & mv[None, :])
        else:
            tl.store(SF + s_ptrs, S, mask=mk[:, None] & mv[None, :])


def chunk_map(cu_seqlens: torch.Tensor, T: int):
    """Device-side chunk bookkeeping, no host sync: coff (B+1,) each sequence's first chunk
    index, and for NC = T // CHUNK + B (a bound on the chunk count) slots, cseq (the slot's
    sequence, -1 past the last chunk) and cidx (its chunk number in the sequence)."""
    B = cu_seqlens.shape[0] - 1
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    coff = torch.cat([lens.new_zeros(1), ((lens + CHUNK - 1) // CHUNK).cumsum(0)])
    NC = T // CHUNK + B
    ids = torch.arange(NC, device=cu_seqlens.device)
    cseq = torch.searchsorted(coff[1:].contiguous(), ids, right=True)
    cidx = ids - coff[cseq.clamp(max=B - 1)]
    return coff, torch.where(cseq < B, cseq, -1), cidx, NC


def tile_config(Dk: int, Dv: int, exact: bool) -> dict:
    """Tile and compile settings from (Dk, Dv) and the numerics only, never T or B (the
    exactness rule). BV 64 keeps the (BK, BV) fp32 state block in registers at Dk = 128;
    16 is the smallest `tl.dot` operand side on the GPU (smaller heads are masked up)."""
    BK = max(16, triton.next_power_of_2(Dk))
    BV = min(64, max(16, triton.next_power_of_2(Dv)))
    # num_stages 1: the state passes load five fp32 chunk tiles per step, and Triton's default
    # of 3 pipelined copies needs 290-425 KB of shared memory at Dk = Dv = 128 (the H100 has
    # 227 KB); tests/test_kernel_resources.py compiles them for sm_90 to hold this on the CPU
    cfg = dict(BK=BK, BV=BV, num_warps=4 if BK * BV <= 4096 else 8, num_stages=1)
    if exact:
        cfg["enable_fp_fusion"] = False
    return cfg


def gated_delta_fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale: float, output_final_state: bool,
                    exact: bool):
    """Launch the forward: o (T, Hv, Dv) in v.dtype, and the final state (B, Hv, Dk, Dv)
    fp32 (None unless output_final_state). No host sync."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    B = cu_seqlens.shape[0] - 1
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    o = torch.empty(T, Hv, Dv, dtype=v.dtype, device=v.device)
    sf = torch.empty(B, Hv, Dk, Dv, dtype=torch.float32, device=v.device) if output_final_state else None
    s0 = initial_state.float().contiguous() if initial_state is not None else None
    if B == 0:
        return o, sf
    cfg = tile_config(Dk, Dv, exact)
    BK, BV = cfg.pop("BK"), cfg.pop("BV")
    prep = chunk_prep(q, k, v, g, beta, cu_seqlens, scale, BK, BV, cfg)
    state_pass_kernel[(triton.cdiv(Dv, BV), B * Hv)](
        *prep["buffers"], cu_seqlens, prep["coff"], s0 if s0 is not None else o, o, sf if sf is not None else o, o,
        cu_seqlens, cu_seqlens, o.stride(0), o.stride(1), Hv, DK=Dk, DV=Dv, BK=BK, BV=BV, C=CHUNK,
        HAS_S0=s0 is not None, STORE_SF=output_final_state, STORE_O=True, STORE_H=False, PREC=dot_precision(v),
        **cfg)
    return o, sf


def chunk_prep(q, k, v, g, beta, cu_seqlens, scale: float, BK: int, BV: int, cfg: dict, slots=None,
               slot_lens=None, store_t: bool = False) -> dict:
    """Launch `_chunk_prep_kernel`: {"buffers": (w, u, q exp(gc), k exp(gL - gc), P,
    exp(gL)) fp32, "coff", "cseq", "cidx", "NC"} (see `chunk_map`), and with `store_t`
    "T" (NC, Hv, C, C) fp32. With `slots`: q..beta are per-slot tails (N, C, ...), segment
    b (C rows) reads slot slots[b]'s first slot_lens[b] rows."""
    r = 0 if slots is None else 1  # the row dimension of the inputs
    Hk, Dk = q.shape[r + 1:]
    Hv, Dv = v.shape[r + 1:]
    T = q.shape[0] if slots is None else (cu_seqlens.shape[0] - 1) * CHUNK
    coff, cseq, cidx, NC = chunk_map(cu_seqlens, T)
    dev = v.device
    wb, qg, kd = (torch.empty(T, Hv, Dk, dtype=torch.float32, device=dev) for _ in range(3))
    ub = torch.empty(T, Hv, Dv, dtype=torch.float32, device=dev)
    pb = torch.empty(NC, Hv, CHUNK, CHUNK, dtype=torch.float32, device=dev)
    el = torch.empty(NC, Hv, dtype=torch.float32, device=dev)
    tb = torch.empty_like(pb) if store_t else None
    _chunk_prep_kernel[(NC, Hv)](
        q, k, v, g, beta, cu_seqlens, cseq, cidx, wb, ub, qg, kd, pb, el, tb if store_t else el,
        slots if slots is not None else cu_seqlens, slot_lens if slot_lens is not None else cu_seqlens,
        q.stride(r), q.stride(r + 1), k.stride(r), k.stride(r + 1), v.stride(r), v.stride(r + 1),
        g.stride(r), g.stride(r + 1), beta.stride(r), beta.stride(r + 1),
        Hv, Hv // Hk, scale, L2_EPS, DK=Dk, DV=Dv, BK=BK, BV=BV, C=CHUNK, PREC=dot_precision(v),
        HAS_SLOT=slots is not None, STORE_T=store_t, **cfg)
    return dict(buffers=(wb, ub, qg, kd, pb, el), coff=coff, cseq=cseq, cidx=cidx, NC=NC, T=tb)


class _ChunkGatedDelta(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, exact):
        o, sf = gated_delta_fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale, output_final_state, exact)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
        ctx.scale, ctx.output_final_state = scale, output_final_state
        return o, sf

    @staticmethod
    def backward(ctx, do, dsf):
        q, k, v, g, beta, s0, cu = ctx.saved_tensors
        dq, dk, dv, dg, db, ds0 = triton_ops("gated_delta.triton_chunk_bwd").gated_delta_bwd(
            q, k, v, g, beta, cu, s0, ctx.scale, do, dsf if ctx.output_final_state else None)
        return dq, dk, dv, dg, db, ds0, None, None, None, None


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, *, initial_state=None, scale: float,
                           output_final_state=False, exact=False):
    """The Triton path of `rlfuse.kernels.gated_delta.chunk.chunk_gated_delta_rule`."""
    o, sf = _ChunkGatedDelta.apply(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state,
                                   exact)
    return o, sf
