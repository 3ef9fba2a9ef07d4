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

Backward: NOT a Triton kernel yet. The Function's backward recomputes the forward through
the PyTorch chunked reference (`chunk_gated_delta_rule_ref`, fast numerics: gradients need
no batch invariance) under autograd and differentiates it: correct, and slower and more
memory-hungry than a fused backward would be.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.gated_delta.chunk import CHUNK, L2_EPS, chunk_gated_delta_rule_ref
from rlfuse.kernels.triton.common import dot, dot_precision, round_to


@triton.jit
def _l2norm_rows(x, eps):
    return x * (1.0 / tl.sqrt(tl.sum(x * x, 1) + eps))[:, None]


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


@triton.jit(do_not_specialize=["Hv", "n_rep"])
def _gdn_fwd_kernel(Q, K, V, G, BETA, CU, S0, O, SF,
                    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h, so_t, so_h,
                    Hv, n_rep, scale, eps,
                    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    C: tl.constexpr, HAS_S0: tl.constexpr, STORE_SF: tl.constexpr, PREC: tl.constexpr):
    pid_v, pid_bh = tl.program_id(0), tl.program_id(1)
    b = pid_bh // Hv
    h = pid_bh % Hv
    hk = h // n_rep
    start = tl.load(CU + b).to(tl.int64)
    n = tl.load(CU + b + 1).to(tl.int64) - start
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mk = offs_k < DK
    mv = offs_v < DV
    s_ptrs = (b * Hv + h).to(tl.int64) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    if HAS_S0:
        S = tl.load(S0 + s_ptrs, mask=mk[:, None] & mv[None, :], other=0.0)
    else:
        S = tl.zeros((BK, BV), dtype=tl.float32)
    lower = offs_c[:, None] >= offs_c[None, :]
    strict = offs_c[:, None] > offs_c[None, :]
    for c in range(0, tl.cdiv(n, C)):
        rows = c * C + offs_c
        rm = rows < n
        t = start + rows
        q = tl.load(Q + t[:, None] * sq_t + hk * sq_h + offs_k[None, :], mask=rm[:, None] & mk[None, :],
                    other=0.0).to(tl.float32)
        k = tl.load(K + t[:, None] * sk_t + hk * sk_h + offs_k[None, :], mask=rm[:, None] & mk[None, :],
                    other=0.0).to(tl.float32)
        v = tl.load(V + t[:, None] * sv_t + h * sv_h + offs_v[None, :], mask=rm[:, None] & mv[None, :],
                    other=0.0).to(tl.float32)
        g = tl.load(G + t * sg_t + h * sg_h, mask=rm, other=0.0).to(tl.float32)
        beta = tl.load(BETA + t * sb_t + h * sb_h, mask=rm, other=0.0).to(tl.float32)
        q = _l2norm_rows(q, eps) * scale
        k = _l2norm_rows(k, eps)
        gc = tl.cumsum(g, 0)
        decay = tl.where(lower, tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0)), 0.0)   # D_ij
        egc = tl.exp(gc)
        # 1. A = strict_lower(beta_i k_i.k_j D_ij), T = (I + A)^-1
        A = tl.where(strict, beta[:, None] * dot(k, tl.trans(k), None, PREC) * decay, 0.0)
        Tm = _unit_lower_inverse(A, offs_c, C, 16, PREC)
        # 2. u = T (beta v), w = T (beta exp(gc) k); 3. v_new = u - w S
        u = dot(Tm, beta[:, None] * v, None, PREC)
        w = dot(Tm, (beta * egc)[:, None] * k, None, PREC)
        v_new = u - dot(w, S, None, PREC)
        # 4. o = (q exp(gc)) S + lower(q k^T D) v_new
        qk = tl.where(lower, dot(q, tl.trans(k), None, PREC) * decay, 0.0)
        o = dot(q * egc[:, None], S, None, PREC) + dot(qk, v_new, None, PREC)
        tl.store(O + t[:, None] * so_t + h * so_h + offs_v[None, :], round_to(o, O.dtype.element_ty).to(O.dtype.element_ty),
                 mask=rm[:, None] & mv[None, :])
        # 5. the state after the chunk, kept only if the chunk is full (the contract's S)
        glast = tl.sum(tl.where(offs_c == C - 1, gc, 0.0), 0)
        kd = k * tl.exp(glast - gc)[:, None]
        S_new = tl.exp(glast) * S + dot(tl.trans(kd), v_new, None, PREC)
        S = tl.where((c + 1) * C <= n, S_new, S)
    if STORE_SF:
        tl.store(SF + s_ptrs, S, mask=mk[:, None] & mv[None, :])


def tile_config(Dk: int, Dv: int, exact: bool) -> dict:
    """Tile and compile settings from (Dk, Dv) and the numerics only, never T or B (the
    exactness rule). BV 64 keeps the (BK, BV) fp32 state block in registers at Dk = 128."""
    BK = triton.next_power_of_2(Dk)
    BV = min(64, triton.next_power_of_2(Dv))
    cfg = dict(BK=BK, BV=BV, num_warps=4 if BK * BV <= 4096 else 8)
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
    grid = (triton.cdiv(Dv, cfg["BV"]), B * Hv)
    _gdn_fwd_kernel[grid](
        q, k, v, g, beta, cu_seqlens, s0 if s0 is not None else o, o, sf if sf is not None else o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), o.stride(0), o.stride(1),
        Hv, Hv // Hk, scale, L2_EPS, DK=Dk, DV=Dv, C=CHUNK, HAS_S0=s0 is not None,
        STORE_SF=output_final_state, PREC=dot_precision(q if q.dtype == torch.float32 else v), **cfg)
    return o, sf


class _ChunkGatedDelta(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, exact):
        o, sf = gated_delta_fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale, output_final_state, exact)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
        ctx.scale, ctx.output_final_state = scale, output_final_state
        return o, sf

    @staticmethod
    def backward(ctx, do, dsf):
        # recompute through the torch chunked reference and differentiate it (see module docstring)
        q, k, v, g, beta, s0, cu = ctx.saved_tensors
        leaves = [x.detach().requires_grad_(x.requires_grad) if x is not None else None
                  for x in (q, k, v, g, beta, s0)]
        with torch.enable_grad():
            o, sf = chunk_gated_delta_rule_ref(*leaves[:5], cu, initial_state=leaves[5], scale=ctx.scale,
                                               output_final_state=ctx.output_final_state, exact=False)
            outs, grads_out = [o], [do]
            if ctx.output_final_state and dsf is not None:
                outs.append(sf)
                grads_out.append(dsf)
            need = [x for x in leaves if x is not None and x.requires_grad]
            got = iter(torch.autograd.grad(outs, need, grads_out, allow_unused=True)) if need else iter(())
        grads = [next(got) if x is not None and x.requires_grad else None for x in leaves]
        return (*grads, None, None, None, None)


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, *, initial_state=None, scale: float,
                           output_final_state=False, exact=False):
    """The Triton path of `rlfuse.kernels.gated_delta.chunk.chunk_gated_delta_rule`."""
    o, sf = _ChunkGatedDelta.apply(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state,
                                   exact)
    return o, sf
