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

from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.invariant import pairwise_sum, pointwise

KV_BLOCK = 64  # keys per step in the forward and in paged_attention (see module docstring)


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


def varlen_attention(q, k, v, cu_seqlens, max_seqlen: int, scale: float | None = None,
                     *, return_lse: bool = False):
    """Public op (contract in the module docstring); picks the backend and the numerics."""
    exact = is_exact()
    if resolve_backend("varlen_attention", q) == "triton":
        _check(q, k, v, cu_seqlens)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        o, lse = triton_ops("attention").varlen_attention(q, k, v, cu_seqlens, int(max_seqlen), scale, exact)
        return (o, lse) if return_lse else o
    ref = varlen_attention_exact_ref if exact else varlen_attention_ref
    return ref(q, k, v, cu_seqlens, max_seqlen, scale, return_lse=return_lse)
