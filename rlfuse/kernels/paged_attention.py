"""Attention of packed queries against a paged KV cache (the engine's prefill and decode).

KV cache layout: k_cache, v_cache (num_blocks, block_size, Hkv, Dh); token t of a
sequence lives at slot block_tables[b, t // block_size] * block_size + t % block_size.

`store_kvcache(k, v, k_cache, v_cache, slot_mapping)`: writes k, v (T, Hkv, Dh) at
slots (T,) int64; slot -1 means "skip" (padding rows of a CUDA-graph batch).

`paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q)`:
q (T, Hq, Dh) packed, sequence b owns q rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and has
seq_lens[b] tokens in the cache (its new tokens already stored). Query j of sequence b
sits at position seq_lens[b] - q_len_b + j and attends causally to cache positions
0..that. Decode is the case q_len_b = 1 for every b. Output (T, Hq, Dh) in q.dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlfuse.kernels.backend import resolve_backend


def store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping):
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                        max_seqlen_q: int, scale: float | None = None):
    block_size, n_kv, dh = k_cache.shape[1:]
    n_rep = q.shape[1] // n_kv
    scale = dh ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()  # host sync: reference only
    lens = seq_lens.tolist()
    for b, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        q_len, kv_len = e - s, lens[b]
        if q_len == 0:
            continue
        n_blocks = (kv_len + block_size - 1) // block_size
        blocks = block_tables[b, :n_blocks].long()
        kb = k_cache[blocks].reshape(-1, n_kv, dh)[:kv_len]  # (L, Hkv, Dh)
        vb = v_cache[blocks].reshape(-1, n_kv, dh)[:kv_len]
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]  # (q_len, L)
        ob = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1),
            kb.transpose(0, 1).repeat_interleave(n_rep, dim=0).to(q.dtype),
            vb.transpose(0, 1).repeat_interleave(n_rep, dim=0).to(q.dtype),
            attn_mask=mask, scale=scale)
        out[s:e] = ob.transpose(0, 1)
    return out


_HAS_TRITON = False


def store_kvcache(k, v, k_cache, v_cache, slot_mapping):
    if resolve_backend("store_kvcache", k, has_triton=_HAS_TRITON) == "triton":
        raise NotImplementedError
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                    max_seqlen_q: int, scale: float | None = None):
    if resolve_backend("paged_attention", q, has_triton=_HAS_TRITON) == "triton":
        raise NotImplementedError
    return paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                               max_seqlen_q, scale)
