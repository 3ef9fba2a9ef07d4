"""GRPO (and DAPO / Dr. GRPO / GSPO) on the engine's own weights.

One step:
  1. generate  : P prompts x G completions from the engine (it shares the parameters),
                 with per-token log-probs; then the engine sleeps (KV pool freed).
  2. score     : reward functions -> total reward r (P*G,), advantages by the estimator
                 `grpo.advantage` (rlfuse.train.advantages); optional dynamic sampling
                 drops zero-variance groups; optional masking of truncated completions.
  3. train     : mu passes over the batch, each split into `mini_batches` optimizer
                 steps; each optimizer step packs its sequences into micro-batches of at
                 most `micro_batch_tokens` tokens and accumulates gradients of the policy
                 loss (rlfuse.kernels.policy_loss: reference, Triton path, backend choice), each
                 micro-batch weighted by its share of the full batch's normalizer, so the
                 accumulated gradient equals that of the loss on the whole mini-batch.
                 Old log-probs = the engine's; the first forward (before any update)
                 recomputes them, and the difference is logged (rlfuse.consistency).
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

import torch

from rlfuse.consistency.mismatch import logprob_mismatch
from rlfuse.data import Prompt, PromptStream, build_prompts
from rlfuse.engine.config import logprob_temperature
from rlfuse.kernels.backend import triton_compiles, use_numerics
from rlfuse.kernels.logprob import token_logprobs
from rlfuse.kernels.policy_loss import accumulation_weight, policy_loss
from rlfuse.model.weights import parse_dtype
from rlfuse.rollout import RewardSet, Sample, Sampler, score_samples
from rlfuse.run import (
    MasterAdamW,
    NonFiniteGuard,
    PackedBatch,
    PhaseTimer,
    clip_grad_norm_,
    lr_at,
    pack_by_tokens,
    peak_memory_mb,
    shared_contexts,
)
from rlfuse.run.config import RunConfig
from rlfuse.run.distributed import (
    DistContext,
    full_copy,
    local_micro_batches,
    reduce_metrics,
    reduce_mismatch,
    rollout_on_ranks,
)
from rlfuse.train.advantages import KL_IN_REWARD, token_advantages, zero_variance_groups
from rlfuse.train.grpo_stream import StreamStep
from rlfuse.train.loop import Evaluation, Schedule, StreamAndGuardState, make_optimizer, reference_model, run_loop
from rlfuse.train.off_policy import off_policy_corrections, recompute_old_logprobs
from rlfuse.train.session import Session, open_session
from rlfuse.train.warm import KernelWarmup, compile_left, policy_head

log = logging.getLogger(__name__)


def _mean(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


class GRPOTrainer(StreamAndGuardState):
    """The GRPO step and its state (a `rlfuse.train.loop.Trainer`, which `run_loop` runs):
    rollouts of `stream`'s prompts from `sampler`, scored by `rewards`, trained into `model`."""

    stage = "grpo"

    def __init__(self, cfg: RunConfig, model, sampler: Sampler, rewards: RewardSet, stream: PromptStream,
                 optimizer: MasterAdamW, ref_model=None, dist: DistContext | None = None):
        self.cfg, self.g = cfg, cfg.grpo
        self.dist = dist
        self._owner = None  # data-parallel: global sample index -> the rank that generated it
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
        # REINFORCE++ folds the KL into its returns (`_advantages`); the others add it to the loss
        self.kl_in_loss = self.ref_model is not None and self.g.advantage not in KL_IN_REWARD
        self.opt_steps_total = self.g.steps * self.g.mu * self.g.mini_batches
        # the temperature of the rollout's log-probs, which the policy, old and reference
        # log-probs must share for the ratios and the KL to compare like with like
        self.logprob_t = logprob_temperature(self.g.temperature)
        # the old policy is always the engine's rollout log-probs (no recompute forward); in
        # exact numerics they equal this trainer's first-iteration log-probs bitwise
        self.numerics = cfg.engine.numerics
        g = self.g
        self.recompute_old = recompute_old_logprobs(g, self.numerics)
        # multi-turn episodes (rollout.tools / rollout.env): samples carry a loss mask over the
        # model's tokens and their own prompt ids; observation tokens are context only
        self.multi_turn = cfg.rollout.multi_turn
        if self.multi_turn and not hasattr(sampler, "episodes"):
            raise ValueError("rollout.tools / rollout.env need a multi-turn sampler (the session builds one); "
                             f"got {type(sampler).__name__}")
        self.max_loss_tokens = cfg.rollout.max_total_tokens if self.multi_turn else self.g.max_new_tokens
        # grpo.share_prefix: a group's prompt packed once per micro-batch (rlfuse.run.batching)
        self.share_min = self.g.share_prefix_min_tokens if self.g.share_prefix else 0
        self.streamer = StreamStep(self) if g.overlap == "stream" else None
        self.last_samples: list[dict] = []
        # grpo.warm_kernels: the update's kernels compile in worker processes during the first rollout
        self._warm = KernelWarmup(model, lambda h, batch: policy_head(self, h, batch), numerics=self.numerics,
                                  enabled=g.warm_kernels and dist is None and g.overlap == "sync")

    def samples(self) -> list[dict]:
        return self.last_samples

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict:
        g = self.g
        timer = PhaseTimer(self.device)
        prompts: list[Prompt] = self.stream.take(g.prompts_per_step)
        trained = None
        if self.streamer is not None:  # grpo.overlap stream: each group trained as it finishes
            samples, total, per, errors, adv, trained = self.streamer.run(prompts, step, timer)
        elif self.dist is None:
            samples, total, per, errors = self._rollout(prompts, step, timer)
        else:
            samples, total, per, errors, self._owner = rollout_on_ranks(
                self.dist, prompts, lambda mine: self._rollout(mine, step, timer), group_size=g.group_size)
        with timer("score"):
            r = torch.tensor(total, dtype=torch.float32)
            if trained is None:
                adv = self._advantages(prompts, samples, r)  # one (n_j,) tensor per sample
            flat_zero = zero_variance_groups(r, g.group_size)
            keep = ~flat_zero if g.dynamic_sampling else torch.ones_like(flat_zero)
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
            m.update(self.sampler.last_metrics)
        m["completion_len/mean"], m["completion_len/max"] = sum(lens) / len(lens), float(max(lens))
        m["truncated_frac"] = sum(s.truncated for s in samples) / len(samples)
        adv_N = torch.cat(adv)
        m["adv/mean"], m["adv/std"], m["adv/abs_max"] = adv_N.mean(), adv_N.std(), adv_N.abs().max()
        m["groups/zero_variance_frac"] = flat_zero.float().mean()
        kept_groups = [i for i in range(len(prompts)) if bool(keep[i])]  # host: CPU tensors from the reward lists
        m["groups/kept"] = float(len(kept_groups))
        with timer("train"):
            m.update(trained if trained is not None else self._train(prompts, samples, adv, kept_groups, step))
        m["optim/skipped_steps"] = self.guard.pop_skipped()
        t = timer.times
        n_gen = sum(lens)
        m["time/generate"], m["time/score"], m["time/train"] = t["generate"], t["score"], t["train"]
        m["time/step"] = sum(t.values())
        m["tokens_per_s/rollout"] = n_gen / max(t["generate"], 1e-9)
        m["tokens_per_s/train"] = m.pop("_train_tokens") / max(t["train"], 1e-9)
        m["memory/peak_mb"] = peak_memory_mb(self.device)
        self.last_samples = [{"prompt": prompts[s.prompt_index].text, "completion": s.text, "reward": total[j],
                              **({"episode": self._transcript(s)} if self.multi_turn else {}),
                              **{f"reward/{k}": v[j] for k, v in per.items()},
                              "advantage": float(adv[j][0]) if len(adv[j]) else 0.0,  # the first token's
                              "truncated": s.truncated} for j, s in enumerate(samples)]
        return m

    def _rollout(self, prompts: list[Prompt], step: int, timer: PhaseTimer):
        """Generate G completions of each prompt and score them: (samples, total rewards,
        per-function rewards, this call's reward error counts)."""
        g = self.g
        with timer("generate"):
            self.sampler.wake()
            if self.multi_turn:
                samples = self.sampler.episodes(prompts, n=g.group_size, temperature=g.temperature, top_p=g.top_p,
                                                top_k=g.top_k, seed=g.seed + step)
            else:
                samples = self.sampler.generate([p.ids for p in prompts], n=g.group_size, temperature=g.temperature,
                                                top_p=g.top_p, top_k=g.top_k, max_tokens=g.max_new_tokens,
                                                seed=g.seed + step)
            self.sampler.sleep()
        with timer("score"):
            total, per = score_samples(prompts, samples, self.rewards, g.group_size)
        return samples, total, per, dict(self.rewards.error_counts)

    @staticmethod
    def _prompt_ids(prompts: list[Prompt], s: Sample) -> list[int]:
        return s.prompt_ids if s.prompt_ids is not None else prompts[s.prompt_index].ids

    @staticmethod
    def _loss_mask(s: Sample) -> torch.Tensor:
        """(len(token_ids),) fp32: 1 on the model's tokens (all of a single-turn completion)."""
        return s.loss_mask if s.loss_mask is not None else torch.ones(len(s.token_ids))

    def _transcript(self, s: Sample) -> str:
        return self.sampler.renderer.tok.decode(s.token_ids, skip_special_tokens=False)

    def _sequences(self, prompts: list[Prompt], samples: list[Sample], seq_idx: list[int]) -> list[tuple]:
        """(ids, n_ctx) of each sequence, as `PackedBatch.build` takes them."""
        ctx = [self._prompt_ids(prompts, samples[j]) for j in seq_idx]
        return [(c + samples[j].token_ids, len(c)) for c, j in zip(ctx, seq_idx)]

    def _micro_batches(self, seq_idx: list[int], seqs: list[tuple]) -> list[tuple[list[int], bool]]:
        """(positions into seq_idx, pad) per micro-batch: all of seq_idx in one process;
        data-parallel, this rank's sequences, padded with zero-weight micro-batches.
        A shared prompt (grpo.share_prefix) counts once against the token budget."""
        lengths = [len(ids) for ids, _ in seqs]
        shared = shared_contexts(seqs, self.share_min)
        if self.dist is None:
            return [(mb, False) for mb in pack_by_tokens(lengths, self.g.micro_batch_tokens, shared)]
        owned = [i for i, j in enumerate(seq_idx) if self._owner(j) == self.dist.rank]
        return local_micro_batches(self.dist, lengths, self.g.micro_batch_tokens, owned, shared)

    def _advantages(self, prompts: list[Prompt], samples: list[Sample], r: torch.Tensor) -> list[torch.Tensor]:
        """Per-token advantages of every sample (CPU fp32) by `grpo.advantage`; REINFORCE++
        with kl_coef > 0 first takes the reference log-probs of the whole batch (no grad)
        for the k1 KL it folds into the returns (old = the rollout's log-probs)."""
        g = self.g
        kl_N = None
        if g.advantage in KL_IN_REWARD and self.ref_model is not None:
            ref = self._trainer_logprobs(prompts, samples, list(range(len(samples))), model=self.ref_model)
            kl_N = torch.cat([(samples[j].logprobs - ref[j].float().cpu()) * self._loss_mask(samples[j])
                              for j in range(len(samples))])
        return token_advantages(g.advantage, r, [len(s.token_ids) for s in samples], g.group_size,
                                adv_scale=g.adv_scale, eps=g.adv_eps, kl_N=kl_N, kl_coef=g.kl_coef)

    # ------------------------------------------------------------------ the update
    def _train(self, prompts: list[Prompt], samples: list[Sample], adv: list[torch.Tensor], kept_groups: list[int],
               step: int) -> dict:
        g = self.g
        G = g.group_size
        if not kept_groups:
            log.info("step %d: every group has zero reward variance; no update", step)
            return {"_train_tokens": 0.0, "skipped_update": 1.0}
        seqs = [j for i in kept_groups for j in range(i * G, (i + 1) * G)]
        warmup, self._warm = self._warm, None  # the first update: the warm-up's result, what it compiles
        warm = warmup.wait() if warmup is not None else {}
        compiled_before = triton_compiles() if warmup is not None and self.device.type == "cuda" else None
        check = self.numerics == "exact" and g.check_every > 0 and step % g.check_every == 0
        old: dict[int, torch.Tensor] | None = None
        extra: dict = {}
        if self.recompute_old or check:
            old = self._trainer_logprobs(prompts, samples, seqs)
            extra = self._full_mismatch(samples, seqs, old, check, step)
            if not self.recompute_old:
                old = None  # a check only: the old policy stays the rollout's
        # mini-batches: kept groups split evenly, in order
        nmb = min(g.mini_batches, len(kept_groups))
        bounds = [round(k * len(kept_groups) / nmb) for k in range(nmb + 1)]
        minis = [seqs[bounds[k] * G:bounds[k + 1] * G] for k in range(nmb)]
        acc: dict[str, list] = {}
        n_trained = 0
        first_logp, first_old, first_mask = [], [], []
        for it in range(g.mu):
            for k, mini in enumerate(minis):
                stats = self._optimizer_step(prompts, samples, adv, mini, step * g.mu * nmb + it * nmb + k, old,
                                             capture=(first_logp, first_old, first_mask) if it == 0 and k == 0 else None)
                n_trained += stats.pop("_tokens")
                for key, v in stats.items():
                    acc.setdefault(key, []).append(v)
        if compiled_before is not None:
            extra = {**extra, **warm, **compile_left(compiled_before)}
        return self._train_metrics(acc, (first_logp, first_old, first_mask), extra, n_trained)

    def _full_mismatch(self, samples, seqs: list[int], old: dict, check: bool, step: int) -> dict:
        """mismatch/full_* of the trainer's log-probs `old` against the rollout's (an error
        logged if exact numerics disagree on a checked step)."""
        mine = [j for j in seqs if j in old]  # data-parallel: this rank's sequences
        full = logprob_mismatch(torch.cat([old[j] for j in mine] or [torch.zeros(0, device=self.device)]),
                                torch.cat([samples[j].logprobs.to(self.device) for j in mine] or [torch.zeros(0)]),
                                torch.cat([self._loss_mask(samples[j]).to(self.device) for j in mine]
                                          or [torch.zeros(0, device=self.device)]))
        if self.dist is not None:
            full = reduce_mismatch(self.dist, full)
        if check and float(full["max_abs"]) != 0.0:  # host sync: once per checked step
            log.error("step %d: exact numerics, yet the trainer's log-probs differ from the rollout's "
                      "(max |d| %.3g): run `rlfuse check` on this model", step, float(full["max_abs"]))
        return {f"mismatch/full_{k}": v for k, v in full.items()}

    def _train_metrics(self, acc: dict[str, list], capture, extra: dict, n_trained: int) -> dict:
        """The step's training metrics: optimizer-step means of `acc`, the mismatch of the
        first optimizer step's captured (log-probs, old, mask), `extra`."""
        out = {key: torch.stack([torch.as_tensor(x, dtype=torch.float32, device=self.device) for x in v]).mean()
               for key, v in acc.items()}
        if self.dist is not None:  # partial sums over the global normalizers; lr and grad norm are the same on all
            out = reduce_metrics(self.dist, out, ops={"lr": "max", "grad_norm": "max"}, default="sum")
        empty = [torch.zeros(0, device=self.device)]  # data-parallel: this rank may hold none of mini-batch 0
        mm = logprob_mismatch(*(torch.cat(c or empty) for c in capture))
        if self.dist is not None:
            mm = reduce_mismatch(self.dist, mm)
        out.update({f"mismatch/{key}": v for key, v in mm.items()})
        out.update(extra)
        out["_train_tokens"] = float(n_trained)
        return out

    def _optimizer_step(self, prompts, samples, adv, seq_idx: list[int], opt_step: int, old=None,
                        capture=None) -> dict:
        sums, n_tok = self.accumulate_gradients(prompts, samples, adv, seq_idx, capture, old=old)
        return self.apply_update(sums, n_tok, opt_step)

    def apply_update(self, sums: dict, n_tok: int, opt_step: int) -> dict:
        """Clip the accumulated gradients and take optimizer step `opt_step` (skipped by the
        non-finite guard); the step's statistics."""
        o = self.cfg.optim
        grad_norm = clip_grad_norm_(self.optimizer.grads(), o.max_grad_norm)
        lr = lr_at(opt_step, lr=o.lr, total_steps=self.opt_steps_total, warmup_steps=o.warmup_steps,
                   schedule=o.schedule, min_lr_ratio=o.min_lr_ratio)
        self.guard.step(self.optimizer, lr, loss=sums["loss"], grad_norm=grad_norm,
                        where=f"grpo optimizer step {opt_step + 1}")
        self.optimizer.zero_grad()
        return {**sums, "grad_norm": grad_norm, "lr": lr, "_tokens": n_tok}

    def accumulate_gradients(self, prompts, samples, adv, seq_idx: list[int], capture=None, old=None, *,
                             micro_batches=None, totals: tuple[int, float] | None = None):
        """Backward of the policy loss over sequences `seq_idx` (indices into samples),
        micro-batched by token budget; grads accumulate in the params' .grad. `old` (sample
        index -> trainer log-probs) replaces the rollout's as the old policy and turns on the
        configured off-policy corrections. Returns (stats summed into full-batch averages,
        tokens processed). grpo.overlap stream passes one group's `micro_batches`
        ((positions into seq_idx, pad) pairs) and the normalizers `totals` (sequences,
        loss tokens) of the whole step, which `seq_idx` alone does not know."""
        g = self.g
        dev = self.device
        self.model.train()
        # per-sequence loss mask (truncated completions optionally masked) times the per-token
        # one (multi-turn: observation tokens are context)
        live = [0.0 if (g.mask_truncated and samples[j].truncated) else 1.0 for j in seq_idx]
        n_loss = [float(self._loss_mask(samples[j]).sum()) for j in seq_idx]  # host: CPU tensors
        total_seqs, total_tokens = totals or (len(seq_idx), sum(n * w for n, w in zip(n_loss, live)))
        seqs = self._sequences(prompts, samples, seq_idx)
        sums: dict[str, torch.Tensor] = {}
        n_tok = 0
        for mb, pad in micro_batches if micro_batches is not None else self._micro_batches(seq_idx, seqs):
            js = [seq_idx[i] for i in mb]
            batch = PackedBatch.build([seqs[i] for i in mb], dev, self.share_min)
            old_N = torch.cat([samples[j].logprobs for j in js]).to(dev, non_blocking=True)
            adv_N = torch.cat([adv[j].expand(len(samples[j].token_ids)) for j in js]).to(dev, non_blocking=True)
            mask_N = torch.cat([self._loss_mask(samples[j]) * live[i] for i, j in zip(mb, js)]).to(dev)
            corr: dict = {}
            if old is not None:
                rollout_N, old_N = old_N, torch.cat([old[j] for j in js])
                adv_N, mask_N, corr = off_policy_corrections(old_N - rollout_N, adv_N, mask_N, batch.seq_ids,
                                                             batch.num_seqs, tis_cap=g.tis_cap,
                                                             mis_bounds=g.mis_bounds, icepop_bounds=g.icepop_bounds)
            if pad:  # a zero-weight micro-batch (data-parallel padding): no gradient, no statistics
                mask_N = torch.zeros_like(mask_N)
            want_ent = g.log_entropy and capture is not None
            with use_numerics(self.numerics):  # the engine's numerics: exact makes logp_N == old_N bitwise
                h_TD = self.model(batch.input_ids, batch.positions, batch.attn)
                out = token_logprobs(h_TD[batch.rows], self.model.lm_head_weight, batch.targets, self.logprob_t,
                                     return_entropy=want_ent)
                ref_N = self._ref_logprobs(batch) if self.kl_in_loss else None
            logp_N, ent_N = out if want_ent else (out, None)
            loss, st = self._policy_loss(logp_N, old_N, adv_N, mask_N, batch, ref_N)
            mb_tokens = 0.0 if pad else sum(live[i] * n_loss[i] for i in mb)
            w = 0.0 if pad else accumulation_weight(g.loss_type, len(js), mb_tokens, total_seqs, total_tokens)
            (loss * w).backward()
            tw = mb_tokens / max(total_tokens, 1.0)  # token-weighted averages of the per-token stats
            sums["loss"] = sums.get("loss", 0.0) + loss.detach() * w
            for key, v in {**st, **corr}.items():
                sums[key] = sums.get(key, 0.0) + v.detach() * tw
            if ent_N is not None:
                sums["entropy"] = sums.get("entropy", 0.0) + (ent_N.detach() * mask_N).sum() / max(total_tokens, 1.0)
            if capture is not None and not pad:
                capture[0].append(logp_N.detach())
                capture[1].append(old_N)
                capture[2].append(mask_N)
            n_tok += 0 if pad else batch.num_tokens
        return sums, n_tok

    def _policy_loss(self, logp_N, old_N, adv_N, mask_N, batch: PackedBatch, ref_N):
        g = self.g
        return policy_loss(logp_N, old_N, adv_N, mask_N, batch.seq_ids, batch.num_seqs,
                           loss_type=g.loss_type, clip_low=g.clip_low, clip_high=g.clip_high,
                           dual_clip=g.dual_clip, ref_logp=ref_N,
                           kl_coef=g.kl_coef if self.kl_in_loss else 0.0, kl_type=g.kl_type,
                           kl_ratio=g.kl_ratio, cispo_clip_low=g.cispo_clip_low,
                           max_tokens=self.max_loss_tokens)

    @torch.no_grad()
    def _trainer_logprobs(self, prompts, samples, seq_idx: list[int], model=None) -> dict[int, torch.Tensor]:
        """The trainer's log-probs of sequences `seq_idx` under the current weights, or those of
        `model` (no grad, micro-batched like the update): the recomputed old policy, an
        exact-mode check, or REINFORCE++'s reference."""
        model = self.model if model is None else model
        out = {}
        seqs = self._sequences(prompts, samples, seq_idx)
        for mb, pad in self._micro_batches(seq_idx, seqs):
            js = [seq_idx[i] for i in mb]
            batch = PackedBatch.build([seqs[i] for i in mb], self.device, self.share_min)
            with use_numerics(self.numerics):
                h = model(batch.input_ids, batch.positions, batch.attn)
                lp = token_logprobs(h[batch.rows], model.lm_head_weight, batch.targets, self.logprob_t)
            if pad:  # data-parallel padding: the forward keeps the ranks' collectives in step
                continue
            for j, x in zip(js, lp.split([len(samples[j].token_ids) for j in js])):
                out[j] = x
        return out

    @torch.no_grad()
    def _ref_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        h = self.ref_model(batch.input_ids, batch.positions, batch.attn)
        return token_logprobs(h[batch.rows], self.ref_model.lm_head_weight, batch.targets, self.logprob_t)


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
    rewards = ses.rewards()
    prompts = build_prompts(ses.train_rows, ses.tokenizer, cfg.data, "train", context_len=ses.context_len,
                            stats=ses.data_stats)
    stream = PromptStream(prompts, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    # data-parallel KL reference: a full frozen copy in the run's dtype on every rank (2 P bytes)
    ref = full_copy(ses.model, parse_dtype(cfg.model.dtype)) if ses.dist is not None and cfg.grpo.kl_coef > 0 else None
    trainer = GRPOTrainer(cfg, ses.model, ses.sampler, rewards, stream, make_optimizer(ses.model, cfg),
                          ref_model=ref, dist=ses.dist)
    eval_prompts = ses.eval_prompts()
    # the trainer's RewardSet: its error counts (logged per step) include the evaluations'
    evaluation = Evaluation(prompts=eval_prompts, rewards=rewards,
                            max_new_tokens=cfg.grpo.max_new_tokens) if eval_prompts else None
    return run_loop(trainer, ses, evaluation=evaluation, stop_after=stop_after)
