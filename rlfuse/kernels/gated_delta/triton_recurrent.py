"""The token-by-token gated delta rule, the Triton half (contract and math:
`rlfuse.kernels.gated_delta.recurrent`): one program per (Dv block, sequence x value
head) holds its (Dk, BV) fp32 state block in registers and walks the sequence's tokens.
Inference only (no autograd Function): the trainer runs the chunked op."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.gated_delta.chunk import L2_EPS
from rlfuse.kernels.triton_common import round_to

BV_DECODE = 32  # Dv block per program: B x Hv x Dv/32 programs fill an H100 at decode batch sizes


SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's F.softplus default: x itself above it


@triton.jit
def _gates(a, b, A_log, dt_bias, BT: tl.constexpr):
    """Raw projections a, b (fp32 scalars) -> (g fp32, beta rounded to BT as fp32):
    `rlfuse.kernels.gated_delta.recurrent.gdn_gates`, HF's order. log1p(e) as
    log(u) * e / (u - 1), u = 1 + e (e itself where u rounds to 1; Triton's interpreter has
    no log1p), so softplus keeps its relative accuracy for very negative x."""
    x = a + dt_bias
    e = tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))  # both branches stay finite (no inf / nan lanes)
    d = (1.0 + e) - 1.0
    sp = tl.where(d == 0.0, e, tl.log(1.0 + e) * (e / tl.where(d == 0.0, 1.0, d)))
    sp = tl.where(x > SOFTPLUS_THRESHOLD, x, sp)
    return -tl.exp(A_log) * sp, round_to(tl.sigmoid(b), BT)


@triton.jit(do_not_specialize=["Hv", "n_rep"])
def _recurrent_kernel(Q, K, V, G, BETA, CU, SLOT, S0, O, SF, ALOG, DTB, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t,
                      sg_h, sb_t, sb_h, so_t, so_h, Hv, n_rep, scale, eps, DK: tl.constexpr, DV: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr,
                      HAS_SLOT: tl.constexpr, GATES: tl.constexpr, HAS_CU: tl.constexpr):
    pid_v, pid_bh = tl.program_id(0), tl.program_id(1)
    b = pid_bh // Hv
    h = pid_bh % Hv
    hk = h // n_rep
    if HAS_CU:
        start = tl.load(CU + b).to(tl.int64)
        end = tl.load(CU + b + 1).to(tl.int64)
    else:  # one token per sequence: row b
        start = b.to(tl.int64)
        end = start + 1
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mk = offs_k < DK
    mv = offs_v < DV
    if HAS_SLOT:  # the state lives in a pool: slot SLOT[b] is read and written back
        s_row = tl.load(SLOT + b).to(tl.int64)
    else:
        s_row = b.to(tl.int64)
    s_ptrs = (s_row * Hv + h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    if HAS_S0:
        S = tl.load(S0 + s_ptrs, mask=mk[:, None] & mv[None, :], other=0.0)
    else:
        S = tl.zeros((BK, BV), dtype=tl.float32)
    if GATES:  # G and BETA hold the raw projections a and b: the gates are computed here
        A_log = tl.load(ALOG + h).to(tl.float32)
        dt_bias = tl.load(DTB + h).to(tl.float32)
    for t in range(start, end):
        q = tl.load(Q + t * sq_t + hk * sq_h + offs_k, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(K + t * sk_t + hk * sk_h + offs_k, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(V + t * sv_t + h * sv_h + offs_v, mask=mv, other=0.0).to(tl.float32)
        g = tl.load(G + t * sg_t + h * sg_h).to(tl.float32)
        beta = tl.load(BETA + t * sb_t + h * sb_h).to(tl.float32)
        if GATES:
            g, beta = _gates(g, beta, A_log, dt_bias, BETA.dtype.element_ty)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) + eps)) * scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + eps))
        S = S * tl.exp(g)
        delta = (v - tl.sum(S * k[:, None], 0)) * beta
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], 0)
        tl.store(O + t * so_t + h * so_h + offs_v, round_to(o, O.dtype.element_ty).to(O.dtype.element_ty), mask=mv)
    tl.store(SF + s_ptrs, S, mask=mk[:, None] & mv[None, :])


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, *, initial_state=None, scale: float,
                                     state_out=None, state_slots=None, gate_params=None):
    """The Triton path of `rlfuse.kernels.gated_delta.recurrent.fused_recurrent_gated_delta_rule`."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    B = T if cu_seqlens is None else cu_seqlens.shape[0] - 1
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    o = torch.empty(T, Hv, Dv, dtype=v.dtype, device=v.device)
    s0 = None
    if initial_state is not None:
        s0 = initial_state if initial_state.dtype == torch.float32 and initial_state.is_contiguous() \
            else initial_state.float().contiguous()
    if state_slots is not None:  # in place in the pool (the public op checked it is fp32 and contiguous)
        s0 = state_out = initial_state
    sf = state_out if state_out is not None else torch.empty(B, Hv, Dk, Dv, dtype=torch.float32, device=v.device)
    assert sf.is_contiguous(), "state_out must be contiguous"
    if B:
        BV = min(BV_DECODE, triton.next_power_of_2(Dv))
        _recurrent_kernel[(triton.cdiv(Dv, BV), B * Hv)](
            q, k, v, g, beta, cu_seqlens if cu_seqlens is not None else g,
            state_slots if state_slots is not None else g,
            s0 if s0 is not None else sf, o, sf, *(gate_params if gate_params is not None else (g, g)),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), o.stride(0), o.stride(1),
            Hv, Hv // Hk, scale, L2_EPS, DK=Dk, DV=Dv, BK=triton.next_power_of_2(Dk), BV=BV,
            HAS_S0=s0 is not None, HAS_SLOT=state_slots is not None, GATES=gate_params is not None,
            HAS_CU=cu_seqlens is not None, num_warps=4)
    return o, sf
