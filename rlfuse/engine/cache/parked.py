"""Parked sequences (hybrid models): a finished sequence keeps its linear-attention state and
its KV blocks, so that a continuation -- a later request whose prompt starts with every token
the finished one computed, e.g. the next turn of a multi-turn episode -- takes both over and
computes only its new tokens.

Why whole sequences and not a cache of states per block: a linear-attention layer's state
summarises everything before ONE position (S_c at the last 64-token chunk boundary + the
tail since + the conv inputs), and a continuation must resume exactly there. The KV blocks'
prefix cache can resume only at a full block, where no state was kept; so the continuation
inherits the parked sequence's whole block table, its partial last block included (the
continuation writes the rest of that block: nobody else references it), and its state slot.
In exact numerics the continuation's tokens then go through the arithmetic of a whole-
sequence forward (the state contract, docs/numerics.md), as a recompute would.

Rules (the scheduler calls these; `release` frees a sequence's slot, the runner's):
  park(seq, computed)  seq finished with `computed` tokens in its state and K/V: the host's
                       num_computed, + 1 when a look-ahead step already in flight computes its
                       last sampled token. Its blocks stay referenced, its slot stays taken.
  find(seq)            the most recently parked P with seq.token_ids[:P.computed] equal to P's
                       and at least one more token in seq.
  take(P, seq)         seq inherits P's blocks (references move), progress and slot
                       (`Sequence.state_from = P`: a finished source hands its slot over).
  evict()              the least recently parked goes: its blocks are freed as a finished
                       sequence's are (full ready blocks stay in the prefix cache), its slot too.
Parked sequences hold slots out of the max_num_seqs the running set uses: the scheduler
evicts them first when a waiting sequence needs a slot or blocks, before it preempts
anything; and all of them when the weights, the adapters or the pool change.
Test: python -m pytest -q tests/test_engine_hybrid.py -k turn
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from rlfuse.engine.cache.blocks import BlockManager
from rlfuse.engine.sequence import Sequence


class Parked:
    def __init__(self, block_manager: BlockManager, release: Callable[[Sequence], None]):
        self.bm, self.release = block_manager, release
        self.seqs: OrderedDict[int, Sequence] = OrderedDict()  # seq_id -> parked sequence, oldest first
        self.computed: dict[int, int] = {}
        self.taken = 0  # continuations served (stats)

    def __len__(self) -> int:
        return len(self.seqs)

    def park(self, seq: Sequence, computed: int) -> None:
        self.seqs[seq.seq_id] = seq
        self.computed[seq.seq_id] = computed

    def find(self, seq: Sequence) -> Sequence | None:
        n, ids = seq.num_tokens, seq.token_ids
        for p in reversed(self.seqs.values()):
            c = self.computed[p.seq_id]
            if c < n and ids[c - 1] == p.token_ids[c - 1] and ids[:c] == p.token_ids[:c]:
                return p
        return None

    def take(self, src: Sequence, seq: Sequence) -> None:
        """`seq` (waiting, no blocks) continues from parked `src` (module docstring)."""
        assert not seq.block_table, seq
        c = self.computed.pop(src.seq_id)
        del self.seqs[src.seq_id]
        bs = self.bm.block_size
        seq.block_table, src.block_table = src.block_table, []
        seq.num_computed = c
        seq.num_ready_blocks = min(src.num_ready_blocks, c // bs)
        seq.block_hashes = src.block_hashes[:c // bs]  # src's tokens past c may differ from seq's
        seq.state_from = src
        self.taken += 1

    def evict(self, seq: Sequence | None = None) -> bool:
        """Drop `seq` (default: the least recently parked sequence); False when none is parked."""
        if not self.seqs:
            return False
        seq = self.seqs.pop(seq.seq_id) if seq is not None else self.seqs.popitem(last=False)[1]
        del self.computed[seq.seq_id]
        self.bm.free_seq(seq)
        self.release(seq)
        return True

    def clear(self) -> None:
        while self.evict():
            pass
