"""GRPO (and DAPO / Dr. GRPO / GSPO) on the engine's own weights.

One step:
  1. generate  : P prompts x G completions from the engine (it shares the parameters),
                 with per-token log-probs; then the engine sleeps (KV pool freed).
  2. score     : reward functions -> total reward r (P*G,), advantages by the estimator
                 `grpo.advantage` (rlfuse.train.advantages); optional dynamic sampling
                 drops zero-variance groups; optional masking of truncated completions.
  3. train     : (rlfuse.train.grpo_update) mu passes over the batch, each split into `mini_batches` optimizer
                 steps; each optimizer step packs its sequences into micro-batches of at
                 most `micro_batch_tokens` tokens and accumulates gradients of the policy
                 loss (rlfuse.kernels.loss.policy: reference, Triton path, backend choice), each
                 micro-batch weighted by its share of the full batch's normalizer, so the
                 accumulated gradient equals that of the loss on the whole mini-batch.
                 Old log-probs = the engine's, or the trainer's own no-grad forward
                 where an off-policy correction needs them; the trainer-vs-rollout
                 difference is logged (rlfuse.consistency).
  With kl_coef > 0 a frozen reference copy gives ref log-probs for the KL term (with LoRA:
  the model itself with its adapters off, no copy).
The optimizer writes into the same parameter tensors, so the next generate uses them.
`grpo.overlap: stream` does 2-3 group by group during 1 (rlfuse.train.grpo_stream).
Data-parallel (`dist`): each rank generates and scores its block of the step's prompts,
then every rank holds the global samples and scores (rlfuse.run.distributed.data_parallel), so
advantages, kept groups and mini-batches are the one-process ones; each rank trains on
its own sequences of each mini-batch with the global normalizers, padded to the same
number of micro-batches, and the loss statistics are summed over ranks.
Run: rlfuse grpo RECIPE.yaml   Test: python -m pytest -q tests/test_grpo_trainer.py
"""

from __future__ import annotations

import logging
import math
import time

import torch

from rlfuse.data import Prompt, PromptStream, build_prompts
from rlfuse.model.weights import parse_dtype
from rlfuse.rollout import RewardSet, Sample, Sampler, media_kwargs, score_samples
from rlfuse.run import MasterAdamW, NonFiniteGuard, PhaseTimer, StepProfiler, peak_memory_mb, step_profiler
from rlfuse.run.config import RunConfig
from rlfuse.run.distributed import (
    DistContext,
    episode_metrics_on_ranks,
    full_copy,
    global_sums,
    is_sharded,
    rollout_on_ranks,
)
from rlfuse.train.advantages import KL_IN_REWARD, drop_rewards, token_advantages, zero_variance_groups
from rlfuse.train.grpo_stream import StreamStep
from rlfuse.train.grpo_update import GRPOUpdate
from rlfuse.train.loop import Evaluation, Schedule, StreamAndGuardState, make_optimizer, reference_model, run_loop
from rlfuse.train.session import Session, kernel_settings, open_session

log = logging.getLogger(__name__)


