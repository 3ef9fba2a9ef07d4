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

Shared prefix (`prefix=SharedPrefix(start, length, readers_end)`, (B,) int32 each): a
GRPO group packed as [prompt, completion_1, ..., completion_G], the prompt once. Segment
b with length[b] = P > 0 reads the P keys at rows start[b]:start[b]+P (a whole earlier
segment with length 0, its prefix) before its own: its row i sits at logical position
P + i and sees logical keys 0..P+i, key j < P at row start[b] + j, key j >= P at row
cu_seqlens[b] + j - P -- exactly what row P + i of the unshared sequence [prefix, own]
sees. readers_end[b] (the backward's index, built by `SharedPrefix.from_groups`): the
rows cu_seqlens[b+1]:readers_end[b] are the segments reading b as their prefix, all
following b contiguously (readers_end[b] = cu_seqlens[b+1] when none does). No nesting:
a prefix segment has no prefix itself. `max_seqlen` counts a segment's own rows only.
A reader may read only the first P of its prefix segment's keys (length[b] = P below the
segment's length: split agent turns whose contexts part ways inside a shared trunk); the
prefix's dK/dV then mask each reader row by its P (`row_length`).

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
            A shared prefix changes only where a key tile is loaded from: tiles still
            cover logical keys [0, 64), [64, 128), ... in order, gathering a tile that
            straddles the prompt/completion boundary from both places, so a completion
            row reduces the same tiles in the same order as in its unshared sequence and
            the exact forward (o and lse) is bitwise the unshared one's.
  backward  delta = rowsum(dO * O) (kernel 1); dK, dV (kernel 2, one program per
            KV block and kv head, looping over the query heads of its GQA group and the
            query blocks at or below the diagonal:  p = exp2(s - lse log2 e),
            dv += p^T dO,  ds = p (dO v^T - delta),  dk += ds^T q * scale);
            dQ (kernel 3, one program per query block and head: dq += ds k * scale).
            No atomics: the gradients are deterministic run to run.
            Shared prefix: dQ walks logical key tiles as the forward does; a prefix
            segment's dK/dV add, after its own causal query blocks, the query blocks of
            its readers (rows cu_seqlens[b+1]:readers_end[b], each masked to its first
            `row_length` keys). A prefix key
            thus sums the G completions' terms in one accumulator instead of G separate
            ones (added later by the K/V projections' backward): the same sum in another
            order, close but not bitwise (docs/numerics.md, "Shared prompts").
fp32 inputs use IEEE fp32 dots (no TF32) so they can be checked tightly.

The reference loops over sequences with `scaled_dot_product_attention`; it reads
`cu_seqlens` on the host (allowed for a reference, never in a fast path).
Tests: `python -m pytest -q tests/test_kernel_attention.py tests/test_prefix_sharing.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.invariant import pairwise_sum, pointwise

KV_BLOCK = 64  # keys per step in the forward and in paged_attention (see module docstring)


class SharedPrefix(NamedTuple):
    """Per-segment shared-prefix metadata of `varlen_attention` (module docstring)."""
    start: torch.Tensor        # (B,) int32 first row of the prefix segment read (any when length 0)
    length: torch.Tensor       # (B,) int32 prefix keys read before the segment's own (0 = none)
    readers_end: torch.Tensor  # (B,) int32 end row of the segments reading this one as prefix
    row_length: torch.Tensor   # (T,) int32 per row: its segment's `length` (the dK/dV of a prefix masks by it)

    @classmethod
    def from_groups(cls, lengths: list[int], prefix_of: list[int | None], device=None,
                    prefix_len: list[int | None] | None = None) -> "SharedPrefix":
        """prefix_of[b]: the segment b reads as its prefix (None = none); prefix_len[b]: how
        many of its first keys b reads, 1 ... its length (None or not given: all of them).
        Checks the layout rules of the module docstring on the host (build time, before any kernel)."""
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        B = len(lengths)
        start, length, readers_end = [0] * B, [0] * B, bounds[1:]
        for b, p in enumerate(prefix_of):
            if p is None:
                continue
            if not 0 <= p < b or prefix_of[p] is not None or not all(
                    prefix_of[c] == p for c in range(p + 1, b)):
                raise ValueError(f"shared prefix: segment {b} reads segment {p}; a prefix must be an earlier "
                                 "segment without a prefix, followed contiguously by all of its readers")
            n = lengths[p] if prefix_len is None or prefix_len[b] is None else prefix_len[b]
            if not 1 <= n <= lengths[p]:
                raise ValueError(f"shared prefix: segment {b} reads {n} keys of segment {p}, which has {lengths[p]}")
            start[b], length[b] = bounds[p], n
            readers_end[p] = bounds[b + 1]
        row_length = [n for n, (s, e) in zip(length, zip(bounds, bounds[1:])) for _ in range(e - s)]

        def t(x):
            return torch.tensor(x, dtype=torch.int32).to(device)

        return cls(t(start), t(length), t(readers_end), t(row_length))


def _segments(cu_seqlens, prefix: SharedPrefix | None):
    """Host list of (start, end, prefix start, prefix length) per segment (references only)."""
    bounds = cu_seqlens.tolist()  # host sync: reference only
    B = len(bounds) - 1
    ps, pl = (prefix.start.tolist(), prefix.length.tolist()) if prefix is not None else ([0] * B, [0] * B)
    return [(bounds[b], bounds[b + 1], ps[b], pl[b]) for b in range(B)]


def _with_prefix(x, s, e, ps, P):
    """Rows of one segment's logical sequence: the prefix's P rows, then its own."""
    return x[s:e] if P == 0 else torch.cat([x[ps:ps + P], x[s:e]])


def varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen: int, scale: float | None = None,
                         *, return_lse: bool = False, prefix: SharedPrefix | None = None):
    n_rep = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # float64 for gold runs
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=lse_dtype, device=q.device) if return_lse else None
    for s, e, ps, P in _segments(cu_seqlens, prefix):
        if e == s:
            continue
        qb = q[s:e].transpose(0, 1)  # (Hq, L, Dh)
        kb = _with_prefix(k, s, e, ps, P).transpose(0, 1).repeat_interleave(n_rep, dim=0)  # (Hq, P + L, Dh)
        vb = _with_prefix(v, s, e, ps, P).transpose(0, 1).repeat_interleave(n_rep, dim=0)
        visible = torch.ones(e - s, P + e - s, dtype=torch.bool, device=q.device).tril(P)  # key j <= P + i
        if P == 0:
            ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        else:
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=visible, scale=scale)
        out[s:e] = ob.transpose(0, 1)
        if return_lse:
            sc = (qb.to(lse_dtype) @ kb.to(lse_dtype).transpose(1, 2)) * scale  # (Hq, L, P + L)
            lse[:, s:e] = torch.logsumexp(sc.masked_fill(~visible, float("-inf")), dim=-1)
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
                               *, return_lse: bool = False, prefix: SharedPrefix | None = None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float64 if q.dtype == torch.float64
                     else torch.float32, device=q.device)
    for s, e, ps, P in _segments(cu_seqlens, prefix):
        if e > s:  # a shared prefix: the unshared sequence's keys, so the same bits (attend_exact_ref)
            out[s:e], lse[:, s:e] = attend_exact_ref(q[s:e], _with_prefix(k, s, e, ps, P),
                                                     _with_prefix(v, s, e, ps, P),
                                                     torch.arange(P, P + e - s, device=q.device), scale)
    return (out, lse) if return_lse else out


def exact_tile_rows(itemsize: int) -> int:
    """Query rows of the one exact-numerics attention tile (`exact_config` in the Triton half):
    32 in fp32, 64 in 16-bit. A decode step fills the rows with one sequence's GQA group of
    query heads, so a group larger than this cannot keep the tile, and the bits."""
    return 32 if itemsize == 4 else 64


def gqa_group(n_heads: int, n_kv_heads: int) -> int:
    """Query heads per KV head rounded up to a power of two: the rows one sequence's GQA
    group takes in a decode tile (the kernels' GROUP)."""
    return 1 << (n_heads // n_kv_heads - 1).bit_length()


def check_exact_attention(n_heads: int, n_kv_heads: int, dtype: torch.dtype, where: str) -> None:
    """ValueError, at engine start, where the exact Triton attention tile cannot hold a GQA
    group of query heads (issue 32: exact numerics refuses a shape rather than drift)."""
    group = gqa_group(n_heads, n_kv_heads)
    rows = exact_tile_rows(torch.empty((), dtype=dtype).element_size())
    if group > rows:
        raise ValueError(f"{where}: numerics 'exact' on the Triton kernels needs at most {rows} query heads per KV "
                         f"head in {dtype} (the exact attention tile's rows); the model has num_attention_heads "
                         f"{n_heads} over num_key_value_heads {n_kv_heads}. Use numerics 'fast', or "
                         f"kernel_backend 'torch' (exact at any group, slower)")


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
                     *, return_lse: bool = False, prefix: SharedPrefix | None = None):
    """Public op (contract in the module docstring); picks the backend and the numerics.
    `max_seqlen`: the longest segment's own rows (a shared prefix not counted)."""
    exact = is_exact()
    if resolve_backend("varlen_attention", q) == "triton":
        _check(q, k, v, cu_seqlens)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        o, lse = triton_ops("attention.triton_varlen").varlen_attention(q, k, v, cu_seqlens, int(max_seqlen), scale, exact,
                                                          prefix)
        return (o, lse) if return_lse else o
    ref = varlen_attention_exact_ref if exact else varlen_attention_ref
    return ref(q, k, v, cu_seqlens, max_seqlen, scale, return_lse=return_lse, prefix=prefix)
