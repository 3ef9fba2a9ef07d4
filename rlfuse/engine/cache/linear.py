"""The linear-attention layers' per-sequence state (hybrid models, e.g. Qwen3.5): slot state
(`StateSlots`) holding, per sequence and Gated DeltaNet layer, the conv state (the last W-1
conv inputs) and, by the engine's numerics (docs/numerics.md, "Linear attention"):
  exact: S_c (the delta-rule state at the sequence's last 64-token chunk boundary, fp32) and
         the tail buffer of raw kernel inputs (q, k, v, g, beta) of the < 64 tokens since;
  fast:  the state after the sequence's last token (fp32, "recurrent"), which the decode
         step advances in place with the recurrent kernel, one token at O(Dk Dv) a head.

Why exact keeps S_c + tail and not the state after the last token: every continuation (a
decode token, a prefill chunk) is ONE `chunk_gated_delta_rule` call over [tail + new] from
S_c, so each token goes through the same chunk arithmetic as the trainer's forward over the
whole sequence, and exact numerics give the trainer's bits (tests/test_engine_hybrid.py).
That costs a 64-row chunk per decoded token; fast numerics round differently from the
trainer anyway, so they decode recurrently (`GatedDeltaNet.forward_recurrent` /
`forward_decode`). Either layout means "the state after the sequence's computed tokens",
so admission, group copies, parking and preemption below are the same for both.

Bookkeeping: the tail length is num_computed % 64 (chunks are aligned to a sequence's first
token), so the host keeps no extra counters. A sequence is admitted (slot zeroed) when it
computes its first token; preemption frees the slot and the sequence recomputes from its
first token. A cached block restores the attention layers' K/V, not this state, so prefix
hits are taken only within a GRPO group: a member admitted at a hit starts from a copy of
the state of the member that computed those tokens (`copy_for_group`; the scheduler pairs
them, `Scheduler.group_state`), and by a continuation of a finished sequence, which is
parked with its slot and blocks and hands both over (multi-turn: `cache/parked.py`);
other reuse across requests is off (logged).
Test: python -m pytest -q tests/test_engine_hybrid.py
"""

from __future__ import annotations

import torch
from torch import nn

from rlfuse.engine.cache.state import StateSlots
from rlfuse.engine.sequence import Sequence
from rlfuse.kernels.gated_delta import CHUNK
from rlfuse.model import LinearSlots


def linear_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, mixer) of every layer whose mixer keeps engine state (`state_shapes`)."""
    return [(i, layer.mixer) for i, layer in enumerate(model.model.layers) if hasattr(layer.mixer, "state_shapes")]


class LinearStateCache(StateSlots):
    """One slot per running sequence for every linear-attention layer of `model`, plus one
    scratch slot (`pad_slot`, never handed out) that the static decode path's padding rows
    read and write, so a bucket's padding needs no branch."""

    def __init__(self, model: nn.Module, num_slots: int, dtype: torch.dtype, device, *, exact: bool):
        """exact: the engine's numerics, which pick the layout (`GatedDeltaNet.state_shapes`)."""
        shapes, dtypes = {}, {}
        self.layer_ids, self.exact = [], exact
        for i, mixer in linear_layers(model):
            self.layer_ids.append(i)
            for name, (shape, kind) in mixer.state_shapes(exact).items():
                shapes[f"{i}.{name}"] = shape
                dtypes[f"{i}.{name}"] = torch.float32 if kind == "fp32" else dtype
        super().__init__(num_slots + 1, shapes, dtypes, device)
        self.pad_slot = self.free_slots.pop(0)  # the highest slot: pop() hands out the lowest first
        self._views()

    def _views(self) -> None:
        self.layers = {i: {k.split(".", 1)[1]: t for k, t in self.tensors.items() if k.split(".", 1)[0] == str(i)}
                       for i in self.layer_ids}

    def allocate(self) -> None:
        """The state again after `release` (zeroed; every slot free)."""
        super().allocate()
        self._views()
        self.reset()

    def release(self) -> None:
        """Free the state while the engine sleeps (`LLM.sleep`: every sequence released first).
        The decode graphs that read it are dropped with it and recaptured after `allocate`."""
        super().release()
        self.layers = {}

    def reset(self) -> None:
        """Every slot free (the engine's bookkeeping starts afresh: `LLM.abort_all`)."""
        self.slot_of.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        """Slots sequences can hold (the scratch slot not counted)."""
        return next(iter(self.spec.values()))[0][0] - 1

    def step(self, seqs: list[Sequence], starts: list[int], num_new: list[int]) -> LinearSlots:
        """The step's `LinearSlots` for sequences computing num_new tokens from position
        starts[b] (the eager path)."""
        slots = self.admit_step(seqs, starts)
        if not self.exact:  # the running state after the last token: no tail buffer
            return LinearSlots.make(self.layers, slots, num_new, [0] * len(seqs), 0, self.device)
        return LinearSlots.make(self.layers, slots, num_new, [st % CHUNK for st in starts], CHUNK, self.device)

    def admit_step(self, seqs: list[Sequence], starts: list[int]) -> list[int]:
        """Each sequence's slot for a step computing from position starts[b]; a sequence
        new to the cache is admitted here: its slot zeroed; resuming at a prefix hit, a
        copy of the running group member's state; continuing a parked (finished) sequence,
        that sequence's slot handed over. Host bookkeeping plus device copies enqueued
        before the step: the static decode path calls it outside its CUDA graph."""
        for seq, st in zip(seqs, starts):
            if seq.seq_id not in self.slot_of:
                src, seq.state_from = seq.state_from, None
                if st != 0 and (src is None or src.seq_id not in self.slot_of):
                    # a prefix-cache hit or a resume without the state: never silently wrong
                    raise RuntimeError(f"LinearStateCache: sequence {seq.seq_id} resumes at token {st} without "
                                       f"its linear-attention state (hybrid models take prefix hits only from "
                                       f"a group member holding it: Scheduler.group_state)")
                if st != 0 and src.is_finished():  # a parked sequence's continuation: its slot moves
                    self.slot_of[seq.seq_id] = self.slot_of.pop(src.seq_id)
                    continue
                self.admit(seq)
                if st != 0:
                    self.copy_for_group(src, [seq])  # the member's state at the shared prompt prefix
        return [self.slot(s) for s in seqs]
