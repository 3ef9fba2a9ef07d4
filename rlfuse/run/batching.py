"""Packing sequences into micro-batches by token budget, and the packed tensors a
training forward needs.

`pack_by_tokens(lengths, budget, shared=None)` (defined beside `Packed` in
rlfuse.model.layers.packed, where the consistency check uses it too): greedy in the given
order; a micro-batch takes sequences while its token count stays <= budget; a longer
sequence goes alone; `shared` (from `shared_contexts`) discounts a shared prompt.

`PackedBatch.build(seqs)`: seqs = [(ids, n_ctx)] where the targets of sequence b are
ids[n_ctx:], predicted from hidden rows start_b + n_ctx - 1 ... start_b + len - 2.
Tensors: input_ids (T,), positions (T,), Packed(cu_seqlens, max_seqlen), rows (N,),
targets (N,), seq_ids (N,) -- N = total target tokens.

Shared prompts (`share_min=n > 0`, GRPO's `grpo.share_prefix`): consecutive sequences
whose contexts are the same n or more token ids (a GRPO group: one prompt, G completions)
pack as [context, completion_1, ..., completion_G], the context once. Completion g's positions
continue from n_ctx and its attention reads the context's keys first
(`rlfuse.kernels.attention.varlen.SharedPrefix`); its first target is predicted from the
context's last row, the others from its own rows. The targets, seq_ids and their order are
those of the unshared batch, and so, in exact numerics, are the log-probs, bit for bit
(tests/test_prefix_sharing.py); the gradients agree to rounding (docs/numerics.md).
"""

from __future__ import annotations

import dataclasses

import torch

from rlfuse.model import (
    Packed,
    pack_by_tokens,  # noqa: F401 (the trainers' import path)
)


def shared_contexts(seqs: list[tuple[list[int], int]], share_min: int) -> list[int]:
    """shared[i] = n_ctx of sequence i when its context ids[:n_ctx] equals sequence i-1's
    (same ids, same length, at least share_min >= 1 tokens), else 0: the tokens
    `PackedBatch.build(share_min=...)` packs once for both. share_min 0: none shared."""
    out = [0] * len(seqs)
    for i in range(1, len(seqs) if share_min > 0 else 0):
        (a, na), (b, nb) = seqs[i - 1], seqs[i]
        if na == nb >= share_min and a[:na] == b[:nb]:
            out[i] = nb
    return out


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
    def build(cls, seqs: list[tuple[list[int], int]], device, share_min: int = 0) -> "PackedBatch":
        """share_min > 0: pack equal contexts of at least this many tokens once (module docstring)."""
        ids, pos, rows, tgt, sid, lens, prefix_of = [], [], [], [], [], [], []
        shared = shared_contexts(seqs, share_min)
        start = 0
        ctx_seg = ctx_last = -1  # the current group's context segment and its last row
        for b, (s, n_ctx) in enumerate(seqs):
            if not 1 <= n_ctx <= len(s):
                raise ValueError(f"sequence {b}: context length {n_ctx} must be in [1, {len(s)}]")
            heads = b + 1 < len(seqs) and shared[b + 1] and not shared[b]
            if heads:  # the group's context, once: a segment of its own with no targets
                ids += s[:n_ctx]
                pos += range(n_ctx)
                lens.append(n_ctx)
                prefix_of.append(None)
                ctx_seg, ctx_last = len(lens) - 1, start + n_ctx - 1
                start += n_ctx
            if heads or shared[b]:  # a completion reading the context's keys
                ids += s[n_ctx:]
                pos += range(n_ctx, len(s))
                if len(s) > n_ctx:
                    rows += [ctx_last, *range(start, start + len(s) - n_ctx - 1)]
                lens.append(len(s) - n_ctx)
                prefix_of.append(ctx_seg)
                start += len(s) - n_ctx
            else:
                ids += s
                pos += range(len(s))
                rows += range(start + n_ctx - 1, start + len(s) - 1)
                lens.append(len(s))
                prefix_of.append(None)
                start += len(s)
            tgt += s[n_ctx:]
            sid += [b] * (len(s) - n_ctx)

        def t(x):
            return torch.tensor(x, dtype=torch.long).to(device, non_blocking=True)

        return cls(t(ids), t(pos), Packed.from_lengths(lens, device, prefix_of), t(rows), t(tgt), t(sid),
                   len(seqs), start)
