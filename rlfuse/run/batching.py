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
Images (a sequence given as (ids, n_ctx, media): its MediaItems; vision models): positions are (3, T) mRoPE
rows, each sequence's the engine's (`rlfuse.engine.media.prompt_positions` over its ids),
`images` lists the image-pad runs in packed order, and `batch.forward(model)` passes their
features, each image encoded alone as the engine does (`encode_images`): exact numerics
holds for image prompts too.

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

from rlfuse.engine import encode_images, prompt_positions
from rlfuse.model import (
    Packed,
    pack_by_tokens,  # noqa: F401 (the trainers' import path)
)


def shared_contexts(seqs: list[tuple], share_min: int) -> list[int]:
    """shared[i] = n_ctx of sequence i when its context ids[:n_ctx] equals sequence i-1's
    (same ids, same length, at least share_min >= 1 tokens, the same images), else 0: the
    tokens `PackedBatch.build(share_min=...)` packs once for both. share_min 0: none shared."""
    out = [0] * len(seqs)
    for i in range(1, len(seqs) if share_min > 0 else 0):
        (a, na), (b, nb) = seqs[i - 1][:2], seqs[i][:2]
        if na == nb >= share_min and a[:na] == b[:nb] and _hashes(seqs[i - 1]) == _hashes(seqs[i]):
            out[i] = nb
    return out


def _hashes(seq: tuple) -> list[bytes]:
    return [m.media_hash for m in seq[2]] if len(seq) > 2 else []


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
    images: tuple = ()
    """The MediaItems of the image-pad runs of input_ids, in packed order (image rows)."""

    def forward(self, model):
        """model(input_ids, positions, attn, image features): hidden (T, D). The features come
        from `rlfuse.engine.media.encode_images`, the engine's own encode; without autograd
        unless the vision tower trains (model.train_vision)."""
        feats = None
        if self.images:
            # no-grad forwards (old / reference log-probs) may run on a LoRA base view: no .visual read
            grad = torch.is_grad_enabled() and any(p.requires_grad for p in model.visual.parameters())
            with torch.set_grad_enabled(grad):
                feats = encode_images(model, list(self.images))
        return model(self.input_ids, self.positions, self.attn, feats)

    @classmethod
    def build(cls, seqs: list[tuple], device, share_min: int = 0, vision=None) -> "PackedBatch":
        """seqs: (ids, n_ctx) or (ids, n_ctx, media): the sequence's images (MediaItems, offsets
        into its ids). share_min > 0: pack equal contexts of at least this many tokens once
        (module docstring). With images, `vision` (the model's ModelConfig.vision) gives the
        positions: (3, T) mRoPE rows, the engine's."""
        ids, pos, rows, tgt, sid, lens, prefix_of = [], [], [], [], [], [], []
        media = [s[2] if len(s) > 2 else () for s in seqs]
        media = media if any(media) else None
        shared = shared_contexts(seqs, share_min)
        pos3, images = [], []

        def seg(b, lo, hi):  # sequence b's tokens [lo, hi) packed next: their mRoPE rows and images
            if media is None:
                return
            pos3.append(_positions(seqs[b][0], media[b], vision, b)[:, lo:hi])
            for m in media[b]:
                if lo <= m.offset < hi:
                    assert m.end <= hi, f"sequence {b}: a packed segment cuts image [{m.offset}, {m.end})"
                    images.append(m)
        start = 0
        ctx_seg = ctx_last = -1  # the current group's context segment and its last row
        for b, (s, n_ctx, *_) in enumerate(seqs):
            if not 1 <= n_ctx <= len(s):
                raise ValueError(f"sequence {b}: context length {n_ctx} must be in [1, {len(s)}]")
            heads = b + 1 < len(seqs) and shared[b + 1] and not shared[b]
            if heads:  # the group's context, once: a segment of its own with no targets
                seg(b, 0, n_ctx)
                ids += s[:n_ctx]
                pos += range(n_ctx)
                lens.append(n_ctx)
                prefix_of.append(None)
                ctx_seg, ctx_last = len(lens) - 1, start + n_ctx - 1
                start += n_ctx
            if heads or shared[b]:  # a completion reading the context's keys
                seg(b, n_ctx, len(s))
                ids += s[n_ctx:]
                pos += range(n_ctx, len(s))
                if len(s) > n_ctx:
                    rows += [ctx_last, *range(start, start + len(s) - n_ctx - 1)]
                lens.append(len(s) - n_ctx)
                prefix_of.append(ctx_seg)
                start += len(s) - n_ctx
            else:
                seg(b, 0, len(s))
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

        positions = t(pos) if media is None else torch.cat(pos3, 1).to(device, non_blocking=True)
        return cls(t(ids), positions, Packed.from_lengths(lens, device, prefix_of), t(rows), t(tgt), t(sid),
                   len(seqs), start, tuple(images))


def _positions(ids: list[int], media, vision, b: int) -> torch.Tensor:
    """(3, len(ids)) mRoPE rows of one sequence (a text one: three equal rows)."""
    if vision is None:
        raise ValueError(f"sequence {b}: images given for a model without a vision tower")
    return prompt_positions(ids, tuple(media), vision)[0]
