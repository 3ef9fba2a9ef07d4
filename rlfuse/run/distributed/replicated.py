"""Data parallelism without sharding: every rank holds the whole model and the trainable
parameters' optimizer state, and the gradients are summed across ranks before each
optimizer step (LoRA: the frozen base and the adapters replicated, docs/distributed.md).

Why not FSDP for LoRA: the rollouts need the whole base on every rank anyway (the engine
reads it), so sharding the frozen base saves nothing at the memory peak, and the
adapters are a few MB. What replication needs from the trainers is only the loss
contract of context.py (each rank weights its losses by its share of the GLOBAL
normalizer, so the sum over ranks is the one-process gradient) and one all-reduce of the
accumulated fp32 gradients before clipping: `ReplicatedAdamW.grads()`.

Bitwise equal replicas: after the all-reduce every rank holds the same fp32 sum (an
all-reduce computes each element's sum once and sends it to every rank: gloo's and NCCL's
ring and tree algorithms do), then the same clip and the same MasterAdamW step, so the
adapters stay bitwise equal on every rank. `check_replicas` verifies that (a checkpoint
is written by rank 0 alone, so a divergence would otherwise go unnoticed).
Test: python -m pytest -q tests/test_distributed_lora.py
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from rlfuse.run.distributed.context import DistContext, gather_results
from rlfuse.run.distributed.fsdp import log_bytes
from rlfuse.run.optim import MasterAdamW


class ReplicatedAdamW(MasterAdamW):
    """MasterAdamW on a replicated model whose `grads()` are the gradients of the GLOBAL
    batch: the first call after the backward passes of an optimizer step sums every
    rank's accumulated fp32 gradients (one all-reduce of one flat buffer; collective:
    every rank calls it once per optimizer step, as every trainer does through
    `clip_grad_norm_(optimizer.grads(), ...)`). A parameter no rank has a gradient for
    stays without one (skipped by the step, as in one process)."""

    def __init__(self, params, ctx: DistContext, **kw):
        super().__init__(params, **kw)
        self.ctx = ctx
        self._reduced = False

    def grads(self) -> list[torch.Tensor]:
        if not self._reduced:
            self._all_reduce()
            self._reduced = True
        return super().grads()

    @torch.no_grad()
    def _all_reduce(self) -> None:
        local = [self.grad32[i] if self.grad32[i] is not None else p.grad for i, p in enumerate(self.params)]
        # one buffer: every gradient (zeros where this rank has none), then one presence flag per
        # parameter, so a parameter no rank touched keeps None as in one process
        flat = torch.cat([(g.float() if g is not None else torch.zeros(p.numel(), device=p.device)).reshape(-1)
                          for g, p in zip(local, self.params)]
                         + [torch.tensor([float(g is not None) for g in local], device=self.params[0].device)])
        flat = flat.to(self.ctx.device)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        seen = flat[-len(self.params):].tolist()  # host sync: which parameters have a gradient (a loop bound)
        offset = 0
        for i, p in enumerate(self.params):
            n = p.numel()
            g = flat[offset:offset + n].view(p.shape).to(p.device)
            offset += n
            self._set_grad(i, g.clone() if seen[i] else None)

    def step(self, lr: float | None = None) -> None:
        super().step(lr)
        self._reduced = False

    def zero_grad(self) -> None:
        super().zero_grad()
        self._reduced = False


@torch.no_grad()
def check_replicas(ctx: DistContext, model: torch.nn.Module, what: str) -> None:
    """ValueError on every rank when the ranks' trainable parameters are not bitwise equal
    (a hash of each tensor's bytes, all-gathered: one small collective; the tensors are
    copied to the host, as the checkpoint that follows copies them anyway). Every rank
    calls it."""
    digests = [(n, hashlib.blake2b(p.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest())
               for n, p in model.named_parameters() if p.requires_grad]
    parts = gather_results(ctx, what, lambda: digests)
    bad = [n for k, (n, _) in enumerate(parts[0]) if any(p[k] != parts[0][k] for p in parts[1:])]
    if bad:
        raise ValueError(f"{what}: the ranks' replicated weights differ ({len(bad)} tensors, e.g. {bad[0]}); "
                         f"the data-parallel run lost its bitwise-equal replicas, so nothing is written")


def log_replicated_memory(ctx: DistContext, model: torch.nn.Module, optimizer: MasterAdamW) -> dict[str, float]:
    """fsdp.log_memory's metrics for a replicated model: every parameter (the whole model
    on every rank), the trainable ones' fp32 gradients, MasterAdamW's state (masters that
    are not the parameter itself, moments); `gathered` 0: the engine reads the parameters
    themselves. Max over ranks (collective)."""
    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts if t is not None)
    masters = [w for w, p in zip(optimizer.master, optimizer.params) if w is not p]
    return log_bytes(ctx, {"params": nbytes(model.parameters()),
                           "grads": nbytes([*optimizer.grad32, *(p.grad for p in optimizer.params)]),
                           "optimizer": nbytes([*masters, *optimizer.exp_avg, *optimizer.exp_avg_sq]),
                           "gathered": 0})
