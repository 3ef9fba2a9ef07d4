"""Causal attention over packed variable-length sequences (the trainer's forward).

Contract: q (T, Hq, Dh), k and v (T, Hkv, Dh) with Hq % Hkv == 0 (GQA: query head h
reads kv head h // (Hq // Hkv)); `cu_seqlens` (B+1,) int32 cumulative lengths, so
sequence b owns rows cu_seqlens[b]:cu_seqlens[b+1]; `max_seqlen` a Python int (no host
sync to find it). Row i of sequence b attends to rows 0..i of the same sequence.
Output (T, Hq, Dh) in q.dtype; softmax in fp32 with scale `scale` (default Dh^-0.5).

The reference loops over sequences with `scaled_dot_product_attention`; it reads
`cu_seqlens` on the host (allowed for a reference, never in a fast path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlfuse.kernels.backend import resolve_backend


def varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen: int, scale: float | None = None):
    n_rep = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()  # host sync: reference only
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        qb = q[s:e].transpose(0, 1)  # (Hq, L, Dh)
        kb = k[s:e].transpose(0, 1).repeat_interleave(n_rep, dim=0)
        vb = v[s:e].transpose(0, 1).repeat_interleave(n_rep, dim=0)
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        out[s:e] = ob.transpose(0, 1)
    return out


_HAS_TRITON = False


def varlen_attention(q, k, v, cu_seqlens, max_seqlen: int, scale: float | None = None):
    if resolve_backend("varlen_attention", q, has_triton=_HAS_TRITON) == "triton":
        raise NotImplementedError
    return varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen, scale)
