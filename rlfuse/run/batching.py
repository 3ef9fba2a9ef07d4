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

Shared prefixes (`share_min=n > 0`, GRPO's `grpo.share_prefix`, and the split samples of one
agent episode): a run of consecutive sequences whose contexts start with the same n or more
token ids (a GRPO group: one prompt, G completions; an agent episode's split calls: a
growing history) packs as [trunk, rest_1, ..., rest_k]: the trunk is the run's longest
context that extends the others (`share_plan`), once, with no targets; sequence i keeps
ids[p_i:], where p_i <= n_ctx_i is the length of its common prefix with the trunk, its
positions continue from p_i and its attention reads the trunk's first p_i keys first
(`rlfuse.kernels.attention.varlen.SharedPrefix`); a target at position p_i is predicted
from the trunk's row p_i - 1, the others from its own rows. The targets, seq_ids and their
order are those of the unshared batch, and so, in exact numerics, are the log-probs, bit for
bit (tests/test_prefix_sharing.py); the gradients agree to rounding (docs/numerics.md).
`link[i]` (optional) limits a run to sequences with equal keys: the update shares an agent
episode's split samples with one another even where grpo.share_prefix is off.
"""

from __future__ import annotations

import dataclasses

import torch

from rlfuse.engine import encode_images, prompt_positions
from rlfuse.model import (
    Packed,
    pack_by_tokens,  # noqa: F401 (the trainers' import path)
)


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def share_plan(seqs: list[tuple], share_min: int, link: list | None = None):
    """The shared-prefix layout of `seqs` (the module docstring): (runs, trunks, p), runs as
    lists of consecutive indices (a run of one shares nothing), trunks[r] the ids packed once
    for run r (empty for a run of one), p[i] the trunk keys sequence i reads (0: none).
    share_min 0 and no link: nothing shared. A sequence joins the run before it when its
    context and the trunk agree on >= max(share_min, 1) ids and (with `link`) its key equals
    the previous sequence's, and its images (seqs[i][2], if any) are the previous one's: the
    image-pad ids of two different images are equal; where its context extends the trunk,
    the trunk grows to it."""
    runs, trunks, p = [], [], [0] * len(seqs)
    for i, (ids, n_ctx, *_) in enumerate(seqs):
        ctx = ids[:n_ctx]
        join = bool(runs) and (share_min > 0 or link is not None) and (link is None or link[i] == link[i - 1])
        join = join and _hashes(seqs[i]) == _hashes(seqs[i - 1])
        if join:
            n = _common(ctx, trunks[-1])
            join = n >= max(share_min, 1)
        if not join:
            runs.append([i])
            trunks.append(ctx)
            continue
        if n == len(trunks[-1]) and n_ctx > n:
            trunks[-1] = ctx
        runs[-1].append(i)
    for r, run in enumerate(runs):
        if len(run) == 1:
            trunks[r] = []
        for i in run if len(run) > 1 else ():
            p[i] = min(_common(seqs[i][0][:seqs[i][1]], trunks[r]), seqs[i][1])
    return runs, trunks, p


def shared_contexts(seqs: list[tuple], share_min: int, link: list | None = None) -> list[int]:
    """shared[i]: the tokens sequence i saves when packed in one micro-batch with sequence
    i - 1 under `share_plan` (its trunk keys, less what it grows the trunk by); the first of a
    run saves 0. `pack_by_tokens`'s discount."""
    runs, _, p = share_plan(seqs, share_min, link)
    out = [0] * len(seqs)
    for run in runs:
        trunk = seqs[run[0]][1] if len(run) > 1 else 0
        for i in run[1:]:
            grown = max(seqs[i][1] - trunk, 0) if p[i] == seqs[i][1] else 0
            out[i] = p[i] - grown
            trunk += grown
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
    def build(cls, seqs: list[tuple], device, share_min: int = 0, link: list | None = None,
              seq_of: list[int] | None = None, vision=None) -> "PackedBatch":
        """seqs: (ids, n_ctx) or (ids, n_ctx, media): the sequence's images (MediaItems, offsets
        into its ids). share_min > 0 or link: pack shared prefixes once (module docstring,
        `share_plan`). seq_of[b]: the loss's sequence index of sequence b (default b; several
        pieces of one episode may count as one sequence); num_seqs is then max(seq_of) + 1.
        With images, `vision` (the model's ModelConfig.vision) gives the positions: (3, T)
        mRoPE rows, the engine's."""
        ids, pos, rows, tgt, sid, lens, prefix_of, plen = [], [], [], [], [], [], [], []
        media = [s[2] if len(s) > 2 else () for s in seqs]
        media = media if any(media) else None
        pos3, images = [], []

        def seg(s, items, b, lo, hi):  # tokens [lo, hi) of ids s (sequence b's) packed next: mRoPE rows, images
            if media is None:
                return
            pos3.append(_positions(s, items, vision, b)[:, lo:hi])
            for m in items:
                if lo <= m.offset < hi:
                    assert m.end <= hi, f"sequence {b}: a packed segment cuts image [{m.offset}, {m.end})"
                    images.append(m)
        for b, (s, n_ctx, *_) in enumerate(seqs):
            if not 1 <= n_ctx <= len(s):
                raise ValueError(f"sequence {b}: context length {n_ctx} must be in [1, {len(s)}]")
        runs, trunks, p = share_plan(seqs, share_min, link)
        start = 0
        for run, trunk in zip(runs, trunks):
            if trunk:  # the run's trunk, once: a segment of its own with no targets
                b0 = run[0]  # a run's images are equal (share_plan): the trunk holds those inside it
                seg(trunk, [m for m in media[b0] if m.end <= len(trunk)] if media else (), b0, 0, len(trunk))
                ids += trunk
                pos += range(len(trunk))
                lens.append(len(trunk))
                prefix_of.append(None)
                plen.append(None)
                trunk_seg, trunk_row0 = len(lens) - 1, start
                start += len(trunk)
            for b in run:
                s, n_ctx = seqs[b][:2]
                q = p[b]  # trunk keys read first (0: an unshared sequence)
                seg(s, media[b] if media else (), b, q, len(s))
                ids += s[q:]
                pos += range(q, len(s))
                if len(s) > n_ctx:  # target t at position n_ctx + k is predicted from position n_ctx + k - 1
                    first = trunk_row0 + q - 1 if q == n_ctx else start + n_ctx - q - 1
                    rows += [first, *range(start + n_ctx - q, start + len(s) - q - 1)]
                lens.append(len(s) - q)
                prefix_of.append(trunk_seg if q else None)
                plen.append(q or None)
                start += len(s) - q
                tgt += s[n_ctx:]
                sid += [b if seq_of is None else seq_of[b]] * (len(s) - n_ctx)

        def t(x):
            return torch.tensor(x, dtype=torch.long).to(device, non_blocking=True)

        positions = t(pos) if media is None else torch.cat(pos3, 1).to(device, non_blocking=True)
        return cls(t(ids), positions, Packed.from_lengths(lens, device, prefix_of, plen), t(rows), t(tgt), t(sid),
                   len(seqs) if seq_of is None else (max(seq_of) + 1 if seq_of else 0), start, tuple(images))


def _positions(ids: list[int], media, vision, b: int) -> torch.Tensor:
    """(3, len(ids)) mRoPE rows of one sequence (a text one: three equal rows)."""
    if vision is None:
        raise ValueError(f"sequence {b}: images given for a model without a vision tower")
    return prompt_positions(ids, tuple(media), vision)[0]
