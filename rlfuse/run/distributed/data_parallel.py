"""The data-parallel side of a run: what the session, the trainers and the loop call when
the CLI started them under torchrun (`Session.dist` is a DistContext). The building
blocks (sharding, collectives, checkpoints) are rlfuse.run.distributed.context; this file puts
them together for the engine, GRPO's rollouts, micro-batching and evaluation.

Rules every function here keeps (each rank runs the same program on its share):
  * collectives happen at the same points on every rank: the engine's weights are
    gathered at `wake()` and freed at `sleep()`, which every rank calls equally often;
    every rank runs as many forward/backward passes per optimizer step
    (`local_micro_batches` pads with zero-weight micro-batches);
  * host-side work that may raise (generation, scoring, evaluation) runs inside
    `gather_results`, so a failing rank stops all of them with its message;
  * decisions (which groups are kept, how many mini-batches, whether to update) are
    taken on the gathered, global data, hence the same on every rank.
Test: python -m pytest -q tests/test_distributed_run.py
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

from rlfuse.model.fuse import fuse_gathered, unfuse_gathered
from rlfuse.run.batching import pack_by_tokens
from rlfuse.run.distributed.context import DistContext, gather_results, local_slice, max_across_ranks, reduce_metrics
from rlfuse.run.distributed.fsdp import gathered_weights
from rlfuse.run.metrics import to_floats


class GatheredSampler:
    """The `Sampler` of an FSDP-sharded model. `wake()` gathers every weight
    (`gathered_weights`, a collective) and wakes the engine, which runs on exactly those
    tensors; `sleep()` puts the engine to sleep and frees the gathered weights. The
    engine is built at the first `wake()`, inside the block, so it sees the compute dtype
    and plans its KV pool with the weights resident.

    Pointers: the gathered storage is freed at `sleep()` and allocated again at the next
    `wake()`, so weight pointers may move between rollouts. The engine's `sleep()` drops
    its CUDA graphs and its prefix cache, and graphs are captured again on first use
    after `wake()`: nothing captured survives a move (on CPU there are no graphs).

    `fuse` (EngineConfig.fuse_projections): at each `wake()` the gathered q/k/v and
    gate/up weights are moved into fused buffers (`rlfuse.model.fuse.fuse_gathered`: the
    same bytes, not a second copy), so the engine's projections run as one GEMM each under
    FSDP too; `sleep()` undoes it before FSDP frees the gathered weights."""

    def __init__(self, model, make_sampler: Callable[[], object], *, fuse: bool = False):
        self.model, self._make, self.fuse = model, make_sampler, fuse
        self.inner = None
        self._gathered: contextlib.ExitStack | None = None

    def wake(self) -> None:
        if self._gathered is not None:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(gathered_weights(self.model))
        if self.fuse:  # unfused (the callback) before the gathered block's reshard frees FSDP's storage
            stack.callback(unfuse_gathered, fuse_gathered(self.model))
        self._gathered = stack
        if self.inner is None:
            self.inner = self._make()
        self.inner.wake()

    def sleep(self) -> None:
        if self._gathered is None:
            return
        try:
            self.inner.sleep()
        finally:
            self._gathered.close()
            self._gathered = None

    @property
    def llm(self):
        """The engine (after the first `wake()`): what multi-turn episodes and
        `trainer.generate` drive directly."""
        if self._gathered is None:
            raise RuntimeError("GatheredSampler.llm: call wake() first (it gathers the weights on every rank)")
        return self.inner.llm

    @property
    def vision_encodes(self) -> int:
        """The engine's vision-tower runs in the last `generate` (EngineSampler's count)."""
        return 0 if self.inner is None else self.inner.vision_encodes

    def generate(self, prompt_ids, **kw):
        if self._gathered is None:  # the weights are shards: gathering is a collective every rank must join
            raise RuntimeError("GatheredSampler.generate: call wake() first (it gathers the weights on every rank)")
        return self.inner.generate(prompt_ids, **kw)

    def groups(self, prompt_ids, **kw):
        """The engine's groups as they finish (grpo.overlap stream: `EngineSampler.groups`),
        inside one wake (the weights stay gathered while the caller trains between engine steps)."""
        if self._gathered is None:
            raise RuntimeError("GatheredSampler.groups: call wake() first (it gathers the weights on every rank)")
        return self.inner.groups(prompt_ids, **kw)

    def kv_pool_bytes(self) -> int:
        return 0 if self.inner is None else self.inner.kv_pool_bytes()


def rollout_on_ranks(ctx: DistContext, prompts: list, rollout: Callable, *, group_size: int,
                     what: str = "grpo.prompts_per_step"):
    """GRPO's data-parallel rollout. `rollout(local_prompts)` -> (samples, totals,
    per-function rewards, reward error counts) runs on this rank's contiguous block of
    `prompts` (generated and scored where the samples are; a group's G completions stay
    on one rank); then one all-gather gives every rank the global lists in the
    one-process order (sample prompt indices shifted to the global batch; error counts
    summed). Sample j of the global list belongs to rank `owner(j) = j // (G k)`, k =
    prompts per rank. `what` names the config field of the prompt count (its error)."""
    mine = local_slice(prompts, ctx, what=what)
    parts = gather_results(ctx, "rollout", rollout, mine)
    samples, totals, per, errors = [], [], {}, {}
    for r, (s, t, p, e) in enumerate(parts):
        samples += [dataclasses.replace(x, prompt_index=x.prompt_index + r * len(mine)) for x in s]
        totals += list(t)
        for name, vals in p.items():
            per.setdefault(name, []).extend(vals)
        for name, n in e.items():
            errors[name] = errors.get(name, 0) + n
    per_rank = group_size * len(mine)
    return samples, totals, per, errors, (lambda j: j // per_rank)


def episode_metrics_on_ranks(ctx: DistContext, sampler) -> dict:
    """A multi-turn sampler's `last_metrics` (rollout/*: per-episode means over this rank's
    episodes) -> over all ranks: the mean of the ranks' values (ranks run equal numbers of
    episodes, so a per-episode mean is exact; ratios such as the cached fraction and the
    engine's idle fraction are the ranks' mean). A sampler's `rank_ops` ({key: "sum" or
    "max"}) names the exceptions: totals (an agent rollout's token and failure counts) are
    summed, wall times take the slowest rank. A key some rank lacks (a counter no episode
    of it raised) counts 0 there. One all-gather of the dicts."""
    parts = gather_results(ctx, "rollout metrics", lambda: dict(sampler.last_metrics))
    ops = getattr(sampler, "rank_ops", {})
    out = {}
    for k in sorted({k for p in parts for k in p}):
        vals = [float(p.get(k, 0.0)) for p in parts]
        op = ops.get(k, "mean")
        out[k] = sum(vals) if op == "sum" else max(vals) if op == "max" else sum(vals) / len(vals)
    return out


def local_micro_batches(ctx: DistContext, lengths: list[int], budget: int, owned: list[int],
                        shared: list[int] | None = None) -> list[tuple[list[int], bool]]:
    """This rank's micro-batches: the indices `owned` (into `lengths`, a step's global
    list) packed by `budget` tokens, as (indices, pad=False); then (shortest sequence,
    pad=True) entries up to the largest count over ranks. A padding micro-batch is a
    real forward/backward with zero loss weight: every rank must run as many passes as
    the others, since each one all-gathers weights and reduce-scatters gradients.
    `shared[i]`: tokens sequence i shares with sequence i - 1 (`pack_by_tokens`)."""
    mine = None if shared is None else [shared[i] if k and owned[k - 1] == i - 1 else 0 for k, i in enumerate(owned)]
    mbs = [([owned[k] for k in mb], False) for mb in pack_by_tokens([lengths[i] for i in owned], budget, mine)]
    n = max_across_ranks(ctx, len(mbs))
    shortest = min(range(len(lengths)), key=lengths.__getitem__)
    return mbs + [([shortest], True)] * (n - len(mbs))


def reduce_mismatch(ctx: DistContext, mm: dict) -> dict:
    """rlfuse.consistency.mismatch stats of each rank's tokens -> over all ranks: max for
    the maxima, the mean of the ranks' means for the means (ranks hold equal shares of
    prompts; their token counts differ, so this is close to, not exactly, the token mean)."""
    return reduce_metrics(ctx, mm, ops={k: "max" for k in mm if k.endswith("max_abs") or k.endswith("ratio_max")})


def reduce_routing_mismatch(ctx: DistContext, frac: float, pairs: int) -> float | None:
    """moe/routing_mismatch over ranks: the largest of the ranks' fractions of mismatched
    token-layer pairs (a rank that compared no pair counts as none), None when no rank
    compared any. Every rank calls it (one collective per kind, whatever it compared)."""
    r = reduce_metrics(ctx, {"frac": frac if pairs else 0.0, "pairs": float(pairs)},
                       ops={"frac": "max", "pairs": "sum"})
    return r["frac"] if r["pairs"] else None


def evaluate_on_ranks(ctx: DistContext, prompts: list, run_eval: Callable[[list], dict]) -> dict:
    """Held-out evaluation split over ranks: rank r evaluates the r-th of N near-equal
    contiguous parts (any count of prompts; a part may be empty, and `run_eval` must still
    wake the sampler, a collective), then the means are combined weighted by each part's
    `num_problems`, as one process would average them."""
    n, w = len(prompts), ctx.world_size
    part = prompts[ctx.rank * n // w:(ctx.rank + 1) * n // w]
    parts = gather_results(ctx, "eval", run_eval, part)
    total = sum(p["num_problems"] for p in parts)
    out = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        if key == "num_problems":
            out[key] = float(total)
            continue
        have = [p for p in parts if key in p and p["num_problems"] > 0]
        weight = sum(p["num_problems"] for p in have)
        out[key] = sum(p[key] * p["num_problems"] for p in have) / weight if weight else 0.0
    return out


class SilentLog:
    """RunLog's interface for ranks other than 0: rows are returned, nothing is written."""

    def log(self, step: int, metrics: dict, stage: str = "train") -> dict:
        return {"step": step, "stage": stage, **to_floats(metrics)}

    def progress(self, n: int = 1, **postfix) -> None:
        pass

    def samples(self, step: int, rows: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass


def step_metrics(ctx: DistContext, metrics: dict) -> dict:
    """A logged step's metrics, the same on every rank: the largest value over ranks
    (values computed from gathered data or already reduced are equal on every rank;
    times and memory differ, and the slowest / fullest rank is the one to report)."""
    return reduce_metrics(ctx, metrics, default="max")
