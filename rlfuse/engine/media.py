"""Images in a prompt: what a sequence carries, how blocks covering image tokens are keyed,
the multimodal RoPE positions, and the per-step cache of vision-tower features.

A prompt with images holds, per image, a run of `num_tokens` image-pad ids (the chat
template's `<|vision_start|>` + n x `<|image_pad|>` + `<|vision_end|>`; only the pads are the
image) starting at `offset`, and a `MediaItem`: the processor's `pixel_values`
(patches, C * temporal_patch * patch^2), its `grid_thw` and a `media_hash` (sha256 of the
decoded pixels and their size). n = grid_t * grid_h * grid_w / merge_size^2.

Rules (the issue-40 bug list they prevent, in brackets):
  * prefix cache: a full block's key chains, after its token ids, the media hashes of the
    images whose pad run overlaps it (`block_media`), so two prompts with equal ids but
    different images never share K/V; every later block differs through the chain
    [image features that do not match the image tokens];
  * positions (`mrope_positions`, Qwen2/3-VL's rule): text tokens advance all three axes
    (t, h, w) together; an image of merged grid (t, h / m, w / m) takes
    start + (t_i, h_i, w_i) and the text after it resumes at start + max(h, w) / m. They are computed once
    at admission; a token at index i >= len(prompt) has position i + `delta` on every axis
    (delta = max position + 1 - len(prompt)), never re-derived from the ids
    [the rollout emitting image-pad tokens that crash the position code];
  * sampling: the image-pad, vision-start and vision-end ids are never sampled
    (`never_sampled_ids`: their logits are -inf in the sampler; the reported log-prob is the
    unfiltered policy's, like top-k's);
  * encodes: `FeatureCache` runs the tower once per distinct media hash while any live
    sequence refers to it (a GRPO group's n samples share one encode), counting encodes for
    the `vision/encodes` metric.
Test: python -m pytest -q tests/test_vision_engine.py
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class MediaItem:
    """One image of a prompt, preprocessed: the tower's input and where its tokens are."""
    pixel_values: torch.Tensor
    """(patches, C * temporal_patch * patch^2) float32, the processor's output."""
    grid_thw: tuple[int, int, int]
    """Patch grid (t, h, w) before the merger."""
    media_hash: bytes
    """sha256 of the decoded pixels (mode, size, bytes): equal images, equal hash."""
    offset: int
    """Index in the prompt ids of its first image-pad token."""
    num_tokens: int
    """Image-pad tokens: t * h * w / merge_size^2."""

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def media_hash(mode: str, size: tuple[int, int], pixels: bytes) -> bytes:
    """The key of a decoded image (PIL's mode, size and raw bytes)."""
    h = hashlib.sha256(f"{mode}:{size[0]}x{size[1]}:".encode())
    h.update(pixels)
    return h.digest()


def check_media(media: tuple[MediaItem, ...], ids: list[int], image_pad_id: int, where: str) -> None:
    """Each item's pad run lies in `ids`, in order, not overlapping, and every image-pad id of
    `ids` belongs to one: a ValueError naming `where` otherwise."""
    covered = 0
    prev_end = 0
    for k, m in enumerate(media):
        if m.offset < prev_end or m.end > len(ids):
            raise ValueError(f"{where}: image {k} spans tokens [{m.offset}, {m.end}), outside the prompt "
                             f"({len(ids)} tokens) or overlapping image {k - 1}")
        if any(t != image_pad_id for t in ids[m.offset:m.end]):
            raise ValueError(f"{where}: image {k} spans tokens [{m.offset}, {m.end}) that are not all the "
                             f"image-pad id {image_pad_id}")
        covered += m.num_tokens
        prev_end = m.end
    n_pad = sum(1 for t in ids if t == image_pad_id)
    if n_pad != covered:
        raise ValueError(f"{where}: the prompt holds {n_pad} image-pad tokens but its {len(media)} images "
                         f"account for {covered}")


def block_media(media: tuple[MediaItem, ...], block: int, block_size: int) -> bytes:
    """The media hashes of the images overlapping tokens [block * B, (block + 1) * B), in
    order: the extra bytes of that block's prefix-cache key (b"" for a text-only block)."""
    lo, hi = block * block_size, (block + 1) * block_size
    return b"".join(m.media_hash for m in media if m.offset < hi and m.end > lo)


def media_key(media: tuple[MediaItem, ...]) -> bytes:
    """All the prompt's media hashes (the sampling key's extra bytes: prompts with equal ids
    and different images draw differently)."""
    return b"".join(m.media_hash for m in media)


