"""Attention of packed queries against a paged KV cache (the engine's prefill and decode).

KV cache layout: k_cache, v_cache (num_blocks, block_size, Hkv, Dh); token t of a
sequence lives at slot block_tables[b, t // block_size] * block_size + t % block_size.
Supported block sizes (pages): any power of two >= 16; 16 is the suggested engine
default (less tail waste; the kernel walks keys in KV_BLOCK = 64 steps with one table
lookup per key whatever the page size, so larger pages buy little). Dh a power of two
in [16, 256].

`store_kvcache(k, v, k_cache, v_cache, slot_mapping)`: writes k, v (T, Hkv, Dh) at
slots (T,) int64 (or int32); slot -1 means "skip" (padding rows of a CUDA-graph batch).
One program per token; the cache rows of skipped slots are never touched.

`paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q)`:
q (T, Hq, Dh) packed, sequence b owns q rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and has
seq_lens[b] tokens in the cache (its new tokens already stored). Query j of sequence b
sits at position seq_lens[b] - q_len_b + j and attends causally to cache positions
0..that. Decode is the case q_len_b = 1 for every b. Output (T, Hq, Dh) in q.dtype.
A row that sees no key (seq_lens[b] == 0, a padding row of a graph batch) gets zeros.

Triton path. One program per (query block x KV split, kv head, sequence); the program
packs BLOCK_Q query tokens times all query heads of its GQA group into its rows
(row r = token r // GROUP, head r % GROUP), so each K/V tile is read once per kv head.
It walks the cache in blocks of KV_BLOCK keys (the constant `varlen_attention` uses,
same order from key 0), looking up block_tables per key, with the online softmax of
`rlfuse.kernels.attention.varlen`. Split-KV (flash-decoding): when B * Hkv * query blocks is
too few programs for the GPU, the key range [0, block_tables.shape[1] * block_size) is
cut into `n_split` chunks of whole KV blocks; each program writes a normalized partial
o_s and lse_s (log2 units) to a workspace and a second kernel combines them:
    o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),  M = max_s lse_s.
Splits change the summation order, so a split decode is not bitwise equal to the
unsplit one, and the automatic split count depends on the batch size: for batch-
invariant decode pin it (`paged_attention_triton(..., num_splits=1)`); at a fixed count
a sequence's output does not depend on its batch neighbours (tested).
The grid depends only on Python ints (B, Hkv, max_seqlen_q, block_tables.shape[1]):
no host syncs, CUDA-graph capturable. Rows outside every sequence are left unwritten
(unsplit) or zero (split).
Shared prefixes (decode, Triton path): sequences whose first keys live in the same cache
blocks (a GRPO group's prompt, through the prefix cache) can read that K/V once for the
group: `SharedPrefixDecode` (planned on the host by `rlfuse.engine.step.shared_prefix`) lists chunks of up to `shared_prefix_members(...)` such
sequences and the length they share (whole KV_BLOCKs). One program per (chunk x split,
kv head) attends all members' query rows to the prefix; `_paged_attn_kernel` then walks each
sequence's keys from share_len on. When the suffix runs unsplit (always in exact
numerics; in fast numerics when the batch fills the GPU without splits) the prefix
program hands its online-softmax state (acc, m, l in fp32) to the suffix program, which
continues the walk; in exact numerics that is the same tiles in the same order, each
row's arithmetic independent of its tile neighbours, so the output is bitwise the
unshared one (tested). A split suffix (small fast batches): the prefix takes split slots
of its own and the combine merges them (rounding differs from the unshared pass, as any
split does). The reference ignores the plan (same math).
FP8 cache (`engine.kv_cache_dtype: fp8_e4m3`): k_cache and v_cache in float8_e4m3fn,
and `kv_scale` = (scale, inv), (2, Hkv) fp32 each (row 0 for K, row 1 for V: one layer of
`rlfuse.kernels.kv_quant.KVQuant`). The store quantizes the new K/V (steps of
`rlfuse.kernels.kv_quant.fp8`: times inv, saturate at +-448, round to nearest-even);
attention dequantizes each K/V tile as it loads it (float(q) * scale, exact, cast to
q.dtype) and then runs the same arithmetic as on a cache in q.dtype. So an fp8 cache
changes which K/V values attention sees (those of `fake_quant_kv`), never how it
reduces them: exact numerics stay bitwise against a trainer that fake-quantizes.
Tests: `python -m pytest -q tests/test_kernel_paged_attention.py tests/test_kernel_kv_fp8.py`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from rlfuse.kernels.attention.varlen import attend_exact_ref, gqa_group, supports_head_dim
from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.kv_quant import FP8_DTYPE, dequantize_kv, quantize_kv_ref


@dataclasses.dataclass(frozen=True)
class SharedPrefixDecode:
    """A decode step's shared prefixes (device tensors, int32 or int64; the module
    docstring). Sequence b's keys [0, share_len[b]) are read by its chunk's program
    (share_len 0: b is in no chunk). Chunk c's members are perm[first[c]:first[c] +
    count[c]], all with the same share_len and the same blocks for those keys; count 0 =
    unused chunk (static shapes for CUDA graphs). `max_members` caps count (sets the tile)."""
    share_len: torch.Tensor  # (B,)
    perm: torch.Tensor       # (B,)
    first: torch.Tensor      # (max_chunks,)
    count: torch.Tensor      # (max_chunks,)
    max_members: int

    @property
    def max_chunks(self) -> int:
        return self.first.shape[0]


def shared_prefix_rows(group: int, exact: bool, itemsize: int) -> int:
    """Query rows of a shared-prefix program: exact numerics keep the exact tile's height
    (the bits depend on it); fast: 32 (16 sequences of a 2-head GQA group)."""
    if exact:
        return triton_ops("attention.triton_varlen").exact_config(itemsize)["BLOCK_M"]
    return max(32, group)


def shared_prefix_members(n_heads: int, n_kv_heads: int, exact: bool, itemsize: int) -> int:
    """Sequences per shared-prefix chunk for this model and numerics."""
    group = gqa_group(n_heads, n_kv_heads)
    return shared_prefix_rows(group, exact, itemsize) // group


def check_kv_scale(k_cache, kv_scale, who: str):
    """ValueError unless an fp8 cache comes with its (scale, inv) pair of (2, Hkv) fp32 tensors."""
    if k_cache.dtype != FP8_DTYPE:
        return
    n_kv = k_cache.shape[2]
    if kv_scale is None or len(kv_scale) != 2 or any(
            t.shape != (2, n_kv) or t.dtype != torch.float32 for t in kv_scale):
        got = None if kv_scale is None else [(tuple(t.shape), t.dtype) for t in kv_scale]
        raise ValueError(f"{who}: an fp8 KV cache needs kv_scale = (scale, inv), (2, {n_kv}) fp32 each "
                         f"(KVQuant.layer), got {got}")


def _store(x, cache, slots, keep, kv_scale, row):
    flat = cache.view(-1, *cache.shape[2:])
    flat[slots] = x[keep].to(cache.dtype) if cache.dtype != FP8_DTYPE else quantize_kv_ref(x[keep], kv_scale[1][row])


def store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, kv_scale=None):
    check_kv_scale(k_cache, kv_scale, "store_kvcache")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    _store(k, k_cache, slots, keep, kv_scale, 0)
    _store(v, v_cache, slots, keep, kv_scale, 1)


def _load(cache, blocks, kv_len, dtype, kv_scale, row):
    x = cache[blocks].reshape(-1, *cache.shape[2:])[:kv_len]  # (L, Hkv, Dh)
    return x.to(dtype) if cache.dtype != FP8_DTYPE else dequantize_kv(x, kv_scale[0][row], dtype)


def _sequences(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, kv_scale=None):
    """Per sequence with queries and keys: (q rows s:e, its keys and values (L, Hkv, Dh)
    gathered from the cache (dequantized from fp8), the queries' positions). Padding rows
    (no keys) get zeros."""
    block_size = k_cache.shape[1]
    check_kv_scale(k_cache, kv_scale, "paged_attention")
    bounds = cu_seqlens_q.tolist()  # host sync: reference only
    lens = seq_lens.tolist()
    for b, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        q_len, kv_len = e - s, lens[b]
        if q_len == 0:
            continue
        if kv_len == 0:  # padding row: no keys, zeros (the contract)
            out[s:e] = 0
            continue
        blocks = block_tables[b, :(kv_len + block_size - 1) // block_size].long()
        kb = _load(k_cache, blocks, kv_len, q.dtype, kv_scale, 0)
        vb = _load(v_cache, blocks, kv_len, q.dtype, kv_scale, 1)
        yield s, e, kb, vb, torch.arange(kv_len - q_len, kv_len, device=q.device)


def paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                        max_seqlen_q: int, scale: float | None = None, kv_scale=None):
    n_rep = q.shape[1] // k_cache.shape[2]
    scale = k_cache.shape[3] ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    for s, e, kb, vb, q_pos in _sequences(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out,
                                           kv_scale):
        mask = torch.arange(kb.shape[0], device=q.device)[None, :] <= q_pos[:, None]  # (q_len, L)
        ob = F.scaled_dot_product_attention(q[s:e].transpose(0, 1),
                                            kb.transpose(0, 1).repeat_interleave(n_rep, dim=0),
                                            vb.transpose(0, 1).repeat_interleave(n_rep, dim=0),
                                            attn_mask=mask, scale=scale)
        out[s:e] = ob.transpose(0, 1)
    return out


def paged_attention_exact_ref(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                              max_seqlen_q: int, scale: float | None = None, kv_scale=None):
    """Exact numerics: `attend_exact_ref` over the keys gathered from the cache, so a query
    row gets the bits `varlen_attention_exact_ref` gives the same row in a packed forward."""
    scale = k_cache.shape[3] ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    for s, e, kb, vb, q_pos in _sequences(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out,
                                           kv_scale):
        out[s:e] = attend_exact_ref(q[s:e], kb, vb, q_pos, scale)[0]
    return out


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_cache(k_cache, v_cache, who: str):
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"{who}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         "(num_blocks, block_size, Hkv, Dh)")
    page, _, dh = k_cache.shape[1:]
    if not _pow2(page) or page < 16:
        raise ValueError(f"{who}: block_size {page} must be a power of two >= 16")
    if not supports_head_dim(dh):
        raise ValueError(f"{who}: head_dim {dh} must be a power of two in [16, 256]")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{who}: the KV cache's last dimension must be contiguous")


def store_kvcache(k, v, k_cache, v_cache, slot_mapping, kv_scale=None):
    """kv_scale: (scale, inv) of an fp8 cache (module docstring); ignored otherwise."""
    if resolve_backend("store_kvcache", k) == "triton":
        triton_ops("attention.triton_paged").store_kvcache_triton(k, v, k_cache, v_cache, slot_mapping, kv_scale)
        return
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, kv_scale)


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                    max_seqlen_q: int, scale: float | None = None, shared: SharedPrefixDecode | None = None,
                    kv_scale=None):
    exact = is_exact()
    if resolve_backend("paged_attention", q) == "triton":
        return triton_ops("attention.triton_paged").paged_attention_triton(
            q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale, exact=exact,
            shared=shared, kv_scale=kv_scale)
    ref = paged_attention_exact_ref if exact else paged_attention_ref
    return ref(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, scale, kv_scale)
