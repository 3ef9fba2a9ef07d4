"""Chunked gated delta rule (Gated DeltaNet, Qwen3.5's linear attention) over packed varlen
sequences.

Contract (docs/numerics.md, "Linear attention (Gated DeltaNet)"):
  o, S = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, *, initial_state=None,
                                scale=None, output_final_state=False)
  q, k (T, Hk, Dk) raw (the op l2-normalizes them in fp32, eps 1e-6, and scales q by
  `scale`, default Dk**-0.5); v (T, Hv, Dv), Hv % Hk == 0, value head h reads q/k head
  h // (Hv // Hk); g (T, Hv) fp32 log decay (<= 0); beta (T, Hv); cu_seqlens (B+1,) int32;
  initial_state (B, Hv, Dk, Dv) fp32 or None. o (T, Hv, Dv) in v.dtype; S (B, Hv, Dk, Dv)
  fp32 is the state after the LAST FULL CHUNK of each sequence (after its first
  64 * floor(n / 64) tokens; the initial state when n < 64), not after the last token.

Math, per sequence and value head, state S (Dk, Dv), per token t:
  S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,  o_t = S_t^T q_t
(`recurrent_gated_delta_rule_ref`, the oracle). The chunked form: chunks of CHUNK = 64
tokens aligned to each sequence's first token; inside a chunk (rows i, j), with
gc = cumsum(g) over the chunk and D_ij = exp(gc_i - gc_j) for j <= i (0 above):
  1. A = strict_lower(beta_i (k_i . k_j) D_ij); T = (I + A)^-1 (forward substitution:
     T_i = e_i - sum_{j<i} A_ij T_j, so row i of T uses rows < i only).
  2. u = T (beta v), w = T (beta exp(gc) k)            (the UT / WY transform)
  3. v_new = u - w S                                     (what the state does not yet predict)
  4. o = (q exp(gc)) S + lower(q_i . k_j D_ij) v_new     (inter-chunk read + intra-chunk)
  5. S <- exp(gc_last) S + (k exp(gc_last - gc))^T v_new (only after a full chunk)
Rows past a sequence's end are exact zeros (k = v = q = beta = g = 0).

Exactness (how the engine's decode equals the trainer's packed forward bitwise): the
engine keeps, per sequence, the state S_c at its last chunk boundary and the raw inputs
of the <= 63 tokens since; every continuation is one call over [buffered + new tokens]
from S_c (the static decode step: `chunk_decode`, the same kernels on the engine's slots). That call runs the same chunk arithmetic as the trainer's whole-sequence call
because: (a) a row's output depends only on its own chunk's rows at or before it and the
chunk's start state: every sum over chunk rows j has zero terms for j > i whether those
rows exist or are padding (the masks), and is reduced in an order fixed by the tile shape
(64 rows, Dk, Dv) alone; (b) the state after a full chunk depends only on the chunk's 64
rows and its start state; (c) nothing depends on T, B or the other sequences. The exact
torch reference below gets (a)-(c) on CPU from `rlfuse.kernels.invariant` (pairwise sums
whose zero-padded trailing terms change nothing, SIMD-uniform exp / rsqrt); the Triton
kernel (`triton_chunk.py`) from one program per (sequence, head, Dv block) walking its
chunks with one masked tile shape, FMA contraction off in exact numerics.

Backends: "torch" runs `chunk_gated_delta_rule_ref` (autograd differentiates it);
"triton" runs `triton_chunk.py`'s forward and `triton_chunk_bwd.py`'s backward (dq, dk,
dv, dg, dbeta, d initial_state; deterministic). The backward needs no batch invariance.
Tests: `python -m pytest -q tests/test_kernel_gated_delta.py`.
"""

from __future__ import annotations

import math

import torch

from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.invariant import pairwise_sum, pointwise

CHUNK = 64
L2_EPS = 1e-6