# ---------------------------------------------------------------------- positions
def mrope_positions(num_tokens: int, media: tuple[MediaItem, ...], merge_size: int) -> tuple[torch.Tensor, int]:
    """((3, num_tokens) int64 positions (t, h, w) of a prompt, delta): the module docstring's
    rule. Text-only: every axis is arange(num_tokens) and delta is 0."""
    pos = torch.empty((3, num_tokens), dtype=torch.int64)
    at, nxt = 0, 0  # next token index, next free position
    for m in media:
        n_text = m.offset - at
        pos[:, at:m.offset] = torch.arange(nxt, nxt + n_text)
        nxt += n_text
        t, h, w = m.grid_thw[0], m.grid_thw[1] // merge_size, m.grid_thw[2] // merge_size
        assert t * h * w == m.num_tokens, (m.grid_thw, merge_size, m.num_tokens)
        ti = torch.arange(t).repeat_interleave(h * w)
        hi = torch.arange(h).repeat_interleave(w).repeat(t)
        wi = torch.arange(w).repeat(t * h)
        pos[:, m.offset:m.end] = torch.stack((ti, hi, wi)) + nxt
        nxt += max(h, w)  # transformers' rule (the t axis is 0 for an image: t = 1)
        at = m.end
    pos[:, at:] = torch.arange(nxt, nxt + num_tokens - at)
    nxt += num_tokens - at
    return pos, nxt - num_tokens


def decode_positions(index: int, delta: int) -> tuple[int, int, int]:
    """(t, h, w) position of the token at `index` >= len(prompt): index + delta on each axis."""
    p = index + delta
    return p, p, p


def never_sampled_ids(config) -> tuple[int, ...]:
    """The vision special ids of a model config's vision tower (`ModelConfig.vision`: image
    pad, vision start / end, video pad): never sampled. Text-only configs have none."""
    vision = getattr(config, "vision", None)  # ModelConfig.vision arrives with the Qwen3-VL model (vlm-model)
    if vision is None:
        return ()
    names = ("image_token_id", "vision_start_token_id", "vision_end_token_id", "video_token_id")
    return tuple(sorted({v for v in (getattr(vision, n, None) for n in names) if isinstance(v, int)}))


# ---------------------------------------------------------------------- features
Encode = Callable[[MediaItem], tuple[torch.Tensor, ...]]
"""The vision tower on one image: a tuple of (num_tokens, D) tensors (the merged features,
then any per-layer DeepStack features), row j for the image's j-th pad token."""


class FeatureCache:
    """Vision features by media hash, computed once while any sequence holds the image.

    `acquire(media)` for a sequence admitted with them, `release(media)` when it is freed
    (finish, preemption, abort); `features(item)` encodes on first use. `encodes` counts
    tower runs since the last `take_encodes()` (the step metric `vision/encodes`)."""

    def __init__(self, encode: Encode):
        self.encode = encode
        self._feats: dict[bytes, tuple[torch.Tensor, ...]] = {}
        self._refs: dict[bytes, int] = {}
        self.encodes = 0

    def acquire(self, media: tuple[MediaItem, ...]) -> None:
        for m in media:
            self._refs[m.media_hash] = self._refs.get(m.media_hash, 0) + 1

    def release(self, media: tuple[MediaItem, ...]) -> None:
        for m in media:
            n = self._refs[m.media_hash] - 1
            if n:
                self._refs[m.media_hash] = n
            else:
                del self._refs[m.media_hash]
                self._feats.pop(m.media_hash, None)

    def features(self, item: MediaItem) -> tuple[torch.Tensor, ...]:
        assert item.media_hash in self._refs, "features of an image no live sequence holds"
        f = self._feats.get(item.media_hash)
        if f is None:
            f = tuple(self.encode(item))
            assert all(x.shape[0] == item.num_tokens for x in f), ([x.shape for x in f], item.num_tokens)
            self._feats[item.media_hash] = f
            self.encodes += 1
        return f

    def chunk(self, media: tuple[MediaItem, ...], start: int, n: int) -> list[tuple[int, int, MediaItem]]:
        """The image rows a prefill chunk of tokens [start, start + n) needs:
        [(row in the chunk, first feature row, count, item)] per overlapping image."""
        out = []
        for m in media:
            lo, hi = max(start, m.offset), min(start + n, m.end)
            if lo < hi:
                out.append((lo - start, lo - m.offset, hi - lo, m))
        return out

    def chunk_features(self, media: tuple[MediaItem, ...], start: int, n: int
                       ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """(rows (k,) int64 indices into the chunk, [(k, D) features per feature kind]) for the
        image tokens of tokens [start, start + n), or None when the chunk has none."""
        parts = self.chunk(media, start, n)
        if not parts:
            return None
        rows = torch.cat([torch.arange(r, r + c) for r, _, c, _ in parts])
        feats = [self.features(m) for _, _, _, m in parts]
        kinds = len(feats[0])
        out = [torch.cat([f[k][a:a + c] for f, (_, a, c, _) in zip(feats, parts)]) for k in range(kinds)]
        return rows, out

    def take_encodes(self) -> int:
        n, self.encodes = self.encodes, 0
        return n

    @property
    def live(self) -> int:
        """Distinct images held."""
        return len(self._refs)
