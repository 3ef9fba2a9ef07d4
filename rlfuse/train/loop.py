"""The run loop every trainer shares (SFT, GRPO and those to come).

    session = open_session(cfg)                   # run folder, config.yaml, seeds, data, model
    trainer = SFTStep(cfg, session.model, make_optimizer(session.model, cfg), stream)
    result = run_loop(trainer, session, evaluation=Evaluation(...))

The loop owns everything that is not the step: resuming (weights, optimizer and RNG
states, then the trainer's own state, from a checkpoint), the metrics sink
(metrics.jsonl, TensorBoard, progress bar: `RunLog`, created here only), sample dumps,
the evaluation and checkpoint cadences, the final save and the summary it returns. A
trainer supplies its step and its state (`Trainer`); the cadence it wants is its
`Schedule`.

Steps: `trainer.step(s)` performs step s (0-based); then `done = s + 1` steps exist and
everything after it is labelled `done`. With N = trainer.schedule.steps:
  log         every logging.log_every steps and at N (the trainer's metrics, plus
              optim/update_ratio: the step's largest relative weight update)
  samples     every schedule.sample_every steps (trainer.samples())
  eval        at 0 when schedule.eval_at_start (fresh runs only), every
              schedule.eval_every steps before N, and at the end
  checkpoint  every checkpoint.every steps before N; at the end when checkpoint.save_final
  final       RUN_DIR/final, an HF folder of the weights (+ tokenizer), at the end
  data        the session's data metrics (rows kept / dropped / truncated by reason),
              once, as a step-0 row of stage "data", when the run starts afresh
"The end" is step N, or the step after which `stop_when(done)` returned True. A run cut
short by `stop_after` (tests of resume) stops without any of it. A stop signal
(rlfuse.run.interrupt: SIGINT / SIGTERM under the CLI) is honoured at the next step
boundary, agreed over ranks: a checkpoint of the steps done, then `Interrupted`.
Data-parallel (`session.dist`): rank 0 resolves the resume and alone writes metrics,
samples and the progress bar (other ranks get rlfuse.run.distributed.data_parallel.SilentLog);
logged metrics are reduced over ranks with the per-rank memory of params, gradients and
optimizer state; evaluation is split over ranks; checkpoints are sharded and the final
weights are gathered on rank 0 (rlfuse.run.checkpoint).
Test: python -m pytest -q tests/test_train_loop.py tests/test_checkpoint.py
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol

import torch

from rlfuse.data import Prompt
from rlfuse.model.fuse import fuse_projections, is_fused
from rlfuse.model.lora import BaseModelView, has_lora, lora_memory
from rlfuse.model.weights import parse_dtype
from rlfuse.rollout import RewardSet, evaluate
from rlfuse.run import (
    DATA_STAGE,
    Interrupted,
    MasterAdamW,
    ReplicatedAdamW,
    RunLog,
    WeightNormWatch,
    load_checkpoint,
    log_replicated_memory,
    open_trackers,
    resolve_resume,
    save_checkpoint,
    save_final,
    stop_agreed,
)
from rlfuse.run.config import RunConfig
from rlfuse.run.distributed import (
    DistContext,
    ShardedAdamW,
    SilentLog,
    evaluate_on_ranks,
    is_sharded,
    log_memory,
    on_main,
    reshard,
    step_metrics,
)
from rlfuse.train.session import Session

log = logging.getLogger(__name__)


def reference_model(model):
    """The frozen reference of KL terms and DPO. With LoRA adapters: the model itself with
    its adapters off (`BaseModelView`: no copy, bit for bit the base model). Else a separate,
    grad-free copy of `model`'s weights (not deepcopy: that would also copy whatever the
    parameters' hooks reference, e.g. the optimizer)."""
    if has_lora(model):
        return BaseModelView(model)
    with torch.device("meta"):
        ref = type(model)(model.config).to(model.lm_head_weight.dtype)
    ref = ref.to_empty(device=model.lm_head_weight.device)
    ref.load_state_dict(model.state_dict())
    ref.kernels = model.kernels
    if is_fused(model):  # the policy's GEMMs, so KL is 0 before the first update in fast numerics too
        fuse_projections(ref)
    return ref.requires_grad_(False).eval()


