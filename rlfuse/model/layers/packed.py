"""How a forward's tokens are laid out, the attention metadata every layer receives as an
explicit argument (no global context): `Packed` (causal attention within packed sequences:
training, evaluation, the naive generator; optionally a group's shared prompt packed once)
and `PagedKV` (the engine's paged KV cache: prefill chunks and decode); `pack_by_tokens`
groups sequences into micro-batches by a token budget.

Shape legend: T packed tokens, B sequences, Hkv kv heads, Dh head dim.
"""

from __future__ import annotations

import dataclasses

import torch

from rlfuse.kernels.attention.paged import SharedPrefixDecode
from rlfuse.kernels.attention.varlen import SharedPrefix
from rlfuse.kernels.kv_quant import KVQuant


@dataclasses.dataclass(slots=True)
class Packed:
    """Causal attention within packed sequences: rows cu_seqlens[b]:cu_seqlens[b+1]; with
    `prefix`, segment b also reads a shared prefix segment first (SharedPrefix); with
    `kv_quant`, attention reads K and V as an fp8 KV cache gives them back (`KVQuant.apply`:
    the trainer of an engine with an fp8 cache; `CausalLM.kv_quant` fills it in)."""
    cu_seqlens: torch.Tensor  # (B+1,) int32
    max_seqlen: int
    prefix: SharedPrefix | None = None
    kv_quant: KVQuant | None = None

    @classmethod
    def from_lengths(cls, lengths: list[int], device=None, prefix_of: list[int | None] | None = None,
                     prefix_len: list[int | None] | None = None) -> "Packed":
        """prefix_of[b]: the segment that segment b reads as its shared prefix (None = none);
        prefix_len[b]: how many of its first keys (None or not given: all)."""
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
        prefix = None
        if prefix_of is not None and any(p is not None for p in prefix_of):
            prefix = SharedPrefix.from_groups(lengths, prefix_of, device, prefix_len)
        return cls(cu.to(device), max(lengths) if lengths else 0, prefix)


def pack_by_tokens(lengths: list[int], budget: int, shared: list[int] | None = None) -> list[list[int]]:
    """Sequence indices grouped into micro-batches of at most `budget` tokens, greedily in
    order (deterministic, so accumulated sums add up in a fixed order); a sequence longer
    than the budget goes alone. `shared[i]`: tokens of sequence i packed once with sequence
    i - 1 when both share a micro-batch (a shared prompt), so it costs lengths[i] - shared[i]."""
    if budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    batches: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if shared is not None and cur and cur[-1] == i - 1:
            n -= shared[i]
        if cur and used + n > budget:
            batches.append(cur)
            cur, used = [], 0
            n = lengths[i]
        cur.append(i)
        used += n
    if cur:
        batches.append(cur)
    return batches


@dataclasses.dataclass(slots=True)
class PagedKV:
    """Attention against the engine's paged KV cache (see `rlfuse.kernels.attention.paged`).
    The new tokens' K/V are written at `slot_mapping` before attention reads the cache."""
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (num_blocks, block_size, Hkv, Dh)
    slot_mapping: torch.Tensor  # (T,) int64, -1 = padding row
    cu_seqlens_q: torch.Tensor  # (B+1,) int32
    seq_lens: torch.Tensor      # (B,) int32, cached tokens after this step
    block_tables: torch.Tensor  # (B, max_blocks) int32
    max_seqlen_q: int
    shared: SharedPrefixDecode | None = None  # decode: prompt prefixes read once per group
    linear: "LinearSlots | LinearDecode | None" = None  # hybrid models: the linear-attention layers' state
    kv_quant: KVQuant | None = None  # an fp8 cache's scales (`CausalLM.kv_quant` fills it in)


TAIL = ("q", "k", "v", "g", "beta")
"""The per-token kernel inputs a linear-attention layer buffers since its last chunk boundary."""


@dataclasses.dataclass(slots=True)
class LinearSlots:
    """The linear-attention layers' per-sequence state in an engine step (the tensors are
    owned by `rlfuse.engine.cache.linear.LinearStateCache`; the layers read and update them
    in place). Per layer: conv (R, C, W-1), and in exact numerics chunk (R, Hv, Dk, Dv) fp32
    = S_c and the tail buffer q, k (R, CHUNK, Hk, Dk), v (R, CHUNK, Hv, Dv), g (R, CHUNK, Hv)
    fp32, beta (R, CHUNK, Hv): the rows since S_c's boundary (`tail_lens[b]` of them); in
    fast numerics recurrent (R, Hv, Dk, Dv) fp32, the state after the last token (no tail:
    tail_lens are 0 and read_at / write_at empty)."""
    layers: dict[int, dict[str, torch.Tensor]]
    slots: torch.Tensor          # (B,) int64 each sequence's slot
    new_lens: list[int]          # (B,) tokens each sequence computes this step
    tail_lens: list[int]         # (B,) buffered rows before the step: num_computed % CHUNK
    read_at: tuple[torch.Tensor, torch.Tensor]   # (slot, row) of each buffered row, sequence order
    write_at: tuple[torch.Tensor, torch.Tensor]  # (slot, row) of each row buffered after the step

    @classmethod
    def make(cls, layers, slots: list[int], new_lens: list[int], tail_lens: list[int], chunk: int,
             device) -> "LinearSlots":
        """chunk: the tail buffer's length (exact numerics), 0 for none (fast)."""
        after = [(t + n) % chunk if chunk else 0 for t, n in zip(tail_lens, new_lens)]

        def at(lens):
            s = [sl for sl, n in zip(slots, lens) for _ in range(n)]
            r = [i for n in lens for i in range(n)]
            return (torch.tensor(s, dtype=torch.long).to(device), torch.tensor(r, dtype=torch.long).to(device))
        return cls(layers, torch.tensor(slots, dtype=torch.long).to(device), list(new_lens), list(tail_lens),
                   at(tail_lens), at(after))


@dataclasses.dataclass(slots=True)
class LinearDecode:
    """The linear-attention state in a STATIC decode step (every row computes one token;
    CUDA-graph capturable): no host lists, only device tensors of the bucket's fixed size.
    Exact numerics: a row's buffered tail length is its token's index % CHUNK (chunks are
    aligned to a sequence's first token), computed on the device from `index` -- the index,
    not the RoPE position: an image prompt's mRoPE positions are index + delta (delta < 0).
    Padding rows point at the cache's scratch slot (`LinearStateCache.pad_slot`)."""
    layers: dict[int, dict[str, torch.Tensor]]
    slots: torch.Tensor          # (B,) int64 each row's slot
    index: torch.Tensor          # (B,) int64 each row's token index in its sequence (padding rows: 0)
