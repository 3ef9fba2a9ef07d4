"""Compile the training step's kernels in other processes while the first rollout runs.

A fresh process on a cold Triton cache compiles every kernel the trainer uses (attention
forward and backward, the fused log-prob, norms, RoPE, SwiGLU, the policy loss; in exact
numerics the batch-invariant linear at training sizes) at its first launch, which lands in
the first step's update: seconds of compiling while the GPU idles.

`KernelWarmup` (`grpo.warm_kernels`), at the trainer's construction:
  1. dry run, main thread: one forward and backward of what a training micro-batch runs --
     one decoder layer (every layer runs the same kernels), the final norm, and the
     trainer's own head (log-probs and loss) -- on a dummy packed batch, with the model's
     dimensions, dtypes, numerics and kernel backend (the layer runs twice: as the first
     layer, and as a later one whose norm takes the previous residual add). Triton's
     `jit_cache_hook` sees each kernel that would compile, records its specialization
     (Triton's own JSON) and skips it: nothing compiles and those kernels do not launch,
     so the run's outputs are garbage and are dropped. Gradients come from `torch.autograd.grad` (no `.grad`
     written; the weights are only read).
  2. worker processes (fresh interpreters that import only the kernels) compile the
     recorded kernels into the Triton cache on disk (no GPU needed: Triton compiles for a
     target), in parallel with each other and with the first rollout.
  3. the trainer calls `wait()` before its first update, whose launches then load the
     compiled kernels from the cache. Whatever still compiles there is logged by
     `compile_left`.
A compiler thread in this process instead would contend with the decode loop for the GIL
(Triton's front end is Python): measured ~2.5x slower than compiling inline (perf-log).
Opt-in: on an H100 it took ~5 s off a cold first update and added ~3 s to the first
rollout while the workers started (docs/benchmarks.md). Only CUDA runs this; off under
torch.distributed (a layer's forward gathers sharded weights with collectives that must
stay in step across ranks).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable

import torch

from rlfuse.kernels.backend import (
    compile_worker_command,
    new_compiles,
    record_compiles,
    triton_compiles,
    use_numerics,
    use_settings,
)
from rlfuse.kernels.rope.rotary import rope_cos_sin
from rlfuse.run import PackedBatch

log = logging.getLogger(__name__)

# two sequences of (length, context tokens), longer than the attention kernels' tiles. Exact
# numerics picks the linear's tile family and launch plan from the row count, so its dummy
# has a training micro-batch's size (the plan of a large M; a short last micro-batch of a
# real step may still compile the other plan, logged by `compile_left`)
_DUMMY = {"fast": ((256, 16), (240, 16)), "exact": ((2048, 16), (2048, 16))}


class KernelWarmup:
    """`head(h_TD, batch) -> scalar loss` is the trainer's part after the final norm (the
    fused log-prob and the policy loss, as in its update)."""

    def __init__(self, model, head: Callable, *, numerics: str, enabled: bool = True):
        self.model, self.head, self.numerics = model, head, numerics
        self.lengths = _DUMMY[numerics]  # the dummy batch: (length, context tokens) per sequence
        self.device = model.lm_head_weight.device
        self.workers: list[tuple[subprocess.Popen, int]] = []  # (process, requests sent to it)
        self.t0 = time.perf_counter()
        self.error: str | None = None
        self.failures: list[str] = []
        if not (enabled and self.device.type == "cuda"):
            return
        try:
            requests = self.dry_run()
        except Exception as e:  # noqa: BLE001 -- a warm-up must never stop a run: it logs and steps aside
            self.error = f"dry run: {type(e).__name__}: {e}"
            return
        n = min(len(requests), os.cpu_count() or 1, 8)
        for i in range(n):
            # a fresh interpreter per worker (not multiprocessing's spawn, which re-imports the
            # caller's main script); requests go in on stdin from a thread, so a full pipe
            # never holds up this process while the worker imports
            p = subprocess.Popen(compile_worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
            mine = requests[i::n]
            threading.Thread(target=_send, args=(p, "".join(json.dumps(list(r)) + "\n" for r in mine)),
                             daemon=True).start()
            self.workers.append((p, len(mine)))

    def dry_run(self) -> list[tuple]:
        """The dummy forward and backward with every would-be compile recorded and skipped:
        [(module, kernel name, Triton's specialization JSON, target)]."""
        # the dummy runs a layer outside CausalLM.forward, so it enters the model's settings itself
        with record_compiles() as requests, use_settings(self.model.kernels), use_numerics(self.numerics):
            self._forward_backward()
            torch.cuda.synchronize(self.device)
        return requests

    def _forward_backward(self) -> None:
        m = self.model
        V = m.config.vocab_size
        g = torch.Generator().manual_seed(0)
        seqs = [(torch.randint(0, V, (n,), generator=g).tolist(), c) for n, c in self.lengths]
        batch = PackedBatch.build(seqs, self.device)
        dtype = m.lm_head_weight.dtype
        h = torch.randn(batch.num_tokens, m.config.hidden_size, device=self.device, dtype=dtype, requires_grad=True)
        layer, inv_freq = m.model.layers[0], m.inv_freq(self.device)
        cos_sin = rope_cos_sin(batch.positions, inv_freq)  # as CausalLM.forward: the table kernels
        # twice: the first layer's norm and every later one's (the residual add fused into it)
        h1, delta = layer(h, batch.positions, batch.attn, inv_freq, None, cos_sin)
        h1, delta = layer(h1, batch.positions, batch.attn, inv_freq, delta, cos_sin)
        loss = self.head(m.model.norm(delta, h1)[1], batch)
        wrt = [h] + [p for p in list(layer.parameters()) + list(m.model.norm.parameters()) + [m.lm_head_weight]
                     if p.requires_grad]
        torch.autograd.grad(loss, wrt, allow_unused=True)

    def wait(self) -> dict:
        """Wait for the workers (once); returns metrics: kernels compiled, failures, seconds."""
        if self.error is not None:
            log.warning("kernel warm-up skipped (%s); the first update compiles its kernels itself", self.error)
            self.error = None
        if not self.workers:
            return {}
        t0 = time.perf_counter()
        failed, done = [], 0
        for p, n in self.workers:
            lines = [json.loads(x) for x in p.stdout.read().splitlines() if x.startswith('{"kernel"')]
            rc = p.wait()
            done += sum(r["error"] is None for r in lines)
            failed += [r["error"] for r in lines if r["error"] is not None]
            if len(lines) < n:  # that kernel then compiles in the update
                failed += [f"worker exited with code {rc} after {len(lines)} of {n} kernels"] * (n - len(lines))
        self.workers = []
        self.failures = failed
        waited = time.perf_counter() - t0
        total = time.perf_counter() - self.t0
        log.info("kernel warm-up: %d kernel variants compiled in worker processes (%.1f s since the trainer "
                 "started; the update waited %.1f s)%s", done, total, waited,
                 f"; {len(failed)} failed, first: {failed[0]}" if failed else "")
        return {"compile/warmup_kernels": float(done),
                "compile/warmup_failed": float(len(failed)), "compile/waited_s": waited}


def _send(p: subprocess.Popen, text: str) -> None:
    try:
        p.stdin.write(text)
        p.stdin.close()
    except OSError:  # the worker died: wait() counts its kernels as failed
        pass


def policy_head(update, h_TD, batch: PackedBatch):
    """A GRPO update's loss after the final norm (`rlfuse.train.grpo_update.GRPOUpdate`), on
    the dummy batch: the fused log-prob (with entropy when logged) and the policy loss with
    the run's settings, so the warm-up compiles the variants the update launches."""
    g = update.g
    out = update.model.token_logprobs(h_TD[batch.rows], batch.targets, update.logprob_t, return_entropy=g.log_entropy)
    logp_N, ent_N = out if g.log_entropy else (out, None)
    ones = torch.ones_like(logp_N)
    loss, _ = update.policy_loss(logp_N, logp_N.detach(), ones, ones, batch,
                                 logp_N.detach() if update.kl_in_loss else None)
    return loss if ent_N is None else loss + 0.0 * ent_N.sum()


def compile_left(before: dict[str, int]) -> dict:
    """Kernels compiled since `before` (a `triton_compiles()` snapshot), logged by name:
    what the warm-up did not cover."""
    left = new_compiles(before, triton_compiles())
    if left:
        log.info("the first update compiled %d Triton kernel variants: %s", sum(left.values()),
                 ", ".join(f"{k} x{n}" for k, n in sorted(left.items())))
    return {"compile/left_kernels": float(sum(left.values()))}
