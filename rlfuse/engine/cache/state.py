"""The contract every kind of per-sequence cache state keeps, and the second kind: fixed-size
state slots (a linear-attention layer's recurrent and conv state).

Two kinds of state, one contract. The scheduler admits, grows, preempts and frees a
sequence; each kind answers in its own unit:
  * paged KV (`rlfuse.engine.cache.blocks.BlockManager`): blocks of `block_size` tokens,
    as many as the sequence has tokens, shared between sequences through the prefix cache
    (a GRPO group's prompt is prefilled once and its blocks are referenced by every member);
  * slot state (`StateSlots`, here): ONE slot per running sequence whatever its length
    (a recurrent layer keeps a fixed-size summary of everything it read), so growth never
    needs memory, and a group's members cannot share a slot: each gets a copy of the
    state its prompt left (`copy_for_group`), the way KV members share blocks.

The contract (`CacheState`), in the order the engine calls it:
  admit    `can_admit(seq)` then `admit(seq)`: room for the sequence's state;
  grow     `needed(seq, num_tokens)`: units it still lacks to hold `num_tokens` tokens
           (0 for slot state), `grow(seq, num_tokens)` takes them;
  group    `copy_for_group(src, dst)`: members start from the state a prompt left;
  preempt  `free(seq)`: the sequence drops its state and is recomputed from its tokens
           when it is readmitted (recompute preemption, as the KV cache does);
  finish   `free(seq)`, the same call.
A hybrid model (Qwen3.5: linear-attention and full-attention layers) needs both kinds
for each sequence: admission succeeds only when every kind has room, and a preemption
frees every kind.

Status: the KV cache implements the contract through the block manager's own names
(`can_allocate`, `allocate`, `blocks_needed`, `append_blocks`, `free_seq`); `StateSlots`
implements it for slot state; `rlfuse.engine.cache.linear.LinearStateCache` is the Gated
DeltaNet layers' (one slot per running sequence: the model runner admits a sequence when it
computes its first token and frees it with its row, so the scheduler's running limit
max_num_seqs = the number of slots is what bounds it).
Test: python -m pytest -q tests/test_block_manager.py tests/test_engine_hybrid.py
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from rlfuse.engine.sequence import Sequence


class CacheState(Protocol):
    """One kind of per-sequence cache state (the module docstring)."""

    def can_admit(self, seq: Sequence) -> bool: ...

    def admit(self, seq: Sequence) -> None: ...

    def needed(self, seq: Sequence, num_tokens: int) -> int: ...

    def grow(self, seq: Sequence, num_tokens: int) -> None: ...

    def copy_for_group(self, src: Sequence, dst: list[Sequence]) -> None: ...

    def free(self, seq: Sequence) -> None: ...


class StateSlots:
    """Fixed-size per-sequence state in `num_slots` slots: named device tensors whose first
    dimension is the slot, e.g. {"conv": (slots, L, D, K-1), "recurrent": (slots, L, H, Dk, Dv)}
    (shapes are the architecture's). A slot is zeroed when a sequence is admitted (a new
    sequence starts from the zero state) and copied for a group's members."""

    def __init__(self, num_slots: int, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype | dict[str, torch.dtype],
                 device: torch.device | str = "cpu"):
        """dtype: one for every tensor, or one per name (a recurrent state in fp32 beside
        conv inputs in the model dtype)."""
        if num_slots < 1:
            raise ValueError(f"StateSlots: num_slots must be >= 1, got {num_slots}")
        dt = dtype if isinstance(dtype, dict) else dict.fromkeys(shapes, dtype)
        self.spec = {k: ((num_slots, *s), dt[k]) for k, s in shapes.items()}
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}
        StateSlots.allocate(self)  # not a subclass's: its views are not set up yet
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self.slot_of: dict[int, int] = {}  # seq_id -> slot

    def allocate(self) -> None:
        """The slots' tensors, zeroed (no-op while allocated)."""
        if not self.tensors:
            self.tensors = {k: torch.zeros(shape, dtype=dt, device=self.device)
                            for k, (shape, dt) in self.spec.items()}

    def release(self) -> None:
        """Drop the tensors (the engine asleep); no sequence may hold a slot."""
        if self.slot_of:
            raise RuntimeError(f"StateSlots.release: {len(self.slot_of)} sequences still hold slots")
        self.tensors = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the slots' tensors when allocated."""
        return sum(math.prod(shape) * dt.itemsize for shape, dt in self.spec.values())

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def slot(self, seq: Sequence) -> int:
        return self.slot_of[seq.seq_id]

    def can_admit(self, seq: Sequence) -> bool:
        return seq.seq_id in self.slot_of or bool(self.free_slots)

    def admit(self, seq: Sequence) -> None:
        if seq.seq_id in self.slot_of:
            return
        if not self.free_slots:
            raise RuntimeError(f"StateSlots: no free slot for sequence {seq.seq_id} (check can_admit first)")
        s = self.free_slots.pop()
        self.slot_of[seq.seq_id] = s
        for t in self.tensors.values():
            t[s].zero_()

    def needed(self, seq: Sequence, num_tokens: int) -> int:
        return 0  # a slot holds any number of tokens

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        pass

    def copy_for_group(self, src: Sequence, dst: list[Sequence]) -> None:
        """Every member in `dst` (admitted) continues from `src`'s state: one index_copy per tensor."""
        if not dst:
            return
        t0 = next(iter(self.tensors.values()), None)
        if t0 is None:
            return
        idx = torch.tensor([self.slot(d) for d in dst], dtype=torch.long, device=t0.device)
        for t in self.tensors.values():
            # the source row is cloned: index_copy_ refuses a source that aliases its destination
            t.index_copy_(0, idx, t[self.slot(src)].clone().unsqueeze(0).expand(len(dst), *t.shape[1:]))

    def free(self, seq: Sequence) -> None:
        s = self.slot_of.pop(seq.seq_id, None)
        if s is not None:
            self.free_slots.append(s)