def _mean(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


class GRPOStep(StreamAndGuardState):
    """The GRPO step and its state (a `rlfuse.train.loop.Trainer`, which `run_loop` runs):
    rollouts of `stream`'s prompts from `sampler`, scored by `rewards`, trained into `model`."""

    stage = "grpo"

    def __init__(self, cfg: RunConfig, model, sampler: Sampler, rewards: RewardSet, stream: PromptStream,
                 optimizer: MasterAdamW, ref_model=None, dist: DistContext | None = None,
                 profiler: StepProfiler | None = None):
        self.cfg, self.g = cfg, cfg.grpo
        self.dist = dist
        self.profiler = profiler  # logging.profile_step: one phase of one step under torch.profiler
        self.model, self.sampler, self.rewards, self.stream = model, sampler, rewards, stream
        self.optimizer = optimizer
        self.guard = NonFiniteGuard(cfg.optim.max_nonfinite_steps, dist=dist)
        self.device = model.lm_head_weight.device
        self.schedule = Schedule(steps=self.g.steps, eval_every=self.g.eval_every, eval_at_start=True,
                                 sample_every=self.g.sample_every, headline="reward/mean")
        if self.g.kl_coef > 0 and ref_model is None:
            # the weights the run starts from (built before a resume loads the checkpoint)
            ref_model = reference_model(model)
        self.ref_model = ref_model if self.g.kl_coef > 0 else None
        if self.ref_model is not None:
            self.ref_model.requires_grad_(False).eval()
        kernel_settings(cfg, model, self.ref_model)
        # multi-turn episodes (rollout.tools / rollout.env): samples carry a loss mask over the
        # model's tokens and their own prompt ids; observation tokens are context only
        self.multi_turn = cfg.rollout.multi_turn
        if self.multi_turn and not hasattr(sampler, "episodes"):
            raise ValueError("rollout.tools / rollout.env need a multi-turn sampler (the session builds one); "
                             f"got {type(sampler).__name__}")
        # the update (grpo_update.py): gradient accumulation, log-prob and mismatch helpers, the optimizer step
        self.update = GRPOUpdate(cfg, model, optimizer, self.guard, ref_model=self.ref_model, dist=dist)
        self.streamer = StreamStep(self) if self.g.overlap == "stream" else None
        self.last_samples: list[dict] = []
        # A batch whose every group has equal rewards has zero policy gradient under the
        # group-relative estimators (no KL or router term): its optimizer step would only
        # replay Adam's momentum, moving the weights along the last informative direction
        # with no new signal. docs/agents.md ("When GRPO does not help") measured that drift
        # taking greedy accuracy from 0.34 to 0.055 in 6 such steps; so such a step's
        # optimizer step is skipped (grpo.dynamic_sampling skips the whole update).
        self._no_signal_no_step = (self.g.advantage in ("group", "rloo") and self.ref_model is None
                                   and self.update.router is None and self.streamer is None)
        self._no_signal_warned = 0

    def samples(self) -> list[dict]:
        return self.last_samples

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict:
        g = self.g
        t_start = time.perf_counter()
        timer = PhaseTimer(self.device, profile=self.profiler.at(step) if self.profiler is not None else None)
        prompts: list[Prompt] = self.stream.take(g.prompts_per_step)
        trained = None
        if self.streamer is not None:  # grpo.overlap stream: each group trained as it finishes
            samples, total, per, errors, adv, trained = self.streamer.run(prompts, step, timer)
        elif self.dist is None:
            samples, total, per, errors = self._rollout(prompts, step, timer)
        else:
            # rank r's episodes are numbered (seeded) from its first prompt's global place
            first = self.dist.rank * (g.prompts_per_step // self.dist.world_size) * g.group_size
            samples, total, per, errors, self.update.owner = rollout_on_ranks(
                self.dist, prompts, lambda mine: self._rollout(mine, step, timer, first), group_size=g.group_size)
        with timer("score"):
            r = torch.tensor(total, dtype=torch.float32)
            if any(s.dropped for s in samples):  # rollout.failed_episode drop: out of the baseline too
                r = drop_rewards(r, [s.dropped for s in samples], g.group_size)
            if trained is None:
                adv = self._advantages(prompts, samples, r)  # one (n_j,) tensor per sample
            flat_zero = zero_variance_groups(r, g.group_size)
            keep = ~flat_zero if g.dynamic_sampling else torch.ones_like(flat_zero)
            # nothing to learn: the forward and backward run (metrics, mismatch), the optimizer step does not
            self.update.no_signal = bool(flat_zero.all()) and self._no_signal_no_step  # host: CPU tensor
            if self.update.no_signal:
                self._warn_no_signal(step, per)
        m: dict = {}
        m["reward/mean"], m["reward/std"] = r.mean(), r.std()
        for name, vals in per.items():
            m[f"reward/{name}"] = _mean(vals)
            if errors.get(name):
                m[f"reward_errors/{name}"] = float(errors[name])
        if self.rewards.correctness:
            m["accuracy"] = _mean(per[self.rewards.correctness])
        lens = [len(s.token_ids) for s in samples]
        if self.multi_turn:
            m.update(self.sampler.last_metrics if self.dist is None else episode_metrics_on_ranks(self.dist, self.sampler))
        m["completion_len/mean"], m["completion_len/max"] = sum(lens) / len(lens), float(max(lens))
        m["truncated_frac"] = sum(s.truncated for s in samples) / len(samples)
        adv_N = torch.cat(adv)
        m["adv/mean"], m["adv/std"], m["adv/abs_max"] = adv_N.mean(), adv_N.std(), adv_N.abs().max()
        m["groups/zero_variance_frac"] = flat_zero.float().mean()
        if any(p.media for p in prompts) and hasattr(self.sampler, "vision_encodes"):
            # vision-tower runs of the rollout: one per distinct image, not one per sample (data-parallel:
            # each rank's engine encodes its own prompts' images; the condition is global, so every rank sums)
            enc = float(self.sampler.vision_encodes)
            m["vision/encodes"] = enc if self.dist is None else global_sums(self.dist, [enc])[0]
        kept_groups = [i for i in range(len(prompts)) if bool(keep[i])]  # host: CPU tensors from the reward lists
        m["groups/kept"] = float(len(kept_groups))
        with timer("train"):
            m.update(trained if trained is not None else self.update.train(prompts, samples, adv, kept_groups, step))
        m["optim/skipped_steps"] = self.guard.pop_skipped()
        t = timer.times
        n_gen = sum(lens)
        m["time/generate"], m["time/score"], m["time/train"] = t["generate"], t["score"], t["train"]
        m["time/step"] = sum(t.values())
        # the step's wall (the train phase ends on a device sync): also what no phase holds, e.g. a
        # data-parallel rank's wait for the slowest rank's rollout in the gather (max over ranks when logged)
        m["time/step_wall"] = time.perf_counter() - t_start
        m["tokens_per_s/rollout"] = n_gen / max(t["generate"], 1e-9)
        m["tokens_per_s/train"] = m.pop("_train_tokens") / max(t["train"], 1e-9)
        m["memory/peak_mb"] = peak_memory_mb(self.device)
        self.last_samples = [{"prompt": prompts[s.prompt_index].text, "completion": s.text, "reward": total[j],
                              **({"episode": self._transcript(s)} if self.multi_turn else {}),
                              **{f"reward/{k}": v[j] for k, v in per.items()},
                              "advantage": float(adv[j][0]) if len(adv[j]) else 0.0,  # the first token's
                              "truncated": s.truncated} for j, s in enumerate(samples)]
        return m

    def _warn_no_signal(self, step: int, per: dict) -> None:
        """Say (the first 3 times) that a step had no reward signal, and the likely fix."""
        self._no_signal_warned += 1
        if self._no_signal_warned > 3:
            return
        acc = _mean(per[self.rewards.correctness]) if self.rewards.correctness else None
        why = (f"sampled accuracy {float(acc):.3f}: if the model's greedy accuracy is well above that, "
               f"grpo.temperature={self.g.temperature:g} samples too far from what it learnt; try 0.6"
               if acc is not None and float(acc) < 0.05 else "every completion scored the same")
        log.warning("step %d: every group's rewards are equal, no signal to learn from; the optimizer step is "
                    "skipped (%s; docs/agents.md, \"When GRPO does not help\")", step + 1, why)

    def _rollout(self, prompts: list[Prompt], step: int, timer: PhaseTimer, first_episode: int = 0):
        """Generate G completions of each prompt and score them: (samples, total rewards,
        per-function rewards, this call's reward error counts). `first_episode`: the global
        index of the first multi-turn episode (data-parallel ranks)."""
        g = self.g
        with timer("generate"):
            self.sampler.wake()
            if self.multi_turn:
                samples = self.sampler.episodes(prompts, n=g.group_size, temperature=g.temperature, top_p=g.top_p,
                                                top_k=g.top_k, seed=g.seed + step, first_episode=first_episode)
            else:
                samples = self.sampler.generate([p.ids for p in prompts], n=g.group_size, temperature=g.temperature,
                                                top_p=g.top_p, top_k=g.top_k, max_tokens=g.max_new_tokens,
                                                seed=g.seed + step, **media_kwargs(prompts))
            self.sampler.sleep()
        with timer("score"):
            total, per = score_samples(prompts, samples, self.rewards, g.group_size)
        return samples, total, per, dict(self.rewards.error_counts)

    def _transcript(self, s: Sample) -> str:
        return self.sampler.renderer.tok.decode(s.token_ids, skip_special_tokens=False)

    def _advantages(self, prompts: list[Prompt], samples: list[Sample], r: torch.Tensor) -> list[torch.Tensor]:
        """Per-token advantages of every sample (CPU fp32) by `grpo.advantage`; REINFORCE++
        with kl_coef > 0 first takes the reference log-probs of the whole batch (no grad)
        for the k1 KL it folds into the returns (old = the rollout's log-probs)."""
        g = self.g
        kl_N = None
        if g.advantage in KL_IN_REWARD and self.ref_model is not None:
            ref = self.update.trainer_logprobs(prompts, samples, list(range(len(samples))), model=self.ref_model)
            # a split agent episode's reference log-probs cover its earlier pieces first: its own are the last
            kl_N = torch.cat([(samples[j].logprobs - ref[j][len(ref[j]) - len(samples[j].token_ids):].float().cpu())
                              * GRPOUpdate.loss_mask(samples[j]) for j in range(len(samples))])
        return token_advantages(g.advantage, r, [len(s.token_ids) for s in samples], g.group_size,
                                adv_scale=g.adv_scale, eps=g.adv_eps, kl_N=kl_N, kl_coef=g.kl_coef)


# ---------------------------------------------------------------------- the run
def run_grpo(cfg: RunConfig, *, session: Session | None = None, stop_after: int | None = None,
             dist: DistContext | None = None) -> dict:
    """GRPO for cfg.grpo.steps (resuming per cfg.checkpoint.resume), evaluated on the
    held-out prompts before the first step, every grpo.eval_every and at the end.
    `stop_after` as in `run_loop` (tests of resume); `dist`: data-parallel (the CLI under
    torchrun), ignored when `session` is given (its own `dist` counts)."""
    ses = session or open_session(cfg, dist=dist)
    if cfg.grpo.max_new_tokens >= ses.context_len:
        log.warning("grpo.max_new_tokens=%d is not below the model context (%d tokens: engine.max_model_len or the "
                    "model's max_position_embeddings): every completion stops at the context, prompt included, "
                    "before max_new_tokens", cfg.grpo.max_new_tokens, ses.context_len)
    elif cfg.grpo.max_new_tokens > (room := ses.context_len - cfg.data.max_prompt_len):
        log.warning("grpo.max_new_tokens=%d exceeds the room a prompt of data.max_prompt_len=%d tokens leaves in the "
                    "%d-token context (%d)", cfg.grpo.max_new_tokens, cfg.data.max_prompt_len, ses.context_len, room)
    rewards = ses.rewards()
    prompts = build_prompts(ses.train_rows, ses.tokenizer, cfg.data, "train", context_len=ses.context_len,
                            stats=ses.data_stats, vision=ses.vision)
    stream = PromptStream(prompts, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    # data-parallel KL reference: a full frozen copy in the run's dtype on every rank (2 P bytes)
    # (a replicated LoRA model's reference is its base: the adapters switched off, no copy)
    ref = full_copy(ses.model, parse_dtype(cfg.model.dtype)) if is_sharded(ses.model) and cfg.grpo.kl_coef > 0 else None
    lg = cfg.logging
    if lg.profile_step > cfg.grpo.steps:
        log.warning("logging.profile_step=%d is past the run's last step (grpo.steps=%d): nothing is profiled",
                    lg.profile_step, cfg.grpo.steps)
    profiler = step_profiler(lg.profile_step, lg.profile_phase, ses.run_dir, rank=0 if ses.dist is None else ses.dist.rank,
                             device=ses.model.lm_head_weight.device)
    trainer = GRPOStep(cfg, ses.model, ses.sampler, rewards, stream, make_optimizer(ses.model, cfg, ses.dist),
                          ref_model=ref, dist=ses.dist, profiler=profiler)
    eval_prompts = ses.eval_prompts()
    # the trainer's RewardSet: its error counts (logged per step) include the evaluations'
    evaluation = Evaluation(prompts=eval_prompts, rewards=rewards,
                            max_new_tokens=cfg.grpo.max_new_tokens) if eval_prompts else None
    return run_loop(trainer, ses, evaluation=evaluation, stop_after=stop_after)