def _ct(x: torch.Tensor) -> torch.dtype:
    """Compute dtype: fp64 for fp64 inputs (the gold oracle), fp32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2norm_ref(x: torch.Tensor, exact: bool, eps: float = L2_EPS) -> torch.Tensor:
    """HF `l2norm`: x * rsqrt(sum(x^2) + eps) over the last dim."""
    if exact:
        return x * pointwise(torch.rsqrt, pairwise_sum(x * x, -1)[..., None] + eps)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _mm(a: torch.Tensor, b: torch.Tensor, exact: bool) -> torch.Tensor:
    """a (..., M, K) @ b (..., K, N); exact: products summed pairwise over K (row m of the
    result depends on a[m] and b only, in a fixed order)."""
    if exact:  # products laid out (..., M, N, K): the halving runs over a contiguous last dim
        return pairwise_sum(a.unsqueeze(-2) * b.transpose(-1, -2).unsqueeze(-3), -1)
    return a @ b


def _exp(x: torch.Tensor, exact: bool) -> torch.Tensor:
    return pointwise(torch.exp, x) if exact else torch.exp(x)


def _prepare_qk(q, k, Hv, scale, exact):
    """Repeat q/k heads to Hv, l2-normalize in the compute dtype, scale q."""
    ct = _ct(q)
    rep = Hv // q.shape[1]
    q, k = q.to(ct), k.to(ct)
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    return l2norm_ref(q, exact) * scale, l2norm_ref(k, exact)


def recurrent_gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens, *, initial_state=None, scale=None):
    """Token-by-token oracle (HF `torch_recurrent_gated_delta_rule`'s order of operations)
    over packed varlen sequences: returns o (T, Hv, Dv) in v.dtype and the state after
    the LAST TOKEN of each sequence (B, Hv, Dk, Dv) (unlike the chunked op). Run it in
    float64 in tests."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    scale = Dk ** -0.5 if scale is None else scale
    ct, out_dtype = _ct(q), v.dtype
    q, k = _prepare_qk(q, k, Hv, scale, exact=False)
    v, g, beta = v.to(ct), g.to(ct), beta.to(ct)
    B = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.tolist()  # host sync: the oracle loops over tokens in Python
    o = torch.zeros(T, Hv, Dv, dtype=ct, device=v.device)
    states = []
    for b in range(B):
        S = (torch.zeros(Hv, Dk, Dv, dtype=ct, device=v.device) if initial_state is None
             else initial_state[b].to(ct))
        for t in range(cu[b], cu[b + 1]):
            S = S * torch.exp(g[t])[:, None, None]
            kv_mem = (S * k[t][:, :, None]).sum(-2)                       # (Hv, Dv)
            delta = (v[t] - kv_mem) * beta[t][:, None]
            S = S + k[t][:, :, None] * delta[:, None, :]
            o[t] = (S * q[t][:, :, None]).sum(-2)
        states.append(S)
    return o.to(out_dtype), torch.stack(states) if states else None


def _chunk_layout(cu_seqlens: torch.Tensor, T: int):
    """Per-chunk token indices (NC, CHUNK) with T for rows past a sequence's end, each
    chunk's sequence (list), whether it is full (list), and the chunk count per sequence."""
    cu = cu_seqlens.tolist()  # host sync: the reference sizes its loops from the lengths
    seq_of, full, idx = [], [], []
    nchunks = []
    for b in range(len(cu) - 1):
        n = cu[b + 1] - cu[b]
        nc = -(-n // CHUNK)
        nchunks.append(nc)
        for c in range(nc):
            lo = cu[b] + c * CHUNK
            rows = torch.arange(lo, lo + CHUNK)
            idx.append(torch.where(rows < cu[b + 1], rows, T))
            seq_of.append(b)
            full.append((c + 1) * CHUNK <= n)
    idx = torch.stack(idx) if idx else torch.zeros(0, CHUNK, dtype=torch.long)
    return idx, seq_of, full, nchunks


def _cumsum(g: torch.Tensor, exact: bool) -> torch.Tensor:
    """Cumulative sum over the last dim; exact: left to right, one add per row."""
    if not exact:
        return g.cumsum(-1)
    out = [g[..., 0]]
    for i in range(1, g.shape[-1]):
        out.append(out[-1] + g[..., i])
    return torch.stack(out, -1)


def _unit_lower_inverse(A: torch.Tensor, exact: bool) -> torch.Tensor:
    """(I + A)^-1 for A (..., C, C) strictly lower: forward substitution row by row."""
    C = A.shape[-1]
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    if not exact:
        return torch.linalg.solve_triangular(A + eye, eye.expand_as(A), upper=False, unitriangular=True)
    rows = [eye[0].expand(A.shape[:-2] + (C,))]
    for i in range(1, C):
        prev = torch.stack(rows, -2)                                          # (..., i, C)
        rows.append(eye[i] - pairwise_sum(A[..., i, :i, None] * prev, -2))
    return torch.stack(rows, -2)


def chunk_gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens, *, initial_state=None, scale=None,
                               output_final_state=False, exact=None):
    """The chunked algorithm in torch (module docstring steps 1-5), differentiable by
    autograd. `exact` (default: the current numerics) uses the batch-invariant building
    blocks, so a row's bits never depend on the rows after it or on other sequences."""
    exact = is_exact() if exact is None else exact
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    scale = Dk ** -0.5 if scale is None else scale
    ct = _ct(q)
    dev = v.device
    B = cu_seqlens.shape[0] - 1
    qn, kn = _prepare_qk(q, k, Hv, scale, exact)
    idx, seq_of, full, nchunks = _chunk_layout(cu_seqlens, T)
    idx = idx.to(dev)
    NC = idx.shape[0]

    def chunked(x):  # (T, H, ...) -> (NC, H, CHUNK, ...) with zero rows past each end
        x = torch.cat([x, x.new_zeros((1,) + x.shape[1:])])[idx]      # (NC, CHUNK, H, ...)
        return x.transpose(1, 2)

    qc, kc, vc = chunked(qn), chunked(kn), chunked(v.to(ct))
    gc = _cumsum(chunked(g.to(ct)), exact)                             # (NC, H, C)
    bc = chunked(beta.to(ct))                                          # (NC, H, C)
    rows = torch.arange(CHUNK, device=dev)
    lower = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    diff = gc[..., :, None] - gc[..., None, :]
    decay = torch.where(lower, _exp(torch.where(lower, diff, 0.0), exact), 0.0)   # D_ij
    egc = _exp(gc, exact)
    # 1. A and T = (I + A)^-1
    kkt = _mm(kc, kc.transpose(-1, -2), exact)
    A = torch.where(strict, bc[..., :, None] * kkt * decay, 0.0)
    Tm = _unit_lower_inverse(A, exact)
    # 2. u = T (beta v), w = T (beta exp(gc) k)
    u = _mm(Tm, bc[..., None] * vc, exact)
    w = _mm(Tm, (bc * egc)[..., None] * kc, exact)
    qk = torch.where(lower, _mm(qc, kc.transpose(-1, -2), exact) * decay, 0.0)
    qg = qc * egc[..., None]
    glast = gc[..., -1:]
    kd = kc * _exp(glast - gc, exact)[..., None]                       # k exp(gc_last - gc)
    eglast = _exp(glast, exact)[..., None]                             # (NC, H, 1, 1)

    S = [torch.zeros(Hv, Dk, Dv, dtype=ct, device=dev) if initial_state is None
         else initial_state[b].to(ct) for b in range(B)]
    first = [0] * B
    for b in range(1, B):
        first[b] = first[b - 1] + nchunks[b - 1]
    out = [None] * NC
    for c in range(max(nchunks, default=0)):  # chunk c of every sequence that has one, together
        seqs = [b for b in range(B) if nchunks[b] > c]
        ids = torch.tensor([first[b] + c for b in seqs], device=dev)
        S_in = torch.stack([S[b] for b in seqs])
        # 3. v_new = u - w S;  4. o = (q exp(gc)) S + lower(q k^T D) v_new
        v_new = u[ids] - _mm(w[ids], S_in, exact)
        o_c = _mm(qg[ids], S_in, exact) + _mm(qk[ids], v_new, exact)
        # 5. the state after a full chunk
        S_out = eglast[ids] * S_in + _mm(kd[ids].transpose(-1, -2), v_new, exact)
        for n, b in enumerate(seqs):
            out[first[b] + c] = o_c[n]
            if full[first[b] + c]:
                S[b] = S_out[n]
    o = (torch.stack(out) if NC else v.new_zeros(0, Hv, CHUNK, Dv, dtype=ct))
    o = o.transpose(1, 2).reshape(NC * CHUNK, Hv, Dv)[(idx < T).reshape(-1)]
    o = o.to(v.dtype)
    state = (torch.stack(S) if B else v.new_zeros(0, Hv, Dk, Dv, dtype=ct)) if output_final_state else None
    return o, state


def check_state_pool(op: str, pool, slots, B: int, per_slot: tuple[int, int, int]) -> None:
    """A slot pool of states (the decode op's, the recurrent op's `state_slots`)."""
    if pool is None or pool.dim() != 4 or tuple(pool.shape[1:]) != per_slot or pool.dtype != torch.float32 \
            or not pool.is_contiguous():
        got = None if pool is None else (tuple(pool.shape), pool.dtype)
        raise ValueError(f"{op}: the states must be a contiguous fp32 pool (N, Hv, Dk, Dv) with (Hv, Dk, Dv) = "
                         f"{per_slot}, got {got}")
    if slots.shape != (B,) or slots.dtype != torch.int64:
        raise ValueError(f"{op}: the slots must be (B,) = ({B},) int64, got {tuple(slots.shape)} {slots.dtype}")


def check_inputs(q, k, v, g, beta, cu_seqlens, initial_state):
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"chunk_gated_delta_rule: q, k must be (T, Hk, Dk) and v (T, Hv, Dv); got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    if Hv % Hk:
        raise ValueError(f"chunk_gated_delta_rule: v heads ({Hv}) must be a multiple of q/k heads ({Hk})")
    if g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"chunk_gated_delta_rule: g and beta must be (T, Hv) = {(T, Hv)}; got g "
                         f"{tuple(g.shape)}, beta {tuple(beta.shape)}")
    if cu_seqlens is None:  # the recurrent op's one token per sequence (its decode step), not the chunked op's
        B = T
    elif cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"chunk_gated_delta_rule: cu_seqlens must be a 1-D int32 tensor, got "
                         f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    else:
        B = cu_seqlens.shape[0] - 1
    if initial_state is not None and initial_state.shape != (B, Hv, Dk, Dv):
        raise ValueError(f"chunk_gated_delta_rule: initial_state must be (B, Hv, Dk, Dv) = {(B, Hv, Dk, Dv)}, "
                         f"got {tuple(initial_state.shape)}")


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, *, initial_state=None, scale=None,
                           output_final_state=False):
    """Public op (contract in the module docstring): picks the backend. Both backends
    honour the current numerics; in exact numerics the result of a row is independent of
    the rows after it, of T and of the other sequences."""
    if cu_seqlens is None:
        raise ValueError("chunk_gated_delta_rule: cu_seqlens is required (the (B+1,) int32 sequence offsets)")
    check_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"chunk_gated_delta_rule: scale must be finite, got {scale}")
    if resolve_backend("chunk_gated_delta_rule", v) == "triton":
        return triton_ops("gated_delta.triton_chunk").chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens, initial_state=initial_state, scale=scale,
            output_final_state=output_final_state, exact=is_exact())
    return chunk_gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens, initial_state=initial_state, scale=scale,
                                      output_final_state=output_final_state, exact=is_exact())
