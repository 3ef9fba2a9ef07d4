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
  * positions (`prompt_positions`: the model's rlfuse.model.vision.mrope_positions, Qwen3-VL's
    rule) are computed once per request and carried by its sequences; a token at index
    i >= len(prompt) has position i + `delta` on every axis (delta = max position + 1 -
    len(prompt)): one integer, the image layout is never re-derived from the ids
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

from rlfuse.model.vision import ImageFeatures, mrope_positions

IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
"""Qwen2/3-VL's image markers: start, pad (one per merged patch), end."""


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
def prompt_positions(ids: list[int], media: tuple[MediaItem, ...], vision) -> tuple[torch.Tensor, int]:
    """((3, len(ids)) int64 mRoPE positions of a prompt, delta) by the model's rule
    (rlfuse.model.vision.mrope_positions; `vision` is ModelConfig.vision): once per request."""
    grids = torch.tensor([m.grid_thw for m in media], dtype=torch.int64) if media else None
    return mrope_positions(torch.tensor(ids, dtype=torch.int64), grids, spatial_merge_size=vision.spatial_merge_size,
                           image_token_id=vision.image_token_id)


def encode_images(model, items: list[MediaItem]) -> ImageFeatures | None:
    """The features of `items` in order, for a packed forward (the engine encodes through it
    too): each distinct hash once, all of them in one tower call. In exact numerics the tower
    encodes image by image (`VisionTower.forward`), so an image's features are the same bits
    whatever else is in the call. Records autograd when grad is on and the tower trains."""
    if not items:
        return None
    dev, dtype = model.lm_head_weight.device, model.lm_head_weight.dtype
    distinct = list({m.media_hash: m for m in items}.values())
    grid = torch.tensor([m.grid_thw for m in distinct], dtype=torch.int64, device=dev)
    feats = model.encode_images(torch.cat([m.pixel_values for m in distinct]).to(dev, dtype), grid)
    done = dict(zip((m.media_hash for m in distinct), feats.split([m.num_tokens for m in distinct])))
    return ImageFeatures.cat([done[m.media_hash] for m in items])


def admit(rid: str, ids: list[int], media: tuple[MediaItem, ...], vision, architecture: str
          ) -> tuple[torch.Tensor, int] | None:
    """A request's images checked against its ids; its (mRoPE positions, delta), computed once
    for its n samples (None: a text-only model, `vision` None, which takes no images)."""
    if vision is None:
        if media:
            raise ValueError(f"request {rid!r}: {len(media)} images given but {architecture} has no vision tower")
        return None
    check_media(media, ids, vision.image_token_id, f"request {rid!r}")
    return prompt_positions(ids, media, vision)


def never_sampled_ids(config) -> tuple[int, ...]:
    """The vision special ids of a model config's vision tower (`ModelConfig.vision`: image
    pad, vision start / end, video pad): never sampled. Text-only configs have none."""
    vision = config.vision
    if vision is None:
        return ()
    names = ("image_token_id", "vision_start_token_id", "vision_end_token_id", "video_token_id")
    return tuple(sorted({v for v in (getattr(vision, n, None) for n in names) if isinstance(v, int)}))


# ---------------------------------------------------------------------- features
Encode = Callable[[list[MediaItem]], ImageFeatures]
"""The vision tower on some images (`encode_images`): their features in order."""


class FeatureCache:
    """Vision features by media hash, computed once while any sequence holds the image.

    `acquire(media)` for a sequence admitted with them, `release(media)` when it is freed
    (finish, abort); `features(item)` encodes on first use. `encodes` counts tower runs
    since the last `take_encodes()` (the step metric `vision/encodes`)."""

    def __init__(self, encode: Encode):
        self.encode = encode
        self._feats: dict[bytes, ImageFeatures] = {}
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

    def let_go(self, media: tuple[MediaItem, ...]) -> int:
        """`release(media)` (a finished or aborted sample's images), then `take_encodes()`."""
        if media:
            self.release(media)
        return self.take_encodes()

    def clear(self) -> None:
        """Forget every feature (the tower's weights changed); holders stay."""
        self._feats.clear()

    def prefetch(self, items) -> None:
        """Encode the images of `items` not cached yet, in one tower call."""
        new = list({m.media_hash: m for m in items if m.media_hash not in self._feats}.values())
        if new:
            for m, f in zip(new, self.encode(new).split([m.num_tokens for m in new])):
                assert m.media_hash in self._refs, "features of an image no live sequence holds"
                self._feats[m.media_hash] = f
            self.encodes += len(new)

    def features(self, item: MediaItem) -> ImageFeatures:
        self.prefetch([item])
        return self._feats[item.media_hash]

    def chunk_features(self, media: tuple[MediaItem, ...], start: int, n: int) -> list[ImageFeatures]:
        """The feature rows of the image tokens among tokens [start, start + n) (a prefill
        chunk), in token order: one slice per overlapping image."""
        out = []
        for m in media:
            lo, hi = max(start, m.offset), min(start + n, m.end)
            if lo < hi:
                out.append(self.features(m).narrow(lo - m.offset, hi - lo))
        return out

    def chunk_inputs(self, seqs, starts: list[int], num_new: list[int], pos_T: torch.Tensor
                     ) -> tuple[torch.Tensor, ImageFeatures | None]:
        """An engine step whose chunks hold image-prompt tokens: (3, T) positions (each
        prompt's own rows; index + delta after them; text-only sequences on all rows alike,
        from `pos_T` (T,)) and the features of the chunks' image tokens in token order (None
        if there are none). The step's new images are encoded in one tower call."""
        pos = pos_T.unsqueeze(0).repeat(3, 1)
        self.prefetch([m for s, st, n in zip(seqs, starts, num_new) if s.mrope is not None
                       for m in s.media if m.offset < st + n and m.end > st])
        feats, o = [], 0
        for s, st, n in zip(seqs, starts, num_new):
            if s.mrope is not None and st < s.num_prompt_tokens:
                k = min(n, s.num_prompt_tokens - st)
                pos[:, o:o + k] = s.mrope[0][:, st:st + k].to(pos.device)
                feats += self.chunk_features(s.media, st, k)
            o += n
        return pos, (ImageFeatures.cat(feats) if feats else None)

    def take_encodes(self) -> int:
        n, self.encodes = self.encodes, 0
        return n

    @property
    def live(self) -> int:
        """Distinct images held."""
        return len(self._refs)
