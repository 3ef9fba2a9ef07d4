"""PPO with a critic on the engine's own weights (the classic RLHF loop).

One step (P prompts x K samples, B = P*K sequences; formulas in rlfuse/train/ppo_math.py
and docs/algorithms.md, "PPO"):
  1. generate : rollouts from the engine exactly as GRPO gets them (shared parameters,
                per-token log-probs = the old policy); then the engine sleeps.
  2. score    : reward functions -> scalar reward r_i; with ppo.reward_norm, normalized
                by running mean / std (RunningMoments, this batch included).
  3. prepare  : no-grad forwards: the critic's values V_t at every completion token and,
                with kl_coef > 0, the frozen reference's log-probs. Token rewards
                    rew_t = -beta (old_t - ref_t)  (+ r_i at the last token)
                GAE(gamma, lam) -> advantages A_t and returns R_t = A_t + V_t; A whitened
                over the batch (ppo.whiten_advantages). beta then adapts (ppo.kl_target).
  4. train    : mu epochs x mini_batches; each mini-batch, micro-batched by token budget:
                the policy's clipped loss through the fused kernel (rlfuse.kernels.loss.policy,
                per-token advantages; minus entropy_coef x token-mean entropy) and the
                critic's clipped value loss (token mean), each model stepped by its own
                MasterAdamW (policy: optim.lr; critic: ppo.critic_lr; same schedule shape).
Multi-turn episodes (rollout.tools / rollout.env, rlfuse.rollout.agent.multi_turn): a sample's
tokens are model turns and observations, its loss mask m 1 on the model's tokens only.
The observations are context: they enter the forwards, never the policy loss, the KL,
the entropy, the values, GAE or the value loss (all masked by m, normalizers counting
model tokens). GAE runs over the model's tokens only, observation tokens transparent
(rlfuse.train.ppo_math.gae): gamma discounts per model token, and a turn's last token
bootstraps from the value of the next turn's first token. Rewards: the episode's reward
(reward functions on the final answer + the environment's) on the episode's last model
token; when the environment gives per-turn rewards instead of reward(), each turn's
Step.reward sits on that turn's last model token and the rest of the episode's reward
(the reward functions', and with ppo.reward_norm the normalization's shift) on the
last model token. The token rewards of a sequence always sum to its (normalized) reward.
The critic (rlfuse.train.ppo_critic) starts as a copy of the policy's trunk with a zero
head, or from ppo.critic_path; it holds no activations outside its own forward/backward.
Its weights and optimizer state travel in the checkpoint's trainer state, with the KL
coefficient and the reward statistics.
Data-parallel (`dist`; docs/distributed.md): policy and critic FSDP2-sharded; each rank
rolls out its block of the prompts and runs the critic / reference forwards of its own
samples, then all-gathers (samples, then values and KL): reward statistics, GAE, global
whitening and the adaptive KL run on the whole batch as in one process; each rank trains
its samples of every mini-batch, padded to the same micro-batch count (zero weight).
`PPOStep` supplies the step and its state; `rlfuse.train.loop` runs it.
Run: rlfuse ppo RECIPE.yaml   Test: python -m pytest -q tests/test_ppo_trainer.py
"""

from __future__ import annotations

import logging
import math
from functools import partial

import torch
from torch.nn.utils.rnn import pad_sequence

from rlfuse.consistency.mismatch import logprob_mismatch
from rlfuse.data import Prompt, PromptStream, build_prompts
from rlfuse.engine.config import logprob_temperature
from rlfuse.kernels.loss.policy import accumulation_weight, policy_loss
from rlfuse.model.layers.moe import RouterLoss
from rlfuse.model.scalar_head import ScalarHeadModel
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
)
from rlfuse.run.config import RunConfig
from rlfuse.run.distributed import (
    DistContext,
    episode_metrics_on_ranks,
    full_copy,
    gather_results,
    is_sharded,
    local_micro_batches,
    mean_across_ranks,
    reduce_metrics,
    reduce_mismatch,
    rollout_on_ranks,
)
from rlfuse.train.grpo_update import GRPOUpdate
from rlfuse.train.loop import Evaluation, Schedule, make_optimizer, reference_model, run_loop
from rlfuse.train.ppo_critic import build_critic, critic_state, load_critic_state, make_critic_optimizer
from rlfuse.train.ppo_math import (
    RunningMoments,
    adaptive_kl_coef,
    explained_variance,
    gae,
    masked_mean,
    value_loss,
    whiten,
)
from rlfuse.train.session import Session, kernel_settings, open_session

