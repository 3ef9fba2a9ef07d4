"""`EngineLoop`: the stepping half of `LLM` -- schedule, launch, read back, apply.

    step() -> schedule a batch (or take the look-ahead step launched by the previous call)
           -> launch it on the runner (`rlfuse.engine.step.ModelRunner.launch`)
           -> launch its successor first when it is a decode step the scheduler would
              schedule unchanged (`_look_ahead`, `EngineConfig.look_ahead`)
           -> read the step's samples (its one host sync) and apply them (`_absorb`):
              counters, prefix-cache blocks, stop checks, release or park finished sequences.

A base class of `LLM`, not a separate object: it reads and writes the engine's state that
`LLM.__init__` creates and `LLM.abort_all` replaces (the annotations below), so that the
request API, sleep / wake and the loop all see one scheduler, runner and request table.
Test: python -m pytest -q tests/test_engine.py tests/test_scheduler.py
"""

from __future__ import annotations

import torch

from rlfuse.engine.cache.blocks import BlockManager
from rlfuse.engine.config import EngineConfig
from rlfuse.engine.scheduler import Batch, Launched, Scheduler
from rlfuse.engine.sequence import Completion, Sequence, Status, completion, stop_reason
from rlfuse.engine.stats import EngineStats
from rlfuse.engine.step import ModelRunner


