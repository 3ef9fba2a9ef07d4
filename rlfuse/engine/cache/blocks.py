"""KV-cache blocks: reference counts, a free list and prefix caching.

The KV pool is `num_blocks` blocks of `block_size` tokens. A sequence's block table lists
the blocks holding its tokens in order. A block is shared (ref_count > 1) when several
sequences start with the same tokens: the `n` samples of a GRPO group, or requests with
the same system prompt.

Prefix caching. A FULL block i of a sequence is keyed by
    h_i = blake2b(h_{i-1} || token_ids[i*B:(i+1)*B] || media_i),   h_{-1} = b"" (b"adapter:<slot>"
for a request under an adapter of a bank: its K/V differ from the base model's),
where media_i is the media hashes of the images whose image-pad tokens overlap block i
(b"" for text: rlfuse.engine.media), so equal keys mean equal whole prefixes, images
included (128-bit digest; the block's own tokens are compared too). A new sequence reuses its longest run of cached full blocks. Two rules
keep shared blocks safe:
  * a block is shareable only once its K/V is complete (`ready`); a sequence whose
    prefix hits a block still being computed by another one is told to wait (`pending`)
    and is admitted a step later, when it can reuse the block -- this is what makes a
    group of n samples prefill its prompt once instead of n times;
  * at least one token is always computed (its logits give the first sample), so when
    every block of a prompt hits, the last one is recomputed in a fresh block: shared
    blocks are never written twice.
Freed blocks keep their key (ready blocks only) and stay reusable until the free list
hands them out again, least recently freed first; blocks without a key go first.

Test: python -m pytest -q tests/test_block_manager.py
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from rlfuse.engine.sequence import Sequence, block_extra


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "ready")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None       # set only while registered in the prefix cache
        self.token_ids: tuple[int, ...] | None = None
        self.ready = False                   # K/V of all its tokens written


def block_hash(prev: bytes, token_ids, media: bytes = b"") -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    h.update(media)
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"BlockManager: num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = next handed out
        self.cached: dict[bytes, int] = {}   # key -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix matching
    def _hashes(self, seq: Sequence, n_full: int) -> list[bytes]:
        hs, B = seq.block_hashes, self.block_size
        while len(hs) < n_full:
            i = len(hs)
            root = b"" if seq.params.adapter is None else b"adapter:%d" % seq.params.adapter
            hs.append(block_hash(hs[-1] if hs else root, seq.token_ids[i * B:(i + 1) * B], block_extra(seq, i, B)))
        return hs

    def match_prefix(self, seq: Sequence) -> tuple[list[int], bool]:
        """(ids of the cached blocks `seq` can reuse, pending): pending means the next
        block of its prefix is being computed by another sequence -- wait for it."""
        if not self.caching:
            return [], False
        B, n_full = self.block_size, seq.num_tokens // self.block_size
        hashes = self._hashes(seq, n_full)
        hits: list[int] = []
        for i in range(n_full):
            bid = self.cached.get(hashes[i])
            if bid is None:
                break
            blk = self.blocks[bid]
            if blk.token_ids != tuple(seq.token_ids[i * B:(i + 1) * B]):
                break
            if not blk.ready:
                return hits, True
            hits.append(bid)
        if hits and len(hits) * B == seq.num_tokens:
            hits.pop()  # compute at least the last block: its last token's logits are needed
        return hits, False

    def can_allocate(self, seq: Sequence, hits: list[int]) -> bool:
        fresh = self.blocks_for(seq.num_tokens) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # hits sitting in the free list
        return fresh + revived <= self.num_free

    # ------------------------------------------------------------------ allocation
    def _take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        blk = self.blocks[bid]
        if blk.hash is not None:  # evict its key
            if self.cached.get(blk.hash) == bid:
                del self.cached[blk.hash]
            blk.hash, blk.token_ids = None, None
        blk.ready = False
        blk.ref_count = 1
        return bid

    def allocate(self, seq: Sequence, hits: list[int]) -> None:
        """Blocks for all of `seq`'s tokens: the prefix hits (shared), then fresh ones.
        Full fresh blocks are registered at once (not ready) so siblings wait for them."""
        assert not seq.block_table, seq
        B = self.block_size
        for bid in hits:
            blk = self.blocks[bid]
            if blk.ref_count == 0:
                del self.free[bid]
            blk.ref_count += 1
            seq.block_table.append(bid)
        seq.num_computed = len(hits) * B
        seq.num_ready_blocks = len(hits)
        n_full = seq.num_tokens // B
        hashes = self._hashes(seq, n_full) if self.caching else []
        for i in range(len(hits), self.blocks_for(seq.num_tokens)):
            bid = self._take_free()
            seq.block_table.append(bid)
            if self.caching and i < n_full:
                self._register(bid, hashes[i], seq.token_ids[i * B:(i + 1) * B])

    def _register(self, bid: int, h: bytes, tokens) -> None:
        if h not in self.cached:  # an equal block already registered stays the one shared
            blk = self.blocks[bid]
            self.cached[h] = bid
            blk.hash, blk.token_ids = h, tuple(tokens)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Fresh blocks `seq` needs to hold K/V of its first `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def append_blocks(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._take_free())

    def mark_computed(self, seq: Sequence) -> None:
        """After a step advanced `seq.num_computed`: full blocks whose K/V is now complete
        become ready (and are registered, decode blocks included, so a preempted sequence
        or a later identical prefix can reuse them)."""
        n_ready = min(seq.num_computed, seq.num_tokens) // self.block_size
        if n_ready <= seq.num_ready_blocks:
            return
        if self.caching:
            hashes = self._hashes(seq, n_ready)
            B = self.block_size
            for i in range(seq.num_ready_blocks, n_ready):
                bid = seq.block_table[i]
                blk = self.blocks[bid]
                if blk.hash is None:
                    self._register(bid, hashes[i], seq.token_ids[i * B:(i + 1) * B])
                blk.ready = True
        seq.num_ready_blocks = n_ready

    def free_seq(self, seq: Sequence) -> None:
        """Drop `seq`'s references (finish, preemption, abort); its cache progress resets."""
        for bid in reversed(seq.block_table):
            blk = self.blocks[bid]
            blk.ref_count -= 1
            assert blk.ref_count >= 0, blk.block_id
            if blk.ref_count == 0:
                if blk.hash is not None and not blk.ready:  # never completed: its key would lie
                    if self.cached.get(blk.hash) == bid:
                        del self.cached[blk.hash]
                    blk.hash, blk.token_ids = None, None
                self.free[bid] = None
                if blk.hash is None:
                    self.free.move_to_end(bid, last=False)  # worthless content: hand out first
        seq.block_table = []
        seq.num_computed = 0
        seq.num_ready_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every key (the weights or the pool changed, so cached K/V is stale)."""
        for bid in self.cached.values():
            blk = self.blocks[bid]
            blk.hash, blk.token_ids = None, None
        self.cached.clear()

    # ------------------------------------------------------------------ checks
    def check(self, live: list[Sequence] = ()) -> None:
        """Assert the invariants (tests): ref counts equal the references held by `live`
        sequences, the free list is exactly the unreferenced blocks (each once), and every
        key points at a block carrying it."""
        refs = [0] * self.num_blocks
        for s in live:
            for b in s.block_table:
                refs[b] += 1
        for blk in self.blocks:
            assert blk.ref_count == refs[blk.block_id], (blk.block_id, blk.ref_count, refs[blk.block_id])
            assert (blk.ref_count == 0) == (blk.block_id in self.free), blk.block_id
        assert len(self.free) == sum(1 for r in refs if r == 0)
        for h, bid in self.cached.items():
            assert self.blocks[bid].hash == h, bid
