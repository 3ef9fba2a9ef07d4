"""Streaming GRPO (`grpo.overlap: stream`): each group is scored, given its advantages and
trained (forward + backward, gradients accumulated) as soon as its G completions finish,
while the engine decodes the rest of the batch; one optimizer step follows the last group.
The weights do not change until then, so every completion is sampled from the policy the
step updates: training stays exactly on-policy.

Equal to sync mode, and how:
  - Same rollouts: `EngineSampler.groups` runs the requests and engine steps `generate`
    runs (`LLM.stream` is `LLM.generate`'s loop), from the same, untouched weights.
  - Same advantages: the estimators allowed here (group with adv_scale group | none, rloo)
    use their group's rewards only; those needing the whole batch (adv_scale batch,
    reinforce_pp*) are refused by `check_stream`, as are mu > 1, mini_batches > 1
    and multi-turn episodes.
  - Same micro-batches: packed within each group (`pack_by_tokens` over its G sequences),
    each weighted by its share of the step's normalizer (`accumulation_weight`). For
    grpo / gspo / dr_grpo that is the sequence count P*G, known before the rollout.
  - Same sum: sync adds the micro-batch gradients into one fp32 sum in sequence order.
    `OrderedGradients` does the same additions in the same order whatever order the groups
    finish in: a group whose predecessors are all summed adds straight into the sum; a
    group that finished early sets the sum aside (`MasterAdamW.take_grads`), computes each
    micro-batch's gradient alone, keeps it as a slot, and puts the sum back; slots are
    added in their place once the groups before them are in (`add_grads` does what the
    backward would have done).
  So the parameters equal sync mode's bit for bit (CPU; exact numerics on CUDA) whenever
  sync's micro-batches are the same: sync packs the whole batch greedily, so its
  micro-batches must cut at group boundaries (always true when micro_batch_tokens is below
  any two sequences' length). Otherwise a sync micro-batch spans two groups and the weight
  gradients' token reductions associate differently: same math, fp32 rounding apart.
  Normalizers known only at the end, and the one rescale that then follows:
    dapo / cispo (token-level mean over the step's T loss tokens): micro-batches are
      weighted by their token count (unnormalized sums) and the gradients and statistics
      divided by max(T, 1) after the last group;
    dynamic_sampling (kept sequences N unknown): weighted by 1 / (P*G), rescaled by
      P*G / N at the end when a group was dropped (no rescale, still bitwise, when none was).
  Both equal sync's loss exactly in real arithmetic; in floating point the backward runs at
  another scale, so parameters agree to fp32 rounding, which AdamW's 1 / sqrt(v) amplifies
  where a gradient element is near 0 (tests: within 1e-4 of each tensor's largest entry
  after 3 steps at lr 1e-2). Statistics summed token-weighted (entropy, clip fractions)
  are divided by T at the end too: equal to sync's to rounding.

Concurrency: on CPU the training work runs between engine steps (interleaved, not
concurrent). On CUDA a worker thread (`_Worker`) runs it on a side stream while the main
thread keeps stepping the engine, so training kernels overlap the decode graph's replays;
the engine steps on a stream of the highest priority, so decode blocks are scheduled
ahead of the training kernels' pending ones (bench_stream.py measures what each side
still costs the other). The decode graphs are captured before the first group trains (a
capture in progress forbids other threads' allocations and syncs). Safe because nothing
the decode reads is written before the optimizer step (gradients go to .grad and the fp32
buffers) and the two never share memory: the KV pool and the graphs' pool are the
engine's, activations come from the side stream's own cache. Both streams first wait for
the main one (memory the last step freed may be reused), and the main one waits for both
before the optimizer step.
Memory: the KV pool stays allocated while groups train (sync mode frees it first), so
activations and gradient slots (an fp32 copy of the gradients per micro-batch held) share
what the pool leaves; engine.gpu_memory_fraction or engine.num_kv_blocks set the split,
logged once at the first step and as memory/kv_pool_mb, memory/train_headroom_mb (free
beside the awake pool) and memory/grad_slots_peak_mb.
stream/overlap_frac = training time spent before the engine finished / all training time
(stream/train_s: that time, each job from its start to its side stream's end).
Data-parallel with a replicated model (LoRA, rlfuse.run.distributed.replicated): each rank
streams its block of the prompts and trains its groups locally (no collective while the
engine decodes); after its last group, one sum of (kept sequences, loss tokens) over ranks
gives the global normalizers of the rescale, ReplicatedAdamW sums the gradients, and one
all-gather gives every rank the whole rollout (its metrics as in one process). Both kinds
run the rollout and its training in `fail_together`: a rank that raises stops every rank.
FSDP2-sharded (full fine-tune): the engine decodes from the gathered groups; in
`local_gradients` a training pass is no collective (gradient sync, reshard-after-backward
off): each rank trains its groups as they finish, FSDP2 summing its unsharded fp32 gradients
locally (4 bytes per parameter per rank; no slots). After the rollout one zero-weight pass
with sync on (`reduce_local_gradients`) reduce-scatters them; the engine sleeps, the rescale
and step follow. OrderedGradients cannot reorder FSDP2's (private) buffers, so groups add in
finishing order: sync's result to fp32 rounding, not bitwise (same rollouts, mismatch 0). On
CUDA the interleaved runner (FSDP2 hooks on a worker thread never ran on GPUs; `threaded`).
Test: python -m pytest -q tests/test_grpo_stream.py   Bench: python benchmarks/bench_stream.py
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import queue
import threading
import time

import torch

from rlfuse.kernels.loss.policy import TOKEN_MEAN_TYPES
from rlfuse.model.lora import BaseModelView
from rlfuse.rollout import media_kwargs, score_samples
from rlfuse.run import pack_by_tokens
from rlfuse.run.distributed import (
    fail_together,
    gather_results,
    global_sums,
    is_sharded,
    local_gradients,
    local_slice,
    reduce_local_gradients,
)
from rlfuse.train.advantages import token_advantages, zero_variance_groups

log = logging.getLogger(__name__)


class OrderedGradients:
    """Sums per-micro-batch gradients into the optimizer's accumulators in (group,
    micro-batch) order, whatever order the groups are trained in (module docstring).
    `ordered` False (an FSDP2-sharded model): straight into the sum, in finishing order."""

    def __init__(self, optimizer, num_groups: int, ordered: bool = True):
        self.opt, self.ordered = optimizer, ordered
        self.done: list[list | None] = [None] * num_groups  # per group, once trained: its held slots
        self.next = 0  # every group before it is in the sum
        self.held_bytes = self.peak_bytes = self.held = self.peak_held = 0

    def run_group(self, i: int, micro_batches: list) -> None:
        """Run group i's micro-batch backwards (callables, in order) into the sum or slots."""
        if i == self.next or not self.ordered:
            for backward in micro_batches:
                backward()
            self.done[i] = []
        else:
            aside = self.opt.take_grads()
            slots = []
            for backward in micro_batches:
                backward()
                slots.append(self.opt.take_grads())
                self.held += 1
                self.held_bytes += sum(g.nbytes for g in slots[-1] if g is not None)
            self.opt.put_grads(aside)
            self.done[i] = slots
            self.peak_held, self.peak_bytes = max(self.peak_held, self.held), max(self.peak_bytes, self.held_bytes)
        self._fold()

    def skip(self, i: int) -> None:
        """Group i trains nothing (dropped by dynamic sampling)."""
        self.done[i] = []
        self._fold()

    def _fold(self) -> None:
        while self.next < len(self.done) and self.done[self.next] is not None:
            for slot in self.done[self.next]:
                self.opt.add_grads(slot)
                self.held -= 1
                self.held_bytes -= sum(g.nbytes for g in slot if g is not None)
            self.done[self.next] = []
            self.next += 1