class EngineLoop:
    # the engine's state, created by LLM.__init__
    config: EngineConfig
    tokenizer: object
    runner: ModelRunner
    scheduler: Scheduler
    block_manager: BlockManager
    stats: EngineStats
    asleep: bool
    _requests: dict[str, list[Sequence]]
    _pending: Launched | None  # a look-ahead step launched, not read yet
    _ready: list[Completion]  # finished samples read by _drain, for the next step()

    def step(self) -> list[Completion]:
        """One engine step; returns the samples that finished in it.

        With `EngineConfig.look_ahead`, a decode step's successor is launched before the
        step's own results are read (`_look_ahead`): this call then reads the step the
        previous call launched, launches the next one, and does the bookkeeping while the
        device runs it. Results and their order are the same as without look-ahead."""
        if self.asleep:
            raise RuntimeError("LLM.step: the engine is asleep; call wake() first")
        out, self._ready = self._ready, []
        cur, self._pending = self._pending, None
        if cur is None:
            batch = self.scheduler.schedule()
            for s in batch.preempted:
                self.runner.release(s)
            self.stats.preemptions += len(batch.preempted)
            self.stats.prompt_tokens_cached += batch.num_prompt_cached
            if not batch.seqs:
                assert not self.scheduler.running, "scheduler produced an empty batch with running sequences"
                return out
            cur = self._launch(batch)
        nxt = self._look_ahead(cur) if self.config.look_ahead else None
        finished = self._absorb(cur, nxt)
        if nxt is not None:
            # a sequence that stopped on a token in `cur` has a void sample in `nxt`
            gone = {id(s) for s in finished}
            nxt.void = [id(s) in gone for s in nxt.batch.seqs]
            self._pending = nxt
        return out + [completion(seq, self.tokenizer) for seq in finished]

    def _launch(self, batch: Batch, feed: torch.Tensor | None = None) -> Launched:
        g0, s0 = self.runner.graph_steps, self.runner.shared_steps
        pending = self.runner.launch(batch.seqs, batch.num_new, feed)
        return Launched(batch, pending, self.runner.graph_steps > g0, self.runner.shared_steps > s0)

    def _look_ahead(self, cur: Launched) -> Launched | None:
        """Launch the decode step after `cur` before reading `cur`: the same sequences
        (minus those `cur` ends by length) compute the token `cur` samples, fed on the
        device. Only when the plain scheduler would schedule exactly that: `cur` is a
        decode step on the static path; nothing waits for admission, or the running set is
        full (max_num_seqs, all in `cur`) and stays full (no sequence ends by length in
        `cur`; one that stops on a token frees its slot a step late); and the pool has the
        blocks. Else no look-ahead: the next step is scheduled after reading `cur`."""
        b, r, bm, sch = cur.batch, self.runner, self.block_manager, self.scheduler
        if (not r.static or not b.is_decode or len(b.seqs) > r.max_graph_bs
                or len(cur.pending.sampled) != len(b.seqs)):
            return None
        if sch.waiting and not (len(sch.running) >= self.config.max_num_seqs and len(b.seqs) == len(sch.running)):
            return None
        void = cur.void or [False] * len(b.seqs)
        keep = [j for j, s in enumerate(b.seqs) if not void[j] and len(s.token_ids) + 1 < s.max_total]
        if not keep or (sch.waiting and len(keep) < len(b.seqs)):  # a slot frees: admit in a plain step
            return None
        seqs = [b.seqs[j] for j in keep]
        grow = [(s, n) for s in seqs if (n := bm.blocks_needed(s, s.num_computed + 2))]  # ~1 in block_size
        if sum(n for _, n in grow) > bm.num_free:
            return None
        for s, _ in grow:
            bm.append_blocks(s, s.num_computed + 2)
        ids = cur.pending.ids
        feed = ids if len(keep) == len(b.seqs) else ids[r._upload(keep, torch.int64)]
        self.stats.look_ahead_steps += 1
        return self._launch(Batch(seqs, [1] * len(seqs), []), feed)

    def _absorb(self, cur: Launched, nxt: Launched | None = None) -> list[Sequence]:
        """Read a launched step's results and apply them to the sequences; returns the
        sequences that finished (already released, or parked: hybrid models). `nxt`: the
        look-ahead step launched after `cur`, which computes one more token of them."""
        batch = cur.batch
        sampled, ids, lps, routing = self.runner.collect(cur.pending)
        void = cur.void or [False] * len(batch.seqs)
        st = self.stats
        st.steps += 1
        st.decode_steps += batch.is_decode
        st.graph_steps += cur.graph
        st.shared_prefix_steps += cur.shared
        st.tokens_computed += batch.num_tokens
        bs, mark = self.config.block_size, self.block_manager.mark_computed
        for seq, n, dead in zip(batch.seqs, batch.num_new, void):
            if dead:
                continue
            c = seq.num_computed
            if c < seq.num_prompt_tokens:
                st.prompt_tokens_computed += min(c + n, seq.num_prompt_tokens) - c
            seq.num_computed = c + n
            if (c + n) // bs > seq.num_ready_blocks:  # a block just became complete
                mark(seq)
        finished = []
        for i, (j, tok, lp) in enumerate(zip(sampled, ids, lps)):
            if void[j]:
                st.discarded_tokens += 1
                continue
            seq = batch.seqs[j]
            seq.token_ids.append(tok)
            seq.logprobs.append(lp)
            if routing is not None:
                seq.routing.append(routing[i])
            st.output_tokens += 1
            if tok in seq.stop_ids or seq.params.stop or len(seq.token_ids) >= seq.max_total:  # cheap pre-check
                reason = stop_reason(seq, tok, self.tokenizer)
                if reason is not None:
                    seq.status, seq.finish_reason = Status.FINISHED, reason
                    finished.append(seq)
        park = self.scheduler.parked is not None
        ahead = {id(s) for s in nxt.batch.seqs} if nxt is not None else set()
        # a parked sequence's state holds num_computed tokens, + its last sampled one when
        # the look-ahead step in flight computes it
        self.scheduler.finish(finished, [s.num_computed + (id(s) in ahead) for s in finished] if park else None)
        for seq in finished:
            self.runner.release(seq, keep_state=park)
            self._drop_media(seq)
            reqs = self._requests.get(seq.request_id)
            if reqs is not None and all(s.is_finished() for s in reqs):
                del self._requests[seq.request_id]
        return finished

    def _drop_media(self, seq: Sequence) -> None:
        """A finished or aborted sample lets go of its images (the tower's count is logged)."""
        if self.runner.features is not None:
            self.stats.vision_encodes += self.runner.features.let_go(seq.media)

    def _drain(self) -> None:
        """Read the launched look-ahead step, if any (before abort / sleep touch sequences);
        its finished samples are returned by the next `step()`."""
        if self._pending is not None:
            cur, self._pending = self._pending, None
            self._ready += [completion(s, self.tokenizer) for s in self._absorb(cur)]
