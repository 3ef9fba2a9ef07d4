"""Direct preference optimization on (prompt, chosen, rejected) pairs.

For a pair, with sequence log-probs (sums over the response tokens, temperature 1)
pi_c, pi_r under the policy and ref_c, ref_r under the reference:
    h = (pi_c - ref_c) - (pi_r - ref_r)
    sigmoid       l = -log sigmoid(beta h)                                     DPO
    conservative  l = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h) cDPO, eps = label_smoothing
    ipo           l = (h - 1 / (2 beta))^2                                     IPO
Loss of a step = mean over its `dpo.batch_size` pairs. Metrics (means over the step's
pairs): rewards/chosen = beta (pi_c - ref_c), rewards/rejected = beta (pi_r - ref_r),
rewards/margin = beta h, rewards/accuracy = fraction with h > 0, logps/chosen and
logps/rejected = pi_c, pi_r.

One step packs whole pairs (both sequences in one micro-batch) into micro-batches of at
most `dpo.micro_batch_tokens` tokens (`pack_by_tokens`), runs the model once per
micro-batch to hidden states, `token_logprobs` (the fused log-prob kernel: no (N, V)
logits) on the response tokens, sums them per sequence, and backpropagates
sum(l) / batch_size, so the accumulated gradient is that of the whole step.
Held-out pairs (eval rows with chosen / rejected): `run_dpo` reports the policy's own
pair_accuracy (pi_c > pi_r), logp_margin (mean pi_c - pi_r) and mean log-probs at the
start and the end (res["pair_evals"]).
Reference log-probs: `dpo.reference: precompute` computes them for every training pair
once, before the first step (no grad, same packing), and caches them (P, 2); then no
reference weights are kept. `live` keeps a frozen reference model and evaluates it on
each micro-batch. The reference is the policy at the start of the run (a resumed run
starts from the recipe's weights too, so the cache is the same) or `dpo.ref_path`; with
model.lora, the base model (the policy with its adapters off: no copy).
`DPOStep` supplies the step and its state; `rlfuse.train.loop` runs it.
Data-parallel (`dist`, FSDP2-sharded policy): every rank draws the same global batch of
pairs and trains its contiguous block of it (`dpo.batch_size` a multiple of N), padded to
the same number of micro-batches (zero-weight pairs); the loss is already divided by the
global batch size, so gradients and metric partial sums are summed over ranks. The cached
reference is computed on every rank for every pair (each forward is a collective);
`live` uses a full frozen copy on every rank (`full_copy`).
Run: rlfuse dpo RECIPE.yaml   Test: python -m pytest -q tests/test_dpo.py
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch
import torch.nn.functional as F

from rlfuse.data import PreferencePair, PromptStream, build_preference_pairs
from rlfuse.kernels.loss.logprob import token_logprobs
from rlfuse.model import load_model
from rlfuse.model.layers.moe import RouterLoss
from rlfuse.model.lora import BaseModelView, has_lora
from rlfuse.model.weights import parse_dtype
from rlfuse.run import MasterAdamW, NonFiniteGuard, PackedBatch, clip_grad_norm_, lr_at, pack_by_tokens, peak_memory_mb
from rlfuse.run.config import DPO_LOSSES, RunConfig
from rlfuse.run.distributed import (
    DistContext,
    full_copy,
    is_sharded,
    local_micro_batches,
    local_slice,
    mean_across_ranks,
    reduce_metrics,
)
from rlfuse.train.loop import Evaluation, Schedule, StreamAndGuardState, make_optimizer, reference_model, run_loop
from rlfuse.train.session import Session, open_session

log = logging.getLogger(__name__)


def dpo_loss(pi_c, pi_r, ref_c, ref_r, *, loss: str = "sigmoid", beta: float = 0.1,
             label_smoothing: float = 0.0):
    """Per-pair losses (B,) and h (B,) from sequence log-probs (B,) each; module docstring."""
    if loss not in DPO_LOSSES:
        raise ValueError(f"dpo loss must be one of {DPO_LOSSES}, got {loss!r}")
    h = (pi_c - ref_c) - (pi_r - ref_r)
    if loss == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2, h
    eps = label_smoothing if loss == "conservative" else 0.0
    return -(1.0 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h), h


def pair_logprobs(model, pairs: list[PreferencePair], micro_batch_tokens: int, device, micro_batches=None):
    """Per packed micro-batch, yield (indices into pairs, chosen (b,) and rejected (b,)
    sequence log-probs, tokens in the micro-batch); differentiable when grad is enabled.
    `micro_batches`: the index lists to run (data-parallel: this rank's, padded); default:
    all pairs packed by `micro_batch_tokens`."""
    if micro_batches is None:
        micro_batches = pack_by_tokens([p.num_tokens for p in pairs], micro_batch_tokens)
    for mb in micro_batches:
        batch = PackedBatch.build([s for i in mb for s in pairs[i].sequences()], device, vision=model.config.vision)
        h_TD = batch.forward(model)  # image pairs: each distinct image encoded once (a pair shares its prompt's)
        logp_N = token_logprobs(h_TD[batch.rows], model.lm_head_weight, batch.targets)
        seq_2b = logp_N.new_zeros(batch.num_seqs).index_add(0, batch.seq_ids, logp_N)  # chosen, rejected, ...
        yield mb, seq_2b[0::2], seq_2b[1::2], batch.num_tokens


@torch.no_grad()
def sequence_logprobs(model, pairs: list[PreferencePair], micro_batch_tokens: int, device) -> torch.Tensor:
    """(P, 2) fp32 sequence log-probs (chosen, rejected) of every pair under `model`, no grad:
    the cached reference, and the held-out pair metrics."""
    was_training = model.training
    model.eval()
    out = torch.empty(len(pairs), 2, device=device)
    for mb, c, r, _ in pair_logprobs(model, pairs, micro_batch_tokens, device):
        idx = torch.tensor(mb, device=device)
        out[idx, 0], out[idx, 1] = c, r
    model.train(was_training)
    if is_sharded(model):
        # FSDP2's root keeps its gathered weights after a forward until a backward reshards
        # it; with no backward here, the parameters would stay the gathered tensors, which
        # a later reshard frees under anyone holding them (the loop's weight-norm watch)
        model.reshard()
    return out


def pair_metrics(lp_P2: torch.Tensor) -> dict:
    """Held-out preference metrics of the policy alone from (P, 2) sequence log-probs:
    pair_accuracy = fraction with pi_c > pi_r, logp_margin = mean (pi_c - pi_r), and the
    mean chosen and rejected log-probs."""
    d = lp_P2[:, 0] - lp_P2[:, 1]
    return {"pair_accuracy": float((d > 0).float().mean()), "logp_margin": float(d.mean()),
            "logps/chosen": float(lp_P2[:, 0].mean()), "logps/rejected": float(lp_P2[:, 1].mean())}


class DPOStep(StreamAndGuardState):
    """The DPO step over batches of `pairs` (a `rlfuse.train.loop.Trainer`)."""

    stage = "dpo"

    def __init__(self, cfg: RunConfig, model, optimizer: MasterAdamW, pairs: list[PreferencePair], ref_model=None,
                 dist: DistContext | None = None):
        self.cfg, self.d = cfg, cfg.dpo
        self.model, self.optimizer, self.pairs = model, optimizer, pairs
        self.dist = dist
        self.guard = NonFiniteGuard(cfg.optim.max_nonfinite_steps, dist=dist)
        # MoE models: the load-balancing / z-loss terms and the moe/* metrics (None when dense)
        self.router = RouterLoss.for_run(model, cfg)
        self.device = model.lm_head_weight.device
        self.stream = PromptStream(list(range(len(pairs))), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        self.schedule = Schedule(steps=self.d.steps, eval_every=self.d.eval_every, eval_at_start=True,
                                 headline="rewards/margin")
        # precompute reads the reference once, at the start: the model itself, or with LoRA
        # its base (adapters off), which a loaded adapter (model.lora.path) differs from
        ref = ref_model if ref_model is not None else (BaseModelView(model) if has_lora(model) else model)
        self.ref_model, self.ref_cache = None, None
        if self.d.reference == "precompute":
            t0 = time.perf_counter()
            self.ref_cache = sequence_logprobs(ref, pairs, self.d.micro_batch_tokens, self.device)  # (P, 2)
            log.info("dpo: reference log-probs of %d pairs computed once and cached (%.1f s; dpo.reference=precompute)",
                     len(pairs), time.perf_counter() - t0)
        else:
            # the weights the run starts from (built before a resume loads the checkpoint)
            self.ref_model = (ref if ref_model is not None else reference_model(model)).requires_grad_(False).eval()

    def samples(self) -> list[dict]:
        return []

    def step(self, step: int) -> dict:
        m = self.train_step(self.stream.take(self.d.batch_size), step)
        m["memory/peak_mb"] = peak_memory_mb(self.device)
        return m

    def train_step(self, idx: list[int], step: int) -> dict:
        """One optimizer step on pairs `idx` (learning rate of step `step`)."""
        d, o = self.d, self.cfg.optim
        self.model.train()
        t0 = time.perf_counter()
        pairs = [self.pairs[i] for i in idx]
        B = len(pairs)
        sums = {k: torch.zeros((), device=self.device) for k in
                ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy",
                 "logps/chosen", "logps/rejected")}
        n_tok = 0
        lengths = [p.num_tokens for p in pairs]
        if self.dist is None:
            mbs = [(mb, False) for mb in pack_by_tokens(lengths, d.micro_batch_tokens)]
        else:
            owned = local_slice(range(B), self.dist, what="dpo.batch_size")
            mbs = local_micro_batches(self.dist, lengths, d.micro_batch_tokens, owned)
        pads = [pad for _, pad in mbs]
        batches = pair_logprobs(self.model, pairs, d.micro_batch_tokens, self.device, [mb for mb, _ in mbs])
        for pad, (mb, pi_c, pi_r, tokens) in zip(pads, batches):
            # read before the reference forward below; the micro-batch's share of the batch's pairs
            # (a data-parallel padding micro-batch: none, but its term is still consumed)
            router = self.router.term(0.0 if pad else len(mb) / B, pad=pad) if self.router is not None else 0.0
            if self.ref_cache is not None:
                ref = self.ref_cache[torch.tensor([idx[i] for i in mb], device=self.device)]
                ref_c, ref_r = ref[:, 0], ref[:, 1]
            else:
                with torch.no_grad():
                    # the micro-batch's pairs fit one micro-batch: one reference forward
                    _, ref_c, ref_r, _ = next(pair_logprobs(self.ref_model, [pairs[i] for i in mb],
                                                            d.micro_batch_tokens, self.device))
            losses, h = dpo_loss(pi_c, pi_r, ref_c, ref_r, loss=d.loss, beta=d.beta,
                                 label_smoothing=d.label_smoothing)
            if pad:  # a zero-weight micro-batch (data-parallel padding): keeps the ranks' collectives in step
                ((losses.sum() + router) * 0.0).backward()
                continue
            (losses.sum() / B + router).backward()
            with torch.no_grad():
                rc, rr = d.beta * (pi_c.detach() - ref_c), d.beta * (pi_r.detach() - ref_r)
                for k, v in (("loss", losses.detach()), ("rewards/chosen", rc), ("rewards/rejected", rr),
                             ("rewards/margin", rc - rr), ("rewards/accuracy", (h.detach() > 0).float()),
                             ("logps/chosen", pi_c.detach()), ("logps/rejected", pi_r.detach())):
                    sums[k] += v.sum() / B
            n_tok += tokens
        grad_norm = clip_grad_norm_(self.optimizer.grads(), o.max_grad_norm)
        lr = lr_at(step, lr=o.lr, total_steps=d.steps, warmup_steps=o.warmup_steps, schedule=o.schedule,
                   min_lr_ratio=o.min_lr_ratio)
        self.guard.step(self.optimizer, lr, loss=sums["loss"], grad_norm=grad_norm, where=f"dpo step {step + 1}")
        self.optimizer.zero_grad()
        dt = time.perf_counter() - t0
        m = {**sums, "grad_norm": grad_norm, "lr": lr, "optim/skipped_steps": self.guard.pop_skipped(),
             "tokens": float(n_tok), "tokens_per_s": n_tok / max(dt, 1e-9), "time/step": dt}
        if self.dist is not None:  # the sums are this rank's shares of the global means
            m = reduce_metrics(self.dist, m, ops={**{k: "sum" for k in sums}, "tokens": "sum", "tokens_per_s": "sum"},
                               default="max")
        if self.router is not None:  # over ranks: the loads summed, the losses averaged (RouterLoss.metrics)
            m.update(self.router.metrics(None if self.dist is None else partial(mean_across_ranks, self.dist)))
        return m


def run_dpo(cfg: RunConfig, *, session: Session | None = None, stop_after: int | None = None,
            dist: DistContext | None = None) -> dict:
    """DPO for cfg.dpo.steps (resuming per cfg.checkpoint.resume); held-out greedy
    evaluation before the first step and at the end when the recipe names rewards.
    `stop_after` as in `run_loop` (tests of resume); `dist`: data-parallel (ignored when
    `session` is given: its own `dist` counts)."""
    ses = session or open_session(cfg, dist=dist)
    pairs = build_preference_pairs(ses.train_rows, ses.tokenizer, cfg.data, cfg.dpo, stats=ses.data_stats,
                                   vision=ses.vision)
    ref_model = None
    if cfg.dpo.ref_path:
        # the reference is the policy's kind: a Qwen3.5 VLM folder's text tower alone with model.text_only
        ref_model = load_model(cfg.dpo.ref_path, device=ses.device, dtype=parse_dtype(cfg.model.dtype),
                               text_only=cfg.model.text_only)
        if ref_model.config.vocab_size != ses.model.config.vocab_size:
            raise ValueError(f"dpo.ref_path: the reference's vocabulary ({ref_model.config.vocab_size}) differs "
                             f"from the policy's ({ses.model.config.vocab_size})")
    if is_sharded(ses.model) and ref_model is None and cfg.dpo.reference == "live":
        ref_model = full_copy(ses.model, parse_dtype(cfg.model.dtype))  # the starting weights, 2P a rank
    trainer = DPOStep(cfg, ses.model, make_optimizer(ses.model, cfg, ses.dist), pairs, ref_model=ref_model, dist=ses.dist)
    d = cfg.dpo
    # held-out pairs, when the eval rows are preference rows: the policy's own pair metrics
    # at the start and the end (the reference-relative h is 0 at the start by definition)
    held_out = []
    if ses.eval_rows and all(d.chosen_field in r and d.rejected_field in r for _, r in ses.eval_rows):
        held_out = build_preference_pairs(ses.eval_rows, ses.tokenizer, cfg.data, d, stats=ses.data_stats,
                                          split="eval_pairs", vision=ses.vision)
        before = pair_metrics(sequence_logprobs(ses.model, held_out, d.micro_batch_tokens, ses.device))
    evaluation = None
    if cfg.rewards:
        prompts = ses.eval_prompts()
        # completions as long as the GRPO stage's, as SFT's evaluation
        evaluation = Evaluation(prompts=prompts, rewards=ses.rewards(),
                                max_new_tokens=cfg.grpo.max_new_tokens) if prompts else None
    res = run_loop(trainer, ses, evaluation=evaluation, stop_after=stop_after)
    if held_out:
        after = pair_metrics(sequence_logprobs(ses.model, held_out, d.micro_batch_tokens, ses.device))
        res["pair_evals"] = {"before": before, "after": after, "num_pairs": len(held_out)}
        log.info("dpo held-out pairs (%d): %s", len(held_out),
                 {k: f"{before[k]:.4f} -> {after[k]:.4f}" for k in before})
    return res