class _Interleaved:
    """Runs each job at once, between engine steps (CPU; an FSDP2-sharded model on CUDA)."""

    def __init__(self):
        self.spans: list[tuple[float, float]] = []

    def submit(self, job) -> None:
        t0 = time.perf_counter()
        job()
        self.spans.append((t0, time.perf_counter()))

    decoding = staticmethod(contextlib.nullcontext)  # the engine steps in the caller's context

    def finish(self) -> None:  # as close and decoded: nothing is pending
        pass

    close = decoded = finish


class _Worker:
    """Runs jobs in submission order on a worker thread while the main thread steps the
    engine; on CUDA on a side stream, the engine on a high-priority one. The thread
    inherits the caller's context (kernel backend and numerics settings); its first error
    is raised by `finish`. (CPU: tests of the threaded path, `StreamStep.threaded`.)"""

    def __init__(self, device: torch.device, lock: threading.Lock | None = None):
        self.device, self.cuda = device, device.type == "cuda"
        self.lock = lock  # held by each job's host side (`serialized`)
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            # the engine decodes on a stream of the highest priority: the decode kernels'
            # blocks are scheduled before the training kernels' pending ones, not behind them
            self.decode = torch.cuda.Stream(device, priority=-100)
            main = torch.cuda.current_stream(device)
            self.stream.wait_stream(main)  # memory the last step freed may be reused on either
            self.decode.wait_stream(main)
        self.jobs: queue.Queue = queue.Queue()
        self.spans: list[tuple[float, float]] = []
        self.error: BaseException | None = None
        # the context copied: the ambient kernel backend of the ops outside the model (the policy loss);
        # the model enters its own settings (CausalLM.kernels) in any thread
        self.thread = threading.Thread(target=contextvars.copy_context().run, args=(self._loop,), daemon=True,
                                       name="rlfuse-stream-train")
        self.thread.start()

    def _loop(self) -> None:
        with (torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext()), \
                (torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()):
            while (job := self.jobs.get()) is not None:
                if self.error is not None:
                    continue
                t0 = time.perf_counter()
                try:
                    with self.lock or contextlib.nullcontext():
                        job()
                    if self.cuda:
                        self.stream.synchronize()  # host sync (worker only): the span covers the GPU work
                except BaseException as e:  # noqa: BLE001 -- re-raised on the main thread by finish()
                    self.error = e
                self.spans.append((t0, time.perf_counter()))

    def submit(self, job) -> None:
        self.jobs.put(job)

    def decoding(self):
        """The context the engine steps in: its high-priority stream."""
        return torch.cuda.stream(self.decode) if self.cuda else contextlib.nullcontext()

    def decoded(self) -> None:
        """After the last engine step: the main stream waits for the decode stream."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.decode)

    def finish(self) -> None:
        self.close()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Stop the worker after the jobs queued so far; the main stream then waits for it."""
        if self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join()
        if self.cuda:
            main = torch.cuda.current_stream(self.device)
            main.wait_stream(self.decode)
            main.wait_stream(self.stream)