def make_optimizer(model: torch.nn.Module, cfg: RunConfig, dist: DistContext | None = None) -> MasterAdamW:
    """MasterAdamW over every parameter of `model` that requires grad (with LoRA: A and B
    only, so the frozen base gets no optimizer state) with the run's optim settings (the
    learning rate itself is set per step by the trainer's schedule); for an FSDP-sharded
    model torch's AdamW on the fp32 shards behind the same interface (ShardedAdamW); for a
    model replicated on the ranks of `dist` (LoRA) MasterAdamW whose gradients are summed
    across ranks before each step (ReplicatedAdamW)."""
    o = cfg.optim
    kw = dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if is_sharded(model):
        return ShardedAdamW(model, **kw, compute_dtype=parse_dtype(cfg.model.dtype))
    if dist is not None:
        return ReplicatedAdamW(model.parameters(), dist, **kw)
    return MasterAdamW(model.parameters(), **kw)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """The cadence a trainer asks of the loop (module docstring)."""
    steps: int
    """Steps of the whole run (a resumed run continues up to it)."""
    eval_every: int = 0
    """Held-out evaluation every this many steps (0: only at the end)."""
    eval_at_start: bool = False
    """Also evaluate before the first step (the baseline a run is compared with)."""
    sample_every: int = 0
    """Write trainer.samples() every this many steps (0: never)."""
    headline: str = "loss"
    """The metric the progress bar shows beside the step time."""


class Trainer(Protocol):
    stage: str
    """Labels the metrics rows and the progress bar ("sft", "grpo")."""
    schedule: Schedule
    model: torch.nn.Module
    optimizer: MasterAdamW

    def step(self, step: int) -> dict:
        """Perform step `step` (0-based); its metrics (floats or 0-d tensors, no host sync needed)."""

    def state_dict(self) -> dict:
        """What a checkpoint must hold besides weights, optimizer and RNG states (e.g. the
        data position) to continue exactly."""

    def load_state_dict(self, state: dict) -> None:
        """Restore from a checkpoint's state (what `state_dict` gave, plus "step")."""

    def samples(self) -> list[dict]:
        """Rows describing the last step's completions for samples.jsonl ([] if none)."""


class StreamAndGuardState:
    """The resumable state of a trainer whose own state is its data stream (`self.stream`)
    and its non-finite-step guard (`self.guard`): the Trainer protocol's state methods."""

    def state_dict(self) -> dict:
        return {"data": self.stream.state_dict(), "nonfinite": self.guard.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["data"])
        if "nonfinite" in state:  # checkpoints written before the guard have none
            self.guard.load_state_dict(state["nonfinite"])


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Evaluation:
    """Held-out greedy evaluation (`rlfuse.rollout.evaluate.evaluate`) on the session's sampler."""
    prompts: list[Prompt]
    rewards: RewardSet
    max_new_tokens: int


