"""A launched step's results on their way to the host: `read_back` enqueues the copy of the
sampled ids and log-probs (and the MoE routing record) into pinned host memory behind an
event and returns at once; `collect` waits for that event -- the step's one host sync -- so
the engine can enqueue the next step first (look-ahead, `LLM.step`).
Test: python -m pytest -q tests/test_engine.py
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(slots=True)
class Pending:
    """A launched step: `ids` (S,) device tensor of its samples (the next look-ahead step's
    inputs), `out` (2, S) ids and log-probs (pinned host copy on CUDA, valid once `done`),
    `routing` (S, MoE layers, k) int16 expert ids of the sampled rows (recording on), idem."""
    sampled: list[int]
    ids: torch.Tensor | None
    out: torch.Tensor | None
    done: "torch.cuda.Event | None"
    routing: torch.Tensor | None = None


def read_back(sampled: list[int], ids: torch.Tensor, lps: torch.Tensor, routing: torch.Tensor | None) -> Pending:
    """Start copying a step's samples (`ids`, `lps` (S,) on the device; `routing` or None)
    to the host without waiting for them."""
    out = torch.stack((ids.double(), lps.double()))
    if ids.device.type == "cuda":
        host_out = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host_out.copy_(out, non_blocking=True)
        if routing is not None:
            host_routing = torch.empty(routing.shape, dtype=routing.dtype, pin_memory=True)
            routing = host_routing.copy_(routing, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Pending(sampled, ids, host_out, done, routing)
    return Pending(sampled, ids, out, None, routing)


def collect(p: Pending) -> tuple[list[int], list[int], list[float], torch.Tensor | None]:
    """Wait for a launched step; (batch indices sampled, token ids, log-probs, routing
    (S, layers, k) on the host or None)."""
    if p.ids is None:
        return [], [], [], None
    if p.done is not None:
        p.done.synchronize()  # host sync: the step's one read-back
    out = p.out.tolist()
    return p.sampled, [int(t) for t in out[0]], out[1], p.routing
