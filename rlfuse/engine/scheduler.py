"""Continuous batching: which sequences compute how many tokens in the next step.

Every step, in this order, under two limits (`max_num_batched_tokens` tokens computed,
`max_num_seqs` sequences running):
  1. Running sequences, oldest first: a decoding sequence computes 1 token (the last
     sampled one), a sequence still prefilling computes the next chunk of its prompt
     that fits in the remaining token budget (chunked prefill). A decode that needs a
     new block when none is free preempts the NEWEST running sequence (recompute: its
     blocks are freed, it goes back to the front of the waiting queue with its tokens
     so far and is prefilled again later) -- possibly itself; the batch never fails.
  2. Waiting sequences, first come first served, while there is budget, a free running
     slot and blocks for all their tokens (prefix-cache hits count as free). A sequence
     whose prefix is being computed by another one (a GRPO sibling) is skipped this
     step and admitted once that prefix is ready. No admissions in a step that preempted.
A sequence's sample is drawn in the step whose chunk reaches its last token.

Hybrid models (`group_state`: linear-attention layers, whose state a cached block does not
restore): a prefix-cache hit is taken only from a running member of the same request (a
GRPO group) that has computed exactly the hit's tokens, and the new member starts from a copy
of that member's state (`Sequence.state_from`, copied by the runner's LinearStateCache);
otherwise the sequence computes its prompt itself. So that the hit point is met, a group's
prefill pauses at its prompt's last full block before the last token (each member computes
the rest itself; for a prompt of a multiple of block_size tokens the members do not share).
Multi-turn on hybrid models (`parked`, rlfuse/engine/cache/parked.py): a finished sequence is
parked with its blocks and state; a waiting sequence whose prompt continues it takes both
over and computes only its new tokens. Parked sequences are evicted (least recent first)
before a waiting sequence lacks a slot or blocks and before any preemption.

Test: python -m pytest -q tests/test_scheduler.py
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import TYPE_CHECKING

from rlfuse.engine.cache.blocks import BlockManager
from rlfuse.engine.cache.parked import Parked
from rlfuse.engine.config import EngineConfig
from rlfuse.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from rlfuse.engine.step.pending import Pending


@dataclasses.dataclass(slots=True)
class Batch:
    seqs: list[Sequence]
    num_new: list[int]
    """Tokens each sequence computes this step: positions num_computed .. + num_new."""
    preempted: list[Sequence]
    num_prompt_cached: int = 0
    """Prompt tokens admitted this step whose K/V came from the prefix cache."""

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.num_new)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.group_state = False
        """Hybrid models: prefix hits only within a group, through a state copy (module doc)."""
        self.parked: Parked | None = None
        """Hybrid models: finished sequences kept for their continuations (module doc)."""

    def _cap(self, seq: Sequence, n: int) -> int:
        """Tokens `seq` computes this step: a group member's prefill stops at the share point."""
        if self.group_state and seq.params.n > 1:
            p = (seq.num_prompt_tokens - 1) // self.bm.block_size * self.bm.block_size
            if seq.num_computed < p:
                return min(n, p - seq.num_computed)
        return n

    def _state_source(self, seq: Sequence, hits: list[int]) -> Sequence | None:
        """A running member of seq's request at exactly the hit point (hybrid models)."""
        p = len(hits) * self.bm.block_size
        return next((s for s in self.running if s.request_id == seq.request_id and s.num_computed == p
                     and s is not seq), None)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def preempt_all(self) -> list[Sequence]:
        """Free every running sequence's blocks (they resume by recompute) and drop the
        parked ones; for sleep()."""
        if self.parked is not None:
            self.parked.clear()
        out = list(reversed(self.running))
        for seq in out:
            self._preempt(seq)
        return out

    def schedule(self) -> Batch:
        budget = self.max_num_batched_tokens
        batch = Batch([], [], [])
        bs, running = self.bm.block_size, self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = self._cap(seq, min(len(seq.token_ids) - seq.num_computed, budget))
            if (seq.num_computed + n + bs - 1) // bs <= len(seq.block_table):  # fast path: no new block
                batch.seqs.append(seq)
                batch.num_new.append(n)
                budget -= n
                i += 1
                continue
            while self.bm.blocks_needed(seq, seq.num_computed + n) > self.bm.num_free:
                if self.parked is not None and self.parked.evict():
                    continue
                victim = running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            self.bm.append_blocks(seq, seq.num_computed + n)
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
            i += 1
        if batch.preempted:
            return batch
        skipped = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.parked is not None:
                cont = self._continue_parked(seq)
                if cont is False:
                    break
                if cont:
                    n = min(seq.num_tokens - seq.num_computed, budget)
                    batch.seqs.append(seq)
                    batch.num_new.append(n)
                    batch.num_prompt_cached += seq.num_computed
                    budget -= n
                    continue
                while len(self.running) + len(self.parked) >= self.max_num_seqs and self.parked.evict():
                    pass  # a parked sequence holds a state slot the new one needs
            hits, pending = self.bm.match_prefix(seq)
            if pending:
                skipped.append(self.waiting.popleft())
                continue
            if self.group_state:
                seq.state_from = self._state_source(seq, hits) if hits else None
                if seq.state_from is None:
                    hits = []  # nobody holds the linear-attention state at the hit: compute it
            while (not self.bm.can_allocate(seq, hits) and self.parked is not None
                   and self.parked.evict()):
                pass
            if not self.bm.can_allocate(seq, hits):
                break
            self.waiting.popleft()
            self.bm.allocate(seq, hits)
            if seq.num_cached_prompt < 0:
                seq.num_cached_prompt = min(seq.num_computed, seq.num_prompt_tokens)
                batch.num_prompt_cached += seq.num_cached_prompt
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = self._cap(seq, min(seq.num_tokens - seq.num_computed, budget))
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return batch

    def _continue_parked(self, seq: Sequence) -> bool | None:
        """Admit waiting `seq` as the continuation of a parked sequence: True done, None no
        parked sequence continues it, False one does but the pool lacks blocks for the rest
        of seq's tokens even with every other parked sequence evicted (wait)."""
        src = self.parked.find(seq)
        if src is None:
            return None
        fresh = self.bm.blocks_for(seq.num_tokens) - len(src.block_table)
        for other in [p for p in self.parked.seqs.values() if p is not src]:  # oldest first
            if fresh <= self.bm.num_free:
                break
            self.parked.evict(other)
        if fresh > self.bm.num_free:
            return False
        self.waiting.popleft()
        self.parked.take(src, seq)
        self.bm.append_blocks(seq, seq.num_tokens)
        self.bm.mark_computed(seq)
        seq.num_cached_prompt = max(seq.num_cached_prompt, min(seq.num_computed, seq.num_prompt_tokens))
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def finish(self, seqs: list[Sequence], computed: list[int] | None = None) -> None:
        """Remove finished sequences (status already FINISHED) and free their blocks, or,
        hybrid models, park them with `computed[i]` tokens in their state (`parked`)."""
        if not seqs:
            return
        for i, seq in enumerate(seqs):
            if self.parked is not None and computed is not None:
                self.parked.park(seq, computed[i])
                continue
            self.bm.free_seq(seq)
        self.running = [s for s in self.running if s.status is Status.RUNNING]

    def abort(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.status is Status.RUNNING:
                self.running.remove(seq)
                self.bm.free_seq(seq)
            elif seq.status is Status.WAITING:
                self.waiting.remove(seq)
            seq.status = Status.FINISHED
            seq.finish_reason = "abort"


@dataclasses.dataclass(slots=True)
class Launched:
    """A step the engine launched (`LLM.step`'s look-ahead): its batch and pending result."""
    batch: Batch
    pending: Pending
    graph: bool
    shared: bool = False
    void: list[bool] | None = None
    """Per sequence: stopped in the step before this look-ahead one (sample discarded)."""