def serialized(groups, lock: threading.Lock | None):
    """`groups`, each engine step taken under `lock` (held by the worker's jobs): FSDP2's hooks,
    which the engine's layer calls fire too, are not thread-safe (a concurrent step resharded a layer mid-forward)."""
    while True:
        with lock or contextlib.nullcontext():
            item = next(groups, None)
        if item is None:
            return
        yield item


def overlap_fraction(spans: list[tuple[float, float]], gen_start: float, gen_end: float) -> float:
    """Share of the spans' total time that lies inside [gen_start, gen_end]."""
    total = sum(b - a for a, b in spans)
    inside = sum(max(0.0, min(b, gen_end) - max(a, gen_start)) for a, b in spans)
    return inside / total if total > 0 else 0.0


class StreamStep:
    """The rollout + update of one GRPO step in stream mode, for `GRPOStep.step`."""

    def __init__(self, trainer):
        self.tr = trainer
        self.logged = False  # the memory split, once
        self.threaded: bool | None = None
        """Train on a worker thread (None: on CUDA unless sharded; True on CPU tests the threaded path)."""
        self.sharded = is_sharded(trainer.model)
        why = {f"a sampler that does not stream groups ({type(trainer.sampler).__name__})":
                   not hasattr(trainer.sampler, "groups"),
               "LoRA with grpo.kl_coef > 0 (its reference switches the adapters the engine decodes with)":
                   isinstance(trainer.ref_model, BaseModelView)}
        bad = [k for k, hit in why.items() if hit]
        if bad:
            raise ValueError(f"grpo.overlap stream does not support {'; '.join(bad)}: use grpo.overlap sync")

    def run(self, prompts, step: int, timer):
        """-> (samples, total rewards, per-function rewards, reward error counts, per-token
        advantages, training metrics), as the sync path has them after its `_train`.
        Data-parallel (replicated or sharded): this rank streams its block of `prompts`, then one
        all-gather gives every rank the whole rollout in the one-process order."""
        ctx = self.tr.dist
        if ctx is None:
            return self._stream(prompts, step, timer, len(prompts))
        mine = local_slice(prompts, ctx, what="grpo.prompts_per_step")
        *rollout, out = self._stream(mine, step, timer, len(prompts))
        samples, total, per, errors, adv = [], [], {}, {}, []
        for r, (s, t, p, e, a) in enumerate(gather_results(ctx, "rollout", lambda: rollout)):
            samples += [dataclasses.replace(x, prompt_index=x.prompt_index + r * len(mine)) for x in s]
            total += t
            adv += a
            for name, vals in p.items():
                per.setdefault(name, []).extend(vals)
            for name, n in e.items():
                errors[name] = errors.get(name, 0) + n
        return samples, total, per, errors, adv, out

    def _stream(self, prompts, step: int, timer, num_prompts: int):
        """`run` on this process's `prompts` (of the step's `num_prompts` over all ranks)."""
        tr, up, g = self.tr, self.tr.update, self.tr.g
        P, G = len(prompts), g.group_size
        samples, total, adv = ([None] * (P * G) for _ in range(3))  # in sequence order, filled as groups finish
        per: dict[str, list] = {}
        # provisional normalizers (module docstring): all sequences of the step; tokens unnormalized
        totals = (num_prompts * G, 1.0)
        check = up.numerics == "exact" and g.check_every > 0 and step % g.check_every == 0
        grads = OrderedGradients(tr.optimizer, P, ordered=not self.sharded)
        mb_sums: list[list[dict]] = [[] for _ in range(P)]  # per group, per micro-batch: summed in order at the end
        n_tok, kept = [0], []  # tokens trained; the kept groups, in finishing order
        loss_tokens = [0.0] * P
        old: dict = {}
        capture = [([], [], []) for _ in range(P)]
        cuda = tr.device.type == "cuda"
        threaded = cuda and not self.sharded if self.threaded is None else self.threaded
        lock = threading.Lock() if threaded and self.sharded else None  # `serialized`
        runner = _Worker(tr.device, lock) if threaded else _Interleaved()
        local = contextlib.ExitStack()  # sharded: the stream's passes accumulate locally (module docstring)

        def train_group(i: int, seqs: list[int]) -> None:
            if up.recompute_old or check:  # this rank's group: no collective (replicated, or in local_gradients)
                old.update(up.trainer_logprobs(prompts, samples, seqs, local=True))
            lengths = [len(up.prompt_ids(prompts, samples[j])) + len(samples[j].token_ids) for j in seqs]

            def backward(mb):
                def run():
                    s, n = up.accumulate_gradients(prompts, samples, adv, seqs, capture[i],
                                                   old=old if up.recompute_old else None,
                                                   micro_batches=[(mb, False)], totals=totals)
                    mb_sums[i].append(s)
                    n_tok[0] += n
                return run
            grads.run_group(i, [backward(mb) for mb in pack_by_tokens(lengths, g.micro_batch_tokens)])

        def take_group(i: int, group: list) -> None:
            """Score a finished group and queue its training (between engine steps)."""
            seqs = list(range(i * G, (i + 1) * G))
            samples[i * G:(i + 1) * G] = group
            t_i, per_i = score_samples(prompts, group, tr.rewards, G)
            total[i * G:(i + 1) * G] = t_i
            for k, v in per_i.items():
                per.setdefault(k, [None] * (P * G))[i * G:(i + 1) * G] = v
            r_i = torch.tensor(t_i, dtype=torch.float32)
            adv[i * G:(i + 1) * G] = token_advantages(g.advantage, r_i, [len(s.token_ids) for s in group], G,
                                                      adv_scale=g.adv_scale, eps=g.adv_eps)
            if g.dynamic_sampling and bool(zero_variance_groups(r_i, G)[0]):  # host: CPU rewards
                runner.submit(lambda: grads.skip(i))
                return
            kept.append(i)
            loss_tokens[i] = sum(float(up.loss_mask(s).sum()) * (0.0 if g.mask_truncated and s.truncated else 1.0)
                                 for s in group)
            runner.submit(lambda: train_group(i, seqs))

        fail = fail_together(tr.dist, "stream rollout") if tr.dist is not None else contextlib.nullcontext()
        try:
            with fail:
                with timer("generate"):
                    tr.sampler.wake()
                    local.enter_context(local_gradients(tr.model) if self.sharded else contextlib.nullcontext())
                    kv_bytes, headroom = tr.sampler.kv_pool_bytes(), self._headroom(step, P)
                    gen_start = time.perf_counter()
                    with runner.decoding():
                        for i, group in serialized(tr.sampler.groups(
                                [p.ids for p in prompts], n=G, temperature=g.temperature, top_p=g.top_p,
                                top_k=g.top_k, max_tokens=g.max_new_tokens, seed=g.seed + step, capture=cuda,
                                **media_kwargs(prompts)), lock):
                            take_group(i, group)
                    runner.decoded()
                    gen_end = time.perf_counter()
                    if not self.sharded:
                        tr.sampler.sleep()
                with timer("train"):
                    runner.finish()
            if self.sharded:  # the weights stay gathered until every local pass ran and was reduced
                with timer("train"):
                    short = min(range(P * G), key=lambda j: len(samples[j].token_ids))  # the zero pass: padding's
                    reduce_local_gradients(tr.model, lambda: up.accumulate_gradients(
                        prompts, samples, adv, [short], micro_batches=[([0], True)], totals=totals))
                    local.close()
                    tr.sampler.sleep()
        except BaseException:  # the worker must not outlive a failed rollout
            runner.close()
            local.close()
            raise
        with timer("train"):
            n_kept, n_loss = float(len(kept) * G), sum(loss_tokens)
            if tr.dist is not None:  # the step's normalizers over every rank's groups
                n_kept, n_loss = global_sums(tr.dist, [n_kept, n_loss])
            if not n_kept:
                tr.optimizer.zero_grad()  # sharded: the zero pass left zero gradients
                out = {"_train_tokens": 0.0, "skipped_update": 1.0}
            else:
                kept.sort()  # finishing order -> group order
                seqs = [j for i in kept for j in range(i * G, (i + 1) * G)]
                sums: dict = {}
                for s in (s for i in kept for s in mb_sums[i]):  # sync's order: statistics equal too
                    for k, v in s.items():
                        sums[k] = sums.get(k, 0.0) + v
                if tr.dist is not None:  # a rank that kept no group: its partial sums are 0
                    keys = set().union(*gather_results(tr.dist, "statistics", lambda: set(sums)))
                    sums = {k: sums.get(k, torch.zeros((), device=tr.device)) for k in sorted(keys)}
                cap = tuple([x for i in kept for x in capture[i][c]] for c in range(3))  # sequence order, as sync's
                out = self._update(step, sums, n_tok[0], seqs, n_loss, n_kept, num_prompts * G, cap, check, old,
                                   samples)
        out.update({"stream/overlap_frac": overlap_fraction(runner.spans, gen_start, gen_end),
                    "stream/train_s": sum(b - a for a, b in runner.spans),
                    "stream/grad_slots_max": float(grads.peak_held),
                    "memory/grad_slots_peak_mb": grads.peak_bytes / 2**20,
                    "memory/kv_pool_mb": kv_bytes / 2**20})
        if headroom is not None:
            out["memory/train_headroom_mb"] = headroom / 2**20
        return samples, total, per, dict(tr.rewards.error_counts), adv, out

    def _headroom(self, step: int, num_groups: int) -> int | None:
        """CUDA: the memory training has beside the KV pool (free on the device plus cached
        by torch, unused); logged once with the worst case of the gradient slots."""
        tr = self.tr
        if tr.device.type != "cuda":
            return None
        free = torch.cuda.mem_get_info(tr.device)[0] + torch.cuda.memory_reserved(tr.device) \
            - torch.cuda.memory_allocated(tr.device)
        if not self.logged:
            self.logged = True
            slot = sum(p.numel() * 4 for p in tr.optimizer.params) / 2**30  # fp32: per held slot, or the local sum
            slots = (f"the locally summed unsharded fp32 gradients ({slot:.2f} GiB on every rank: FSDP2-sharded)"
                     if self.sharded else f"gradient slots ({slot:.2f} GiB each, at most {num_groups - 1} held if "
                                          "all but the last group finish early)")
            log.info("grpo.overlap stream: KV pool %.2f GiB; beside it %.2f GiB for training activations and %s; "
                     "engine.gpu_memory_fraction / engine.num_kv_blocks move the split",
                     tr.sampler.kv_pool_bytes() / 2**30, free / 2**30, slots)
        return free

    def _update(self, step: int, sums: dict, n_tok: int, seqs: list[int], loss_tokens: float, kept: float,
                provisional: int, capture, check: bool, old: dict, samples) -> dict:
        """Rescale what was summed under the provisional normalizers (module docstring: of
        `provisional` sequences, `kept` of them trained, `loss_tokens` loss tokens, over all
        ranks), then the step's one optimizer step; its metrics as `GRPOUpdate.train` gives
        them. `seqs`: this rank's kept sequences."""
        tr, up, g = self.tr, self.tr.update, self.tr.g
        stat_scale = 1.0 / max(loss_tokens, 1.0)  # statistics: token-weighted sums, unnormalized
        if g.loss_type in TOKEN_MEAN_TYPES:
            grad_scale = stat_scale
        else:  # no multiply when every group was kept: the gradient stays bitwise sync's
            grad_scale = provisional / kept if kept != provisional else None
        if grad_scale is not None:
            for grad in tr.optimizer.grads():
                grad.mul_(grad_scale)
        sums = {k: v * (grad_scale or 1.0) if k == "loss" else v * stat_scale for k, v in sums.items()}
        extra = up.full_mismatch(samples, seqs, old, check, step) if (up.recompute_old or check) else {}
        stats = up.apply_update(sums, n_tok, step)  # mu = mini_batches = 1: optimizer step `step`
        n_trained = stats.pop("_tokens")
        return up.metrics({k: [v] for k, v in stats.items()}, capture, extra, n_trained)
