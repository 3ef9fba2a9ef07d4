"""Compile the training step's kernels in the background while the first rollout runs.

A fresh process on a cold Triton cache compiles every kernel the trainer uses (attention
forward and backward, the fused log-prob, norms, RoPE, SwiGLU, the policy loss; in exact
numerics the batch-invariant linear at training sizes) at its first launch, which lands in
the first step's update: seconds of compiling while the GPU idles. The first rollout,
meanwhile, keeps the GPU busy with graph replays and leaves the host mostly waiting.

So `KernelWarmup` runs, on a background thread and a side CUDA stream, one forward and
backward of what a training micro-batch runs -- one decoder layer (every layer runs the
same kernels), the final norm, and the trainer's own head (log-probs and loss) -- on a
dummy packed batch of two short sequences, with the model's real dimensions, dtypes,
numerics and kernel backend, so the kernels it compiles are the ones the step will launch.
Gradients come from `torch.autograd.grad`: no `.grad` is written and the weights are only
read, which the rollout also only does. The trainer calls `wait()` before its first update.
Compiles the warm-up missed are counted in that first update and logged ("compile left").

Only CUDA gains (the CPU runs no compiler); off under torch.distributed, where a layer's
forward gathers sharded weights with collectives that must stay in step across ranks.
Off by default (`grpo.warm_kernels`): measured on an H200 (docs/perf-log.md), the thread
compiled the same kernels ~2.5x slower than the update does inline and slowed the
rollout, since Triton's front end is Python and the decode loop holds the GIL; a compile
in other processes is what would pay. `compile_left` logs, on every CUDA run, what the
first update compiled.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable

import torch

from rlfuse.kernels.backend import new_compiles, triton_compiles, use_numerics
from rlfuse.run import PackedBatch

log = logging.getLogger(__name__)

# two sequences, each longer than the attention kernels' tiles, with 16 context tokens
_DUMMY = ((96, 16), (80, 16))


class KernelWarmup:
    """`head(h_TD, batch) -> scalar loss` is the trainer's part after the final norm (the
    fused log-prob and the policy loss, as in its update)."""

    def __init__(self, model, head: Callable, *, numerics: str, enabled: bool = True):
        self.model, self.head, self.numerics = model, head, numerics
        self.device = model.lm_head_weight.device
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.compiled: dict[str, int] = {}
        if enabled and self.device.type == "cuda":
            ctx = contextvars.copy_context()  # the caller's kernel backend and numerics
            self.thread = threading.Thread(target=ctx.run, args=(self._run,), name="rlfuse-kernel-warmup",
                                           daemon=True)
            self.thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        before = triton_compiles()
        try:
            stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(stream), use_numerics(self.numerics):
                self._forward_backward()
            stream.synchronize()
        except BaseException as e:  # reported by wait(): the update then compiles as it goes
            self.error = e
        self.compiled = new_compiles(before, triton_compiles())
        self.seconds = time.perf_counter() - t0

    def _forward_backward(self) -> None:
        m = self.model
        V = m.config.vocab_size
        g = torch.Generator().manual_seed(0)
        seqs = [(torch.randint(0, V, (n,), generator=g).tolist(), c) for n, c in _DUMMY]
        batch = PackedBatch.build(seqs, self.device)
        dtype = m.lm_head_weight.dtype
        h = torch.randn(batch.num_tokens, m.config.hidden_size, device=self.device, dtype=dtype, requires_grad=True)
        layer = m.model.layers[0]
        out = layer(h, batch.positions, batch.attn, m.inv_freq(self.device))
        loss = self.head(m.model.norm(out), batch)
        wrt = [h] + [p for p in list(layer.parameters()) + list(m.model.norm.parameters()) + [m.lm_head_weight]
                     if p.requires_grad]
        torch.autograd.grad(loss, wrt, allow_unused=True)

    def wait(self) -> dict:
        """Join the warm-up (once); returns metrics: its seconds and kernels compiled."""
        if self.thread is None:
            return {}
        t0 = time.perf_counter()
        self.thread.join()
        self.thread = None
        waited = time.perf_counter() - t0
        if self.error is not None:
            log.warning("kernel warm-up failed (%s: %s); the first update compiles its kernels as it goes",
                        type(self.error).__name__, str(self.error).splitlines()[0] if str(self.error) else "")
        else:
            log.info("kernel warm-up: %d kernel variants compiled in %.1f s in the background; the update waited "
                     "%.1f s for it", sum(self.compiled.values()), self.seconds, waited)
        return {"compile/warmup_s": self.seconds, "compile/warmup_kernels": float(sum(self.compiled.values())),
                "compile/waited_s": waited}


def compile_left(before: dict[str, int]) -> dict:
    """Kernels compiled since `before` (a `triton_compiles()` snapshot), logged by name:
    what the warm-up did not cover."""
    left = new_compiles(before, triton_compiles())
    if left:
        log.info("the first update compiled %d Triton kernel variants: %s", sum(left.values()),
                 ", ".join(f"{k} x{n}" for k, n in sorted(left.items())))
    return {"compile/left_kernels": float(sum(left.values()))}
