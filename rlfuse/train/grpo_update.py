"""The GRPO update: from scored samples and their advantages to optimizer steps, public so
the sync step (`rlfuse.train.grpo`), stream mode (`rlfuse.train.grpo_stream`) and the kernel
warm-up (`rlfuse.train.warm`) call one definition.

`GRPOUpdate.train` does the step's update: mu passes over the kept groups, each split into
`mini_batches` optimizer steps (`optimizer_step` = `accumulate_gradients` + `apply_update`);
`accumulate_gradients` packs sequences into micro-batches of at most `micro_batch_tokens`
tokens and backpropagates the policy loss (`policy_loss`: rlfuse.kernels.loss.policy), each
micro-batch weighted by its share of the full batch's normalizer, so the accumulated
gradient equals that of the loss on the whole mini-batch. `trainer_logprobs` is the no-grad
forward (the recomputed old policy, an exact-mode check, REINFORCE++'s reference);
`full_mismatch` and `metrics` report the trainer-vs-rollout log-prob mismatch
(rlfuse.consistency). Every forward runs in the run's numerics (`engine.numerics`).

Off-policy corrections (`off_policy_corrections`, `recompute_old_logprobs`):
  Off-policy corrections for fast numerics: the rollout's log-probs come from the engine's
  forward, the old policy of the PPO ratio from the trainer's (a no-grad recompute), and the
  two differ (~1e-2 in bf16, docs/numerics.md). With d_t = log pi_old(y_t) - log pi_rollout(y_t):

    TIS     (truncated importance sampling, token level)  A_t <- A_t * min(exp(d_t), cap)
            The weight is a stop-gradient and >= 0, so weighting the advantage weights the
            whole clipped PPO term: min(r A w, clip(r) A w) = w min(r A, clip(r) A).
    MIS     (sequence masking)  a completion with exp(mean_t d_t) outside [low, high] gets mask 0
    IcePop  (token masking)     tokens with exp(d_t) outside [low, high] get mask 0

  Masked tokens are dropped from the loss like truncated completions are. In exact numerics
  d_t = 0 bitwise and the trainer never recomputes, so none of this runs.
  Metrics (token-weighted means over the step): offpolicy/ratio_mean, offpolicy/tis_weight,
  offpolicy/tis_capped_frac, offpolicy/mis_masked_frac, offpolicy/icepop_masked_frac.
Test: python -m pytest -q tests/test_grpo_trainer.py tests/test_grpo_algorithms.py
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from rlfuse.consistency.mismatch import logprob_mismatch
from rlfuse.data import Prompt
from rlfuse.engine.config import logprob_temperature
from rlfuse.kernels.backend import triton_compiles
from rlfuse.kernels.loss.policy import accumulation_weight
from rlfuse.kernels.loss.policy import policy_loss as kernel_policy_loss
from rlfuse.kernels.moe import routing_mismatch
from rlfuse.model.layers.moe import RouterLoss, moe_blocks
from rlfuse.rollout import Sample
from rlfuse.run import MasterAdamW, NonFiniteGuard, PackedBatch, clip_grad_norm_, lr_at, pack_by_tokens, shared_contexts
from rlfuse.run.config import RunConfig
from rlfuse.run.distributed import (
    DistContext,
    local_micro_batches,
    mean_across_ranks,
    reduce_metrics,
    reduce_mismatch,
    reduce_routing_mismatch,
    sync_on_last,
)
from rlfuse.train.advantages import KL_IN_REWARD
from rlfuse.train.warm import KernelWarmup, compile_left, policy_head

log = logging.getLogger(__name__)


class GRPOUpdate:
    """The update half of a GRPO step and its settings (the module docstring): `model`
    trained by `optimizer` under `guard`; `ref_model` (kl_coef > 0) gives the KL reference.
    `owner` (data-parallel): global sample index -> the rank that generated it, set by the
    step before each update."""

    def __init__(self, cfg: RunConfig, model, optimizer: MasterAdamW, guard: NonFiniteGuard, *, ref_model=None,
                 dist: DistContext | None = None):
        self.cfg, self.g = cfg, cfg.grpo
        g = self.g
        self.model, self.optimizer, self.guard, self.ref_model, self.dist = model, optimizer, guard, ref_model, dist
        self.owner = None
        self.no_signal = False
        """Set by the step: no group has reward variance, so the optimizer steps are skipped."""
        self.device = model.lm_head_weight.device
        # REINFORCE++ folds the KL into its returns (the step's advantages); the others add it to the loss
        self.kl_in_loss = ref_model is not None and g.advantage not in KL_IN_REWARD
        self.opt_steps_total = g.steps * g.mu * g.mini_batches
        # the temperature of the rollout's log-probs, which the policy, old and reference
        # log-probs must share for the ratios and the KL to compare like with like
        self.logprob_t = logprob_temperature(g.temperature)
        # the old policy is the engine's rollout log-probs unless `recompute_old` (fast numerics
        # with an off-policy correction or grpo.recompute_old): then the trainer's no-grad
        # forward before the first update; in exact numerics the two are equal bitwise
        self.numerics = cfg.engine.numerics
        self.recompute_old = recompute_old_logprobs(g, self.numerics)
        # multi-turn episodes: the loss mask spans the whole episode (observations are context)
        self.max_loss_tokens = cfg.rollout.max_total_tokens if cfg.rollout.multi_turn else g.max_new_tokens
        # grpo.share_prefix: a group's prompt packed once per micro-batch (rlfuse.run.batching);
        # an agent episode's split samples share their common prefix with one another always
        self.share_min = g.share_prefix_min_tokens
        self.share_any = g.share_prefix
        # grpo.warm_kernels: the update's kernels compile in worker processes during the first rollout
        # MoE models: the load-balancing / z-loss terms and the moe/* metrics (None when dense)
        self.router = RouterLoss.for_run(model, cfg)
        self.routing_acc = (0.0, 0)  # (mismatched token-layer pairs, pairs) of the step: moe/routing_mismatch
        self.warm = KernelWarmup(model, lambda h, batch: policy_head(self, h, batch), numerics=self.numerics,
                                 enabled=g.warm_kernels and dist is None and g.overlap == "sync")

    @staticmethod
    def prompt_ids(prompts: list[Prompt], s: Sample) -> list[int]:
        return s.prompt_ids if s.prompt_ids is not None else prompts[s.prompt_index].ids

    @staticmethod
    def loss_mask(s: Sample) -> torch.Tensor:
        """(len(token_ids),) fp32: 1 on the model's tokens (all of a single-turn completion)."""
        return s.loss_mask if s.loss_mask is not None else torch.ones(len(s.token_ids))

    @staticmethod
    def pieces(s: Sample) -> list[Sample]:
        """The training sequences of a sample: a split agent episode's earlier samples, then itself."""
        return [*s.split_parts, s] if s.split_parts else [s]

    def units(self, samples: list[Sample], seq_idx: list[int]) -> list[tuple[int, Sample]]:
        """(sample index, piece) of every training sequence of samples `seq_idx`, in order."""
        return [(j, piece) for j in seq_idx for piece in self.pieces(samples[j])]

    def sequences(self, prompts: list[Prompt], units: list[tuple[int, Sample]]) -> list[tuple]:
        """(ids, n_ctx) of each sequence, as `PackedBatch.build` takes them; (ids, n_ctx, media)
        for a prompt with images (multi-turn episodes and their pieces carry their own
        text-only prompt ids)."""
        out = []
        for _, s in units:
            c = self.prompt_ids(prompts, s)
            media = prompts[s.prompt_index].media if s.prompt_ids is None else ()
            out.append((c + s.token_ids, len(c), media) if media else (c + s.token_ids, len(c)))
        return out

    def link(self, units: list[tuple[int, Sample]]) -> list[int] | None:
        """`PackedBatch.build`'s link: None shares any run of prefixes (grpo.share_prefix);
        else only the pieces of one episode share theirs."""
        return None if self.share_any else [j for j, _ in units]

    def micro_batches(self, units: list[tuple[int, Sample]], seqs: list[tuple],
                      local: bool = False) -> list[tuple[list[int], bool]]:
        """(positions into units, pad) per micro-batch: all of them in one process (or
        `local`: the caller's own samples, no collective); data-parallel, this rank's
        sequences, padded with zero-weight micro-batches. A shared prefix counts once
        against the token budget."""
        lengths = [len(s[0]) for s in seqs]
        shared = shared_contexts(seqs, self.share_min, self.link(units))
        if self.dist is None or local:
            return [(mb, False) for mb in pack_by_tokens(lengths, self.g.micro_batch_tokens, shared)]
        owned = [i for i, (j, _) in enumerate(units) if self.owner(j) == self.dist.rank]
        return local_micro_batches(self.dist, lengths, self.g.micro_batch_tokens, owned, shared)

    def build(self, units, seqs, mb: list[int]) -> PackedBatch:
        link = self.link(units)
        return PackedBatch.build([seqs[i] for i in mb], self.device, self.share_min,
                                 None if link is None else [link[i] for i in mb], vision=self.model.config.vision)

    def cat_pieces(self, s: Sample, field: str) -> torch.Tensor:
        """A per-token field (logprobs, loss_mask) over all pieces of `s`, in `pieces` order."""
        get = self.loss_mask if field == "loss_mask" else (lambda p: p.logprobs)
        return torch.cat([get(p) for p in self.pieces(s)])

    def train(self, prompts: list[Prompt], samples: list[Sample], adv: list[torch.Tensor], kept_groups: list[int],
               step: int) -> dict:
        g = self.g
        G = g.group_size
        if not kept_groups:
            log.info("step %d: every group has zero reward variance; no update", step)
            return {"_train_tokens": 0.0, "skipped_update": 1.0}
        seqs = [j for i in kept_groups for j in range(i * G, (i + 1) * G)]
        warmup, self.warm = self.warm, None  # the first update: the warm-up's result, what it compiles
        warm = warmup.wait() if warmup is not None else {}
        compiled_before = triton_compiles() if warmup is not None and self.device.type == "cuda" else None
        check = self.numerics == "exact" and g.check_every > 0 and step % g.check_every == 0
        old: dict[int, torch.Tensor] | None = None
        extra: dict = {}
        if self.recompute_old or check:
            old = self.trainer_logprobs(prompts, samples, seqs)
            extra = self.full_mismatch(samples, seqs, old, check, step)
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
                stats = self.optimizer_step(prompts, samples, adv, mini, step * g.mu * nmb + it * nmb + k, old,
                                             capture=(first_logp, first_old, first_mask) if it == 0 and k == 0 else None)
                n_trained += stats.pop("_tokens")
                for key, v in stats.items():
                    acc.setdefault(key, []).append(v)
        if compiled_before is not None:
            extra = {**extra, **warm, **compile_left(compiled_before)}
        return self.metrics(acc, (first_logp, first_old, first_mask), extra, n_trained)

    def full_mismatch(self, samples, seqs: list[int], old: dict, check: bool, step: int) -> dict:
        """mismatch/full_* of the trainer's log-probs `old` against the rollout's (an error
        logged if exact numerics disagree on a checked step)."""
        mine = [j for j in seqs if j in old]  # data-parallel: this rank's sequences
        full = logprob_mismatch(torch.cat([old[j] for j in mine] or [torch.zeros(0, device=self.device)]),
                                torch.cat([self.cat_pieces(samples[j], "logprobs").to(self.device) for j in mine]
                                          or [torch.zeros(0)]),
                                torch.cat([self.cat_pieces(samples[j], "loss_mask").to(self.device) for j in mine]
                                          or [torch.zeros(0, device=self.device)]))
        if self.dist is not None:
            full = reduce_mismatch(self.dist, full)
        if check and float(full["max_abs"]) != 0.0:  # host sync: once per checked step
            log.error("step %d: exact numerics, yet the trainer's log-probs differ from the rollout's "
                      "(max |d| %.3g): run `rlfuse check` on this model", step, float(full["max_abs"]))
        return {f"mismatch/full_{k}": v for k, v in full.items()}

    def metrics(self, acc: dict[str, list], capture, extra: dict, n_trained: int) -> dict:
        """The step's training metrics: optimizer-step means of `acc`, the mismatch of the
        first optimizer step's captured (log-probs, old, mask), `extra`."""
        out = {key: torch.stack([torch.as_tensor(x, dtype=torch.float32, device=self.device) for x in v]).mean()
               for key, v in acc.items()}
        if self.dist is not None:  # partial sums over the global normalizers; lr, grad norm and the
            # no-signal skip (decided on the gathered rewards) are the same on all ranks
            same = ("lr", "grad_norm", "skipped_update")
            out = reduce_metrics(self.dist, out, ops={k: "max" for k in same}, default="sum")
        empty = [torch.zeros(0, device=self.device)]  # data-parallel: this rank may hold none of mini-batch 0
        mm = logprob_mismatch(*(torch.cat(c or empty) for c in capture))
        if self.dist is not None:
            mm = reduce_mismatch(self.dist, mm)
        out.update({f"mismatch/{key}": v for key, v in mm.items()})
        out.update(extra)
        if self.router is not None:
            out.update(self.router.metrics(None if self.dist is None else partial(mean_across_ranks, self.dist)))
            mismatched, pairs = self.routing_acc  # token-layer pairs compared on the first optimizer step
            frac = mismatched / pairs if pairs else 0.0
            if self.dist is not None:  # every rank joins, compared or not: the worst rank's fraction
                frac = reduce_routing_mismatch(self.dist, float(frac), pairs)  # host sync: a logged number
            elif not pairs:
                frac = None
            if frac is not None:
                out["moe/routing_mismatch"] = frac
            self.routing_acc = (0.0, 0)
        out["_train_tokens"] = float(n_trained)
        return out

    def optimizer_step(self, prompts, samples, adv, seq_idx: list[int], opt_step: int, old=None,
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
        if self.no_signal:  # zero gradient: Adam would only replay its momentum (rlfuse.train.grpo)
            self.optimizer.zero_grad()
            return {**sums, "grad_norm": grad_norm, "lr": lr, "_tokens": n_tok, "skipped_update": 1.0}
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
        # the training sequences: a split agent episode's pieces each count as a sequence; they
        # take the episode's advantage (its first token's, the same on every token for the
        # group-relative estimators)
        units = self.units(samples, seq_idx)
        # per-sequence loss mask (truncated completions optionally masked) times the per-token
        # one (multi-turn: observation tokens are context)
        live = [0.0 if (g.mask_truncated and samples[j].truncated) else 1.0 for j, _ in units]
        n_loss = [float(self.loss_mask(s).sum()) for _, s in units]  # host: CPU tensors
        total_seqs, total_tokens = totals or (len(units), sum(n * w for n, w in zip(n_loss, live)))
        seqs = self.sequences(prompts, units)
        if old is not None:  # per piece, as the units
            old_u = [x for j in seq_idx
                     for x in old[j].split([len(p.token_ids) for p in self.pieces(samples[j])])]
        sums: dict[str, torch.Tensor] = {}
        n_tok = 0
        # distributed.grad_sync last: FSDP2 reduce-scatters in the last micro-batch's backward only
        for mb, pad in sync_on_last(self.model, micro_batches if micro_batches is not None
                                    else self.micro_batches(units, seqs)):
            us = [units[i] for i in mb]
            js = [j for j, _ in us]
            batch = self.build(units, seqs, mb)
            old_N = torch.cat([s.logprobs for _, s in us]).to(dev, non_blocking=True)
            adv_N = torch.cat([adv[j].expand(len(s.token_ids)) if s is samples[j]
                               else adv[j].reshape(-1)[:1].expand(len(s.token_ids)) for j, s in us]
                              ).to(dev, non_blocking=True)
            mask_N = torch.cat([self.loss_mask(s) * live[i] for i, (_, s) in zip(mb, us)]).to(dev)
            corr: dict = {}
            if old is not None:
                rollout_N, old_N = old_N, torch.cat([old_u[i] for i in mb])
                adv_N, mask_N, corr = off_policy_corrections(old_N - rollout_N, adv_N, mask_N, batch.seq_ids,
                                                             batch.num_seqs, tis_cap=g.tis_cap,
                                                             mis_bounds=g.mis_bounds, icepop_bounds=g.icepop_bounds)
            if pad:  # a zero-weight micro-batch (data-parallel padding): no gradient, no statistics
                mask_N = torch.zeros_like(mask_N)
            want_ent = g.log_entropy and capture is not None
            # the model's kernel settings carry the engine's numerics: exact makes logp_N == old_N bitwise
            h_TD = batch.forward(self.model)
            out = self.model.token_logprobs(h_TD[batch.rows], batch.targets, self.logprob_t, return_entropy=want_ent)
            ref_N = self.ref_logprobs(batch) if self.kl_in_loss else None
            logp_N, ent_N = out if want_ent else (out, None)
            loss, st = self.policy_loss(logp_N, old_N, adv_N, mask_N, batch, ref_N)
            mb_tokens = 0.0 if pad else sum(live[i] * n_loss[i] for i in mb)
            w = 0.0 if pad else accumulation_weight(g.loss_type, len(js), mb_tokens, total_seqs, total_tokens)
            if self.router is not None:  # the micro-batch's share of the step's loss tokens
                loss_w = loss * w + self.router.term(0.0 if pad else mb_tokens / max(total_tokens, 1.0), pad=pad)
            else:
                loss_w = loss * w
            loss_w.backward()
            tw = mb_tokens / max(total_tokens, 1.0)  # token-weighted averages of the per-token stats
            sums["loss"] = sums.get("loss", 0.0) + loss.detach() * w
            for key, v in {**st, **corr}.items():
                sums[key] = sums.get(key, 0.0) + v.detach() * tw
            if ent_N is not None:
                sums["entropy"] = sums.get("entropy", 0.0) + (ent_N.detach() * mask_N).sum() / max(total_tokens, 1.0)
            if capture is not None and not pad and self.router is not None:
                self.compare_routing([s for _, s in us], batch)
            if capture is not None and not pad:
                capture[0].append(logp_N.detach())
                capture[1].append(old_N)
                capture[2].append(mask_N)
            n_tok += 0 if pad else batch.num_tokens
        return sums, n_tok

    def compare_routing(self, pieces: list[Sample], batch: PackedBatch) -> None:
        """Add the last forward's routing of the rows that predict the sampled tokens to the
        step's moe/routing_mismatch, against the rollout's (`Sample.routing`): on the first
        optimizer step's micro-batches, whose weights are the rollout's. Sequences without a
        record (not recorded, or multi-turn episodes, whose observation tokens were not
        sampled) are left out."""
        have = [len(s.routing) == len(s.token_ids) if s.routing is not None else False for s in pieces]
        if not any(have):
            return
        rows = batch.rows.split([len(s.token_ids) for s in pieces])
        keep = torch.cat([r for r, h in zip(rows, have) if h])
        ours = torch.stack([b.last_experts[keep] for b in moe_blocks(self.model)], 1)  # (N, L, k)
        theirs = torch.cat([s.routing for s, h in zip(pieces, have) if h]).to(ours.device, ours.dtype)
        n = ours.shape[0] * ours.shape[1]
        frac = routing_mismatch(ours.reshape(n, -1), theirs.reshape(n, -1))
        self.routing_acc = (self.routing_acc[0] + frac * n, self.routing_acc[1] + n)

    def policy_loss(self, logp_N, old_N, adv_N, mask_N, batch: PackedBatch, ref_N):
        g = self.g
        return kernel_policy_loss(logp_N, old_N, adv_N, mask_N, batch.seq_ids, batch.num_seqs,
                           loss_type=g.loss_type, clip_low=g.clip_low, clip_high=g.clip_high,
                           dual_clip=g.dual_clip, ref_logp=ref_N,
                           kl_coef=g.kl_coef if self.kl_in_loss else 0.0, kl_type=g.kl_type,
                           kl_ratio=g.kl_ratio, cispo_clip_low=g.cispo_clip_low,
                           max_tokens=self.max_loss_tokens)

    @torch.no_grad()
    def trainer_logprobs(self, prompts, samples, seq_idx: list[int], model=None,
                         local: bool = False) -> dict[int, torch.Tensor]:
        """The trainer's log-probs of sequences `seq_idx` under the current weights, or those of
        `model` (no grad, micro-batched like the update): the recomputed old policy, an
        exact-mode check, or REINFORCE++'s reference. `local`: all of `seq_idx` on this rank,
        no collective (stream mode on a replicated model)."""
        model = self.model if model is None else model
        parts: dict[int, list] = {}
        units = self.units(samples, seq_idx)
        seqs = self.sequences(prompts, units)
        for mb, pad in self.micro_batches(units, seqs, local):
            us = [units[i] for i in mb]
            batch = self.build(units, seqs, mb)
            h = batch.forward(model)  # images too
            lp = model.token_logprobs(h[batch.rows], batch.targets, self.logprob_t)
            if pad:  # data-parallel padding: the forward keeps the ranks' collectives in step
                continue
            for (j, _), x in zip(us, lp.split([len(s.token_ids) for _, s in us])):
                parts.setdefault(j, []).append(x)
        # a split episode: its pieces' log-probs joined in `pieces` order (micro-batches keep the order)
        return {j: xs[0] if len(xs) == 1 else torch.cat(xs) for j, xs in parts.items()}

    @torch.no_grad()
    def ref_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        h = batch.forward(self.ref_model)
        return self.ref_model.token_logprobs(h[batch.rows], batch.targets, self.logprob_t)


# ---------------------------------------------------------------------- off-policy corrections
def off_policy_corrections(log_ratio_N: torch.Tensor, adv_N: torch.Tensor, mask_N: torch.Tensor,
                           seq_ids_N: torch.Tensor, num_seqs: int, *, tis_cap: float | None = None,
                           mis_bounds: tuple[float, float] | None = None,
                           icepop_bounds: tuple[float, float] | None = None):
    """log_ratio_N (N,) = old - rollout log-probs per token -> (adv_N, mask_N, metrics);
    metrics are per-token means over the unmasked tokens of this micro-batch."""
    d = log_ratio_N.detach().float()
    ratio = torch.exp(d)
    live = mask_N > 0
    n = live.sum().clamp_min(1)
    stats = {"offpolicy/ratio_mean": (ratio * live).sum() / n}
    if tis_cap is not None:
        w = ratio.clamp(max=tis_cap)
        adv_N = adv_N * w
        stats["offpolicy/tis_weight"] = (w * live).sum() / n
        stats["offpolicy/tis_capped_frac"] = ((ratio > tis_cap) & live).sum() / n
    keep = torch.ones_like(d, dtype=torch.bool)
    if mis_bounds is not None:
        tok_per_seq = torch.zeros(num_seqs, device=d.device).index_add_(0, seq_ids_N, torch.ones_like(d))
        mean_d = torch.zeros(num_seqs, device=d.device).index_add_(0, seq_ids_N, d) / tok_per_seq.clamp_min(1)
        seq_ok = (torch.exp(mean_d) >= mis_bounds[0]) & (torch.exp(mean_d) <= mis_bounds[1])
        stats["offpolicy/mis_masked_frac"] = (~seq_ok[seq_ids_N] & live).sum() / n
        keep &= seq_ok[seq_ids_N]
    if icepop_bounds is not None:
        tok_ok = (ratio >= icepop_bounds[0]) & (ratio <= icepop_bounds[1])
        stats["offpolicy/icepop_masked_frac"] = (~tok_ok & live).sum() / n
        keep &= tok_ok
    return adv_N, mask_N * keep.to(mask_N.dtype), stats


def recompute_old_logprobs(g, numerics: str) -> bool:
    """Whether a GRPO step recomputes the old policy's log-probs with a trainer forward
    (`g`: the GRPOConfig): in fast numerics when asked (grpo.old_logprobs recompute) or
    when an off-policy correction needs the trainer's view; never in exact numerics, where
    the rollout's log-probs ARE the trainer's, bitwise. Logs the choice."""
    corrections = g.tis_cap is not None or g.mis_bounds is not None or g.icepop_bounds is not None
    if numerics == "exact" and (g.old_logprobs == "recompute" or corrections):
        log.info("numerics exact: old log-probs = the rollout's (bitwise the trainer's); no recompute "
                 "forward, and the off-policy corrections are identities")
    log.info("numerics %s (engine.numerics): %s", numerics,
             "rollout log-probs equal the trainer's bitwise; mismatch/* must read 0" if numerics == "exact"
             else "rollout log-probs drift from the trainer's (~1e-2 in bf16); mismatch/* logs it every step")
    return numerics == "fast" and (g.old_logprobs == "recompute" or corrections)
