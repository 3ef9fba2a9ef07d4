"""Packing sequences into micro-batches by token budget, and the packed tensors a
training forward needs.

`pack_by_tokens(lengths, budget)` (defined beside `Packed` in rlfuse.model.transformer,
where the consistency check uses it too): greedy in the given order; a micro-batch takes
sequences while its token count stays <= budget; a longer sequence goes alone.

`PackedBatch.build(seqs)`: seqs = [(ids, n_ctx)] where the targets of sequence b are
ids[n_ctx:], predicted from hidden rows start_b + n_ctx - 1 ... start_b + len - 2.
Tensors: input_ids (T,), positions (T,), Packed(cu_seqlens, max_seqlen), rows (N,),
targets (N,), seq_ids (N,) -- N = total target tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from rlfuse.model import Packed
from rlfuse.model.transformer import pack_by_tokens  # noqa: F401 (the trainers' import path)


@dataclasses.dataclass(slots=True)
class PackedBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    attn: Packed
    rows: torch.Tensor       # (N,) int64 hidden row predicting each target
    targets: torch.Tensor    # (N,) int64
    seq_ids: torch.Tensor    # (N,) int64 in [0, num_seqs)
    num_seqs: int
    num_tokens: int          # T

    @classmethod
    def build(cls, seqs: list[tuple[list[int], int]], device) -> "PackedBatch":
        ids, pos, rows, tgt, sid, lens = [], [], [], [], [], []
        start = 0
        for b, (s, n_ctx) in enumerate(seqs):
            if not 1 <= n_ctx <= len(s):
                raise ValueError(f"sequence {b}: context length {n_ctx} must be in [1, {len(s)}]")
            ids += s
            pos += range(len(s))
            rows += range(start + n_ctx - 1, start + len(s) - 1)
            tgt += s[n_ctx:]
            sid += [b] * (len(s) - n_ctx)
            lens.append(len(s))
            start += len(s)

        def t(x):
            return torch.tensor(x, dtype=torch.long).to(device, non_blocking=True)

        return cls(t(ids), t(pos), Packed.from_lengths(lens, device), t(rows), t(tgt), t(sid), len(seqs), start)