log = logging.getLogger(__name__)

# one definition, GRPO's: a multi-turn sample's own prompt ids (else its Prompt's), and its
# loss mask over token_ids (1 on the model's tokens; all ones for a single-turn completion)
_prompt_ids = GRPOUpdate.prompt_ids
_loss_mask = GRPOUpdate.loss_mask


def _mean(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


class PPOStep:
    """The PPO step (a `rlfuse.train.loop.Trainer`): rollouts of `stream`'s prompts from
    `sampler`, scored by `rewards`, trained into `model` (by `optimizer`) and `critic` (by
    `critic_optimizer`)."""

    stage = "ppo"

    def __init__(self, cfg: RunConfig, model, sampler: Sampler, rewards: RewardSet, stream: PromptStream,
                 optimizer: MasterAdamW, critic: ScalarHeadModel, critic_optimizer: MasterAdamW, ref_model=None,
                 dist: DistContext | None = None):
        self.cfg, self.p, self.dist = cfg, cfg.ppo, dist
        self.owner = None  # data-parallel: global sample index -> the rank holding it (rollout_on_ranks)
        self.model, self.sampler, self.rewards, self.stream = model, sampler, rewards, stream
        self.optimizer, self.critic, self.critic_optimizer = optimizer, critic, critic_optimizer
        # a non-finite policy or value step is skipped (weights and moments untouched), each on its own
        self.guard = NonFiniteGuard(cfg.optim.max_nonfinite_steps, dist=dist)
        self.critic_guard = NonFiniteGuard(cfg.optim.max_nonfinite_steps, dist=dist)
        self.router = RouterLoss.for_run(model, cfg)  # MoE: the router losses and moe/* metrics (None: dense)
        self.device = model.lm_head_weight.device
        self.schedule = Schedule(steps=self.p.steps, eval_every=self.p.eval_every, eval_at_start=True,
                                 sample_every=self.p.sample_every, headline="reward/mean")
        if self.p.kl_coef > 0 and ref_model is None:
            ref_model = reference_model(model)  # the weights the run starts from (LoRA: the base)
        self.ref_model = ref_model.requires_grad_(False).eval() if self.p.kl_coef > 0 else None
        kernel_settings(cfg, model, self.ref_model, critic)
        self.kl_coef = self.p.kl_coef
        self.reward_stats = RunningMoments()
        self.opt_steps_total = self.p.steps * self.p.mu * self.p.mini_batches
        self.logprob_t = logprob_temperature(self.p.temperature)
        self.numerics = cfg.engine.numerics
        self.multi_turn = cfg.rollout.multi_turn
        if self.multi_turn and not hasattr(sampler, "episodes"):
            raise ValueError("rollout.tools / rollout.env need a multi-turn sampler (the session builds one); "
                             f"got {type(sampler).__name__}")
        # the policy loss's fixed-length normalizer (loss_type dr_grpo): an episode's budget
        self.max_loss_tokens = cfg.rollout.max_total_tokens if self.multi_turn else self.p.max_new_tokens
        self.last_samples: list[dict] = []

    def state_dict(self) -> dict:
        return {"data": self.stream.state_dict(), "kl_coef": self.kl_coef,
                "reward_stats": self.reward_stats.state_dict(), **critic_state(self.critic, self.critic_optimizer),
                "nonfinite": self.guard.state_dict(),
                "critic_nonfinite": self.critic_guard.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["data"])
        self.kl_coef = float(state["kl_coef"])
        self.reward_stats.load_state_dict(state["reward_stats"])
        load_critic_state(self.critic, self.critic_optimizer, state)
        if "nonfinite" in state:  # checkpoints written before the guards have none
            self.guard.load_state_dict(state["nonfinite"])
            self.critic_guard.load_state_dict(state["critic_nonfinite"])

    def samples(self) -> list[dict]:
        return self.last_samples

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict:
        p = self.p
        timer = PhaseTimer(self.device)
        prompts: list[Prompt] = self.stream.take(p.prompts_per_step)
        if self.dist is None:
            samples, total, per, errors = self._rollout(prompts, step, timer)
        else:  # rank r's episodes are numbered (seeded) from its first prompt's global place
            first = self.dist.rank * (p.prompts_per_step // self.dist.world_size) * p.samples_per_prompt
            samples, total, per, errors, self.owner = rollout_on_ranks(
                self.dist, prompts, lambda mine: self._rollout(mine, step, timer, first), group_size=p.samples_per_prompt,
                what="ppo.prompts_per_step")
        with timer("score"):
            r = torch.tensor(total, dtype=torch.float32)
            if p.reward_norm:
                self.reward_stats.update(r)
                r_used = self.reward_stats.normalize(r)
            else:
                r_used = r
        m: dict = {"reward/mean": r.mean(), "reward/std": r.std() if len(total) > 1 else r.new_zeros(())}
        for name, vals in per.items():
            m[f"reward/{name}"] = _mean(vals)
            if errors.get(name):
                m[f"reward_errors/{name}"] = float(errors[name])
        if self.rewards.correctness:
            m["accuracy"] = _mean(per[self.rewards.correctness])
        m["reward/normalized_mean"] = r_used.mean()
        lens = [len(s.token_ids) for s in samples]
        if self.multi_turn:  # turns, tool calls, tool errors and timeouts, observation tokens, truncation
            m.update(self.sampler.last_metrics if self.dist is None else episode_metrics_on_ranks(self.dist, self.sampler))
        m["completion_len/mean"], m["completion_len/max"] = sum(lens) / len(lens), float(max(lens))
        m["truncated_frac"] = sum(s.truncated for s in samples) / len(samples)
        with timer("prepare"):
            adv, ret, old_v, prep = self._prepare(prompts, samples, r_used)
        m.update(prep)
        with timer("train"):
            m.update(self._train(prompts, samples, adv, ret, old_v, step))
        m["optim/skipped_steps"] = self.guard.pop_skipped()  # this rollout step's, over mu x mini-batches
        m["critic/skipped_steps"] = self.critic_guard.pop_skipped()
        pop = getattr(self.critic_optimizer, "pop_update_ratio", None)  # not measured by FSDP2's ShardedAdamW
        if pop is not None and (ratio := pop()) is not None:  # the policy's: the run loop
            m["critic/update_ratio"] = ratio
        t = timer.times
        for k in ("generate", "score", "prepare", "train"):
            m[f"time/{k}"] = t[k]
        m["time/step"] = sum(t.values())
        m["tokens_per_s/rollout"] = sum(lens) / max(t["generate"], 1e-9)
        m["tokens_per_s/train"] = m.pop("_train_tokens") / max(t["train"], 1e-9)
        m["memory/peak_mb"] = peak_memory_mb(self.device)
        self.last_samples = [{"prompt": prompts[s.prompt_index].text, "completion": s.text, "reward": total[j],
                              **({"episode": self.sampler.renderer.tok.decode(s.token_ids, skip_special_tokens=False)}
                                 if self.multi_turn else {}),
                              **{f"reward/{k}": v[j] for k, v in per.items()},
                              "value_first_token": float(old_v[j][0]) if len(old_v[j]) else float("nan"),
                              "truncated": s.truncated} for j, s in enumerate(samples)]
        return m

    def _rollout(self, prompts: list[Prompt], step: int, timer: PhaseTimer, first_episode: int = 0):
        """Generate and score `prompts`' samples: (samples, total rewards, per-function
        rewards, reward error counts). `first_episode`: the global index of the first
        multi-turn episode (data-parallel ranks)."""
        p = self.p
        with timer("generate"):
            self.sampler.wake()
            if self.multi_turn:
                samples = self.sampler.episodes(prompts, n=p.samples_per_prompt, temperature=p.temperature,
                                                top_p=p.top_p, top_k=p.top_k, seed=p.seed + step,
                                                first_episode=first_episode)
            else:
                samples = self.sampler.generate([q.ids for q in prompts], n=p.samples_per_prompt,
                                                temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                                max_tokens=p.max_new_tokens, seed=p.seed + step)
            self.sampler.sleep()
        with timer("score"):
            total, per = score_samples(prompts, samples, self.rewards, p.samples_per_prompt)
        return samples, total, per, dict(self.rewards.error_counts)

    def _batches(self, prompts, samples, seq_idx: list[int]):
        """(sample indices, PackedBatch, pad) micro-batches of sequences `seq_idx`: all of
        them in one process; data-parallel, this rank's, then zero-weight padding ones up to
        the most any rank has (every FSDP forward is a collective)."""
        lengths = [len(_prompt_ids(prompts, samples[j])) + len(samples[j].token_ids) for j in seq_idx]
        if self.dist is None:
            mbs = [(mb, False) for mb in pack_by_tokens(lengths, self.p.micro_batch_tokens)]
        else:
            owned = [i for i, j in enumerate(seq_idx) if self.owner(j) == self.dist.rank]
            mbs = local_micro_batches(self.dist, lengths, self.p.micro_batch_tokens, owned)
        for mb, pad in mbs:
            js = [seq_idx[i] for i in mb]
            yield js, PackedBatch.build([(_prompt_ids(prompts, samples[j]) + samples[j].token_ids,
                                          len(_prompt_ids(prompts, samples[j]))) for j in js], self.device), pad

    # ------------------------------------------------------------------ values, KL, GAE
    @torch.no_grad()
    def _prepare(self, prompts, samples: list[Sample], r_used: torch.Tensor):
        p = self.p
        n = len(samples)
        values: list[torch.Tensor] = [None] * n
        kl: list[torch.Tensor] = [None] * n
        self.critic.eval()
        for js, batch, pad in self._batches(prompts, samples, list(range(n))):
            sizes = [len(samples[j].token_ids) for j in js]
            h_TD = self.critic(batch.input_ids, batch.positions, batch.attn)
            if pad:  # a collective every rank runs as often; nothing to keep
                continue
            v_N = self.critic.token_values(h_TD[batch.rows])
            if self.ref_model is not None:
                h = self.ref_model(batch.input_ids, batch.positions, batch.attn)
                ref_N = self.ref_model.token_logprobs(h[batch.rows], batch.targets, self.logprob_t)
            old_N = torch.cat([samples[j].logprobs for j in js]).to(self.device)
            m_N = torch.cat([_loss_mask(samples[j]) for j in js]).to(self.device)
            kl_N = (old_N - ref_N) * m_N if self.ref_model is not None else torch.zeros_like(old_N)  # k1 estimator
            for j, v, k, mk in zip(js, v_N.split(sizes), kl_N.split(sizes), m_N.split(sizes)):
                values[j], kl[j] = v * mk, k  # 0 at observation tokens: context, not states
        if is_sharded(self.critic):
            self.critic.reshard()  # FSDP2's root stays gathered after a forward without backward
        if self.dist is not None:
            # every rank gets every sample's values and KL: GAE, whitening and statistics run
            # on the whole batch as in one process (host tensors, one all-gather)
            mine = {j: (values[j].cpu(), kl[j].cpu()) for j in range(n) if values[j] is not None}
            for part in gather_results(self.dist, "values", lambda: mine):
                for j, (v, k) in part.items():
                    values[j], kl[j] = v.to(self.device), k.to(self.device)
        mask_BT = pad_sequence([_loss_mask(s) for s in samples], batch_first=True).to(self.device)
        values_BT = pad_sequence(values, batch_first=True)
        kl_BT = pad_sequence(kl, batch_first=True)
        rew_BT = -self.kl_coef * kl_BT
        rew_BT += self._reward_tokens(samples, r_used, rew_BT.shape[1])
        adv_BT, ret_BT = gae(rew_BT, values_BT, mask_BT, p.gamma, p.lam)
        out = {"kl_coef": self.kl_coef, "kl": masked_mean(kl_BT, mask_BT), "kl/seq": kl_BT.sum(1).mean(),
               "returns/mean": masked_mean(ret_BT, mask_BT), "values/mean": masked_mean(values_BT, mask_BT),
               "critic/explained_variance": explained_variance(values_BT, ret_BT, mask_BT),
               "adv/mean": masked_mean(adv_BT, mask_BT), "adv/std": masked_mean(adv_BT ** 2, mask_BT).sqrt()}
        if p.whiten_advantages:
            adv_BT = whiten(adv_BT, mask_BT)
        if p.kl_target is not None:
            # host sync: the coefficient is a host number (once per step)
            self.kl_coef = adaptive_kl_coef(self.kl_coef, float(out["kl/seq"]), p.kl_target, p.kl_horizon, n)
        lens_l = [len(s.token_ids) for s in samples]
        adv = [adv_BT[j, :lens_l[j]] for j in range(n)]
        ret = [ret_BT[j, :lens_l[j]] for j in range(n)]
        return adv, ret, values, out

    def _reward_tokens(self, samples: list[Sample], r_used: torch.Tensor, T: int) -> torch.Tensor:
        """(B, T) the sequence rewards placed on tokens (module docstring): per-turn rewards
        on their turns' last tokens (scaled like r_used with ppo.reward_norm), the rest of
        r_used on the last model token; a sequence without a model token gets nothing."""
        scale = self.reward_stats.slope() if self.p.reward_norm else 1.0
        rew = torch.zeros(len(samples), T)
        for j, s in enumerate(samples):  # host: CPU masks and Python reward lists
            on = _loss_mask(s).nonzero()
            if not len(on):
                continue
            rest = r_used[j].clone()
            for pos, r in s.turn_rewards or ():
                rew[j, pos] += r * scale
                rest -= r * scale
            rew[j, int(on[-1])] += rest
        return rew.to(self.device)

    # ------------------------------------------------------------------ the update
    def _train(self, prompts, samples, adv, ret, old_v, step: int) -> dict:
        p = self.p
        n = len(samples)
        bounds = [round(k * n / p.mini_batches) for k in range(p.mini_batches + 1)]
        minis = [list(range(bounds[k], bounds[k + 1])) for k in range(p.mini_batches)]
        acc: dict[str, list] = {}
        n_trained = 0
        capture: tuple[list, list, list] = ([], [], [])
        for it in range(p.mu):
            for k, mini in enumerate(minis):
                opt_step = step * p.mu * p.mini_batches + it * p.mini_batches + k
                stats = self._optimizer_step(prompts, samples, adv, ret, old_v, mini, opt_step,
                                             capture if it == 0 and k == 0 else None)
                n_trained += stats.pop("_tokens")
                for key, v in stats.items():
                    acc.setdefault(key, []).append(v)
        out = {key: torch.stack([torch.as_tensor(x, dtype=torch.float32, device=self.device) for x in v]).mean()
               for key, v in acc.items()}
        if self.dist is not None:  # partial sums over the global normalizers; lr and grad norms equal on all
            out = reduce_metrics(self.dist, out, ops={k: "max" for k in ("lr", "grad_norm", "critic/grad_norm")},
                                 default="sum")
        empty = [torch.zeros(0, device=self.device)]  # data-parallel: this rank may hold none of mini-batch 0
        mm = logprob_mismatch(*(torch.cat(c or empty) for c in capture))  # over the model's tokens
        if self.dist is not None:
            mm = reduce_mismatch(self.dist, mm)
        out.update({f"mismatch/{key}": v for key, v in mm.items()})
        if self.router is not None:
            out.update(self.router.metrics(None if self.dist is None else partial(mean_across_ranks, self.dist)))
        out["_train_tokens"] = float(n_trained)
        return out

    def _optimizer_step(self, prompts, samples, adv, ret, old_v, seq_idx, opt_step: int, capture) -> dict:
        p, o = self.p, self.cfg.optim
        self.model.train()
        self.critic.train()
        total_seqs = len(seq_idx)
        total_tokens = float(sum(_loss_mask(samples[j]).sum() for j in seq_idx))  # the model's tokens
        sums: dict[str, torch.Tensor] = {}
        n_tok = 0
        want_ent = p.entropy_coef > 0 or capture is not None
        for js, batch, pad in self._batches(prompts, samples, seq_idx):
            live = 0.0 if pad else 1.0  # a padding micro-batch: a real forward/backward with weight 0
            old_N = torch.cat([samples[j].logprobs for j in js]).to(self.device, non_blocking=True)
            adv_N = torch.cat([adv[j] for j in js])
            mask_N = torch.cat([_loss_mask(samples[j]) for j in js]).to(self.device)
            mb_tokens = float(sum(_loss_mask(samples[j]).sum() for j in js))  # host: CPU masks
            tw = live * mb_tokens / max(total_tokens, 1.0)  # this micro-batch's share of the mini-batch's tokens
            h_TD = self.model(batch.input_ids, batch.positions, batch.attn)
            out = self.model.token_logprobs(h_TD[batch.rows], batch.targets, self.logprob_t, return_entropy=want_ent)
            logp_N, ent_N = out if want_ent else (out, None)
            loss, st = policy_loss(logp_N, old_N, adv_N, mask_N, batch.seq_ids, batch.num_seqs,
                                   loss_type=p.loss_type, clip_low=p.clip_low, clip_high=p.clip_high,
                                   max_tokens=self.max_loss_tokens)
            st.pop("kl")  # no KL in the loss: it is in the reward (logged as "kl")
            w = live * accumulation_weight(p.loss_type, len(js), mb_tokens, total_seqs, total_tokens)
            # MoE: plus the router losses' share of this micro-batch (tw: its share of the mini-batch's tokens)
            obj = loss * w + (self.router.term(tw, pad=pad) if self.router is not None else 0.0)
            if ent_N is not None:
                ent_mean = live * (ent_N * mask_N).sum() / max(total_tokens, 1.0)  # its part of the token mean
                if p.entropy_coef > 0:
                    obj = obj - p.entropy_coef * ent_mean
                sums["entropy"] = sums.get("entropy", 0.0) + ent_mean.detach()
            obj.backward()
            sums["loss"] = sums.get("loss", 0.0) + loss.detach() * w
            for key, v in st.items():
                sums[key] = sums.get(key, 0.0) + v.detach() * tw
            if capture is not None and not pad:
                capture[0].append(logp_N.detach())
                capture[1].append(old_N)
                capture[2].append(mask_N)
            # the critic on the same packed batch
            v_N = self.critic.token_values(self.critic(batch.input_ids, batch.positions, batch.attn)[batch.rows])
            vl_N, vclip = value_loss(v_N, torch.cat([old_v[j] for j in js]), torch.cat([ret[j] for j in js]),
                                     mask_N, p.value_clip)
            vloss = live * vl_N.sum() / max(total_tokens, 1.0)
            vloss.backward()
            sums["critic/value_loss"] = sums.get("critic/value_loss", 0.0) + vloss.detach()
            sums["critic/value_clip_frac"] = sums.get("critic/value_clip_frac", 0.0) + vclip * tw
            n_tok += 0 if pad else batch.num_tokens
        kw = dict(total_steps=self.opt_steps_total, warmup_steps=o.warmup_steps, schedule=o.schedule,
                  min_lr_ratio=o.min_lr_ratio)
        grad_norm = clip_grad_norm_(self.optimizer.grads(), o.max_grad_norm)
        lr = lr_at(opt_step, lr=o.lr, **kw)
        self.guard.step(self.optimizer, lr, loss=sums["loss"], grad_norm=grad_norm,
                        where=f"ppo update {opt_step + 1}")
        self.optimizer.zero_grad()
        critic_norm = clip_grad_norm_(self.critic_optimizer.grads(), o.max_grad_norm)
        self.critic_guard.step(self.critic_optimizer, lr_at(opt_step, lr=p.critic_lr, **kw),
                               loss=sums["critic/value_loss"], grad_norm=critic_norm,
                               where=f"ppo critic update {opt_step + 1}")
        self.critic_optimizer.zero_grad()
        return {**sums, "grad_norm": grad_norm, "lr": lr, "critic/grad_norm": critic_norm, "_tokens": n_tok}


# ---------------------------------------------------------------------- the run
def run_ppo(cfg: RunConfig, *, session: Session | None = None, stop_after: int | None = None,
            dist: DistContext | None = None) -> dict:
    """PPO for cfg.ppo.steps (resuming per cfg.checkpoint.resume), evaluated on the held-out
    prompts before the first step, every ppo.eval_every and at the end. `dist`:
    data-parallel (the CLI under torchrun), ignored when `session` is given."""
    ses = session or open_session(cfg, dist=dist)
    rewards = ses.rewards()
    prompts = build_prompts(ses.train_rows, ses.tokenizer, cfg.data, "train", context_len=ses.context_len,
                            stats=ses.data_stats, vision=ses.vision)
    with_images = next((p for p in prompts if p.media), None)
    if with_images is not None:
        raise ValueError(f"{with_images.where}: a row with images; PPO takes text rows only so far (SFT and GRPO "
                         f"train on images: docs/vision.md)")
    stream = PromptStream(prompts, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    critic = build_critic(cfg, ses.model, ses.dist)
    # a sharded policy's KL reference: a full frozen copy in the run dtype on every rank (2P, as GRPO's)
    ref = full_copy(ses.model, parse_dtype(cfg.model.dtype)) if is_sharded(ses.model) and cfg.ppo.kl_coef > 0 else None
    trainer = PPOStep(cfg, ses.model, ses.sampler, rewards, stream, make_optimizer(ses.model, cfg, ses.dist),
                      critic, make_critic_optimizer(critic, cfg), ref_model=ref, dist=ses.dist)
    eval_prompts = ses.eval_prompts()
    evaluation = Evaluation(prompts=eval_prompts, rewards=rewards,
                            max_new_tokens=cfg.ppo.max_new_tokens) if eval_prompts else None
    return run_loop(trainer, ses, evaluation=evaluation, stop_after=stop_after)