def run_loop(trainer: Trainer, session: Session, *, evaluation: Evaluation | None = None,
             stop_after: int | None = None, stop_when: Callable[[int], bool] | None = None) -> dict:
    """Train `trainer` to trainer.schedule.steps with the cadences of the module docstring;
    resumes per cfg.checkpoint.resume. Returns {"history": logged rows, "evals": eval rows,
    "steps": steps done, "run_dir", "model", "tokenizer", "data": session.data_stats}."""
    cfg, sched = session.cfg, trainer.schedule
    dist = session.dist
    start = 0
    ckpt = (resolve_resume(cfg.checkpoint.resume, session.run_dir) if dist is None else
            on_main(dist, "resume", resolve_resume, cfg.checkpoint.resume, session.run_dir))
    sharded = dist if is_sharded(trainer.model) else None  # else one process, or a replicated model (LoRA)
    if ckpt is not None:
        state = load_checkpoint(ckpt, trainer.model, trainer.optimizer, dist=dist)
        trainer.load_state_dict(state)
        start = state["step"]
    if dist is None or dist.is_main:
        trackers = open_trackers(cfg, session.run_dir, run_name=f"{session.run_dir.name}/{trainer.stage}")
        runlog = RunLog(session.run_dir, tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress,
                        total=sched.steps, desc=trainer.stage, initial=start, trackers=trackers)
    else:
        runlog = SilentLog()
    history, evals = [], []
    # sharded: the shards (a reference pass, e.g. DPO's precompute, may have left weights gathered)
    params = (reshard(trainer.model) if sharded is not None else trainer.model).parameters()
    watch = WeightNormWatch(params, dist=sharded)  # a replica's norm is the whole norm
    if start == 0 and session.data_stats:  # once per run: a resumed run keeps the row of its start
        runlog.log(0, session.data_stats, stage=DATA_STAGE)
    # LoRA: parameter counts and the training state the frozen base does not need, in every row
    lora_rows = lora_memory(trainer.model) if has_lora(trainer.model) else {}

    def do_eval(step: int) -> None:
        if evaluation is None:
            return
        sampler = session.sampler

        def run_eval(prompts):
            return evaluate(sampler, prompts, evaluation.rewards, max_new_tokens=evaluation.max_new_tokens)
        res = run_eval(evaluation.prompts) if dist is None else evaluate_on_ranks(dist, evaluation.prompts, run_eval)
        sampler.sleep()
        runlog.log(step, res, stage="eval")
        evals.append({"step": step, **res})
        log.info("%s eval step %d: %s", trainer.stage, step, {k: round(v, 4) for k, v in res.items()})

    saved = start if ckpt is not None else None

    def save(step: int):
        nonlocal saved
        saved = step
        return save_checkpoint(session.run_dir, step, trainer.model, trainer.optimizer, trainer.state_dict(),
                               tokenizer=session.tokenizer, keep_last=cfg.checkpoint.keep_last, dist=dist)

    done = start
    finished = False
    try:
        watch.check(start)
        if start == 0 and sched.eval_at_start:
            do_eval(0)
        while done < sched.steps:
            if stop_after is not None and done - start >= stop_after:
                break
            if (signum := stop_agreed(dist)) is not None:
                path = save(done) if done != saved and done > 0 else None
                log.warning("%s: stopped by a signal after step %d%s", trainer.stage, done,
                            f"; checkpoint {path}" if path else "")
                raise Interrupted(signum, done, str(path) if path else None)
            m = trainer.step(done)
            # the largest ||dW|| / ||W|| of the step's optimizer steps (MasterAdamW; a 0-d device
            # tensor, read with the other metrics; FSDP2's ShardedAdamW does not measure it)
            pop = getattr(trainer.optimizer, "pop_update_ratio", None)
            if pop is not None and (ratio := pop()) is not None:
                m["optim/update_ratio"] = ratio
            done += 1
            if done % cfg.logging.log_every == 0 or done == sched.steps:
                watch.check(done)
                if dist is not None:  # the same row on every rank, with each rank's memory (max over ranks)
                    m = {**step_metrics(dist, m), **(
                        log_memory(dist, trainer.model, trainer.optimizer.opt,
                                   compute_dtype=trainer.optimizer.compute_dtype) if sharded is not None else
                        log_replicated_memory(dist, trainer.model, trainer.optimizer))}
                row = runlog.log(done, {**m, **lora_rows}, stage=trainer.stage)
                history.append(row)
                runlog.progress(1, **{sched.headline: row.get(sched.headline)}, s_per_step=row.get("time/step"))
            else:
                runlog.progress(1)
            if sched.sample_every and done % sched.sample_every == 0:
                runlog.samples(done, trainer.samples()[:cfg.logging.num_samples])
            if stop_when is not None and stop_when(done):
                log.info("%s: stop condition met after step %d", trainer.stage, done)
                finished = True
                break
            if sched.eval_every and done % sched.eval_every == 0 and done < sched.steps:
                do_eval(done)
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < sched.steps:
                save(done)
        if finished or done >= sched.steps:
            if cfg.checkpoint.save_final:
                save(done)
            save_final(session.run_dir, trainer.model, session.tokenizer, dist=dist,
                       dtype=parse_dtype(cfg.model.dtype))
            do_eval(done)
    finally:
        runlog.close()
    return {"history": history, "evals": evals, "steps": done, "run_dir": str(session.run_dir),
            "model": trainer.model, "tokenizer": session.tokenizer, "data": dict(session.data_stats)}
