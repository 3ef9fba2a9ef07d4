"""MoE routing record (`EngineConfig.record_routing`): the experts each sampled token was
routed to, per MoE layer, for `moe/routing_mismatch` (the trainer's top-k against the rollout's).

One (rows, k) int64 buffer per MoE layer, installed in the blocks (`routing_buffer`) only
around the engine's own forwards and graph captures, so the graphs write each step's routing
into it; the sampled rows' ids come back with the step's single read-back, as int16.
Test: `python -m pytest -q tests/test_moe_routing_record.py`.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from rlfuse.engine.config import EngineConfig
from rlfuse.model.layers.moe import moe_blocks

log = logging.getLogger(__name__)


class RoutingRecord:
    def __init__(self, model: torch.nn.Module, cfg: EngineConfig, device: torch.device):
        blocks = moe_blocks(model)
        record = cfg.record_routing if cfg.record_routing is not None else bool(blocks)
        self.blocks = blocks if record else []
        self.bufs = [torch.zeros(max(cfg.max_num_batched_tokens, cfg.max_num_seqs), b.top_k, dtype=torch.int64,
                                 device=device) for b in self.blocks]
        if blocks:
            log.info("engine: %s the experts of each sampled token in %d MoE layers (engine.record_routing %s)",
                     "records" if record else "does not record", len(blocks), cfg.record_routing)

    def install(self, on: bool) -> None:
        for b, buf in zip(self.blocks, self.bufs):
            b.routing_buffer = buf if on else None

    def sampled(self, num_new: list[int], sampled: list[int], upload) -> torch.Tensor:
        """(S, layers, k) int16: the routing of each sampled sequence's last computed row
        (`upload(values, dtype)`: the runner's host-to-device copy)."""
        ends = np.cumsum(num_new) - 1
        idx = upload([int(ends[j]) for j in sampled], torch.int64)
        return torch.stack([buf[idx] for buf in self.bufs], 1).to(torch.int16)
