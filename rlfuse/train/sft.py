"""Supervised fine-tuning on completion / assistant tokens only.

One optimizer step takes `sft.batch_size` examples, packs them into micro-batches of at
most `sft.micro_batch_tokens` tokens, and accumulates gradients of
    loss = -(1 / N) sum_{target tokens t} log p(y_t | y_<t),   N = target tokens of the step,
so the result does not depend on how the step was split into micro-batches. Log-probs
come from `rlfuse.kernels.loss.logprob.token_logprobs` on the rows that predict targets only
(no (T, V) logits). Then grad-norm clipping, the scheduled LR and MasterAdamW.
`SFTStep` supplies the step and its state; `rlfuse.train.loop` runs it.
Data-parallel (`dist`): every rank draws the same global batch, so N is known locally;
each rank trains its contiguous block of it, padded to the same number of micro-batches,
and the loss is summed over ranks.
Run: rlfuse sft RECIPE.yaml   Test: python -m pytest -q tests/test_train_sft.py
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch

from rlfuse.data import PromptStream, SFTExample, build_sft_examples
from rlfuse.kernels.loss.logprob import token_logprobs
from rlfuse.model.layers.moe import RouterLoss
from rlfuse.rollout import episode_renderer
from rlfuse.run import MasterAdamW, NonFiniteGuard, PackedBatch, clip_grad_norm_, lr_at, pack_by_tokens, peak_memory_mb
from rlfuse.run.config import RunConfig
from rlfuse.run.distributed import DistContext, local_micro_batches, local_slice, mean_across_ranks, reduce_metrics
from rlfuse.train.loop import Evaluation, Schedule, StreamAndGuardState, make_optimizer, run_loop
from rlfuse.train.session import Session, open_session


class SFTStep(StreamAndGuardState):
    """The SFT step over batches of `stream` (a `rlfuse.train.loop.Trainer`)."""

    stage = "sft"

    def __init__(self, cfg: RunConfig, model, optimizer: MasterAdamW, stream: PromptStream,
                 dist: DistContext | None = None):
        self.cfg, self.model, self.optimizer, self.stream = cfg, model, optimizer, stream
        self.dist = dist
        self.device = model.lm_head_weight.device
        # eval_at_start: the held-out baseline the run's result ("from step 0") is read against
        self.schedule = Schedule(steps=cfg.sft.steps, eval_every=cfg.sft.eval_every, eval_at_start=True,
                                 headline="loss")
        self.guard = NonFiniteGuard(cfg.optim.max_nonfinite_steps, dist=dist)
        # MoE models: the load-balancing / z-loss terms and the moe/* metrics (None when dense)
        self.router = RouterLoss.for_run(model, cfg)

    def step(self, step: int) -> dict:
        m = self.train_step(self.stream.take(self.cfg.sft.batch_size), step)
        m["memory/peak_mb"] = peak_memory_mb(self.device)
        return m

    def train_step(self, examples: list[SFTExample], step: int) -> dict:
        """One optimizer step on `examples` (learning rate of step `step`)."""
        s, o = self.cfg.sft, self.cfg.optim
        self.model.train()
        n_ctx = [ex.mask.index(True) for ex in examples]
        total_targets = sum(sum(ex.mask[c:]) for ex, c in zip(examples, n_ctx))
        loss_sum = torch.zeros((), device=self.device)
        t0 = time.perf_counter()
        n_tok = 0
        for mb, pad in self._micro_batches([len(ex.ids) for ex in examples]):
            batch = PackedBatch.build([(examples[i].ids, n_ctx[i], examples[i].media) for i in mb], self.device,
                                      vision=self.model.config.vision)
            w_N = torch.tensor([float(m) for i in mb for m in examples[i].mask[n_ctx[i]:]],
                               device=self.device)
            if pad:  # a zero-weight micro-batch (data-parallel padding)
                w_N = torch.zeros_like(w_N)
            h_TD = batch.forward(self.model)
            logp_N = token_logprobs(h_TD[batch.rows], self.model.lm_head_weight, batch.targets)
            loss = -(logp_N * w_N).sum() / total_targets
            if self.router is not None:  # this micro-batch's share of the step's target tokens (host lists)
                share = 0.0 if pad else sum(sum(examples[i].mask[n_ctx[i]:]) for i in mb) / max(total_targets, 1)
                loss = loss + self.router.term(share, pad=pad)
            loss.backward()
            loss_sum += loss.detach()
            n_tok += 0 if pad else batch.num_tokens
        grad_norm = clip_grad_norm_(self.optimizer.grads(), o.max_grad_norm)
        lr = lr_at(step, lr=o.lr, total_steps=s.steps, warmup_steps=o.warmup_steps, schedule=o.schedule,
                   min_lr_ratio=o.min_lr_ratio)
        self.guard.step(self.optimizer, lr, loss=loss_sum, grad_norm=grad_norm, where=f"sft step {step + 1}")
        self.optimizer.zero_grad()
        dt = time.perf_counter() - t0
        m = {"loss": loss_sum, "grad_norm": grad_norm, "lr": lr, "optim/skipped_steps": self.guard.pop_skipped(),
             "tokens": float(n_tok), "target_tokens": float(total_targets), "tokens_per_s": n_tok / max(dt, 1e-9),
             "time/step": dt}
        if self.dist is not None:  # each rank's loss is its share of the global mean
            m = reduce_metrics(self.dist, m, ops={"loss": "sum", "tokens": "sum", "tokens_per_s": "sum"},
                               default="max")
        if self.router is not None:  # over ranks: the loads summed, the losses averaged (RouterLoss.metrics)
            m.update(self.router.metrics(None if self.dist is None else partial(mean_across_ranks, self.dist)))
        return m

    def _micro_batches(self, lengths: list[int]) -> list[tuple[list[int], bool]]:
        """(example indices, pad) per micro-batch: all examples in one process;
        data-parallel, this rank's block, padded with zero-weight micro-batches."""
        if self.dist is None:
            return [(mb, False) for mb in pack_by_tokens(lengths, self.cfg.sft.micro_batch_tokens)]
        owned = local_slice(range(len(lengths)), self.dist, what="sft.batch_size")
        return local_micro_batches(self.dist, lengths, self.cfg.sft.micro_batch_tokens, owned)

    def samples(self) -> list[dict]:
        return []


def run_sft(cfg: RunConfig, *, session: Session | None = None, stop_after: int | None = None,
            stop_when: Callable[[int], bool] | None = None, dist: DistContext | None = None) -> dict:
    """Train for cfg.sft.steps (resuming per cfg.checkpoint.resume); held-out evaluation
    when the recipe names rewards. `stop_after` and `stop_when` as in `run_loop` (the
    demo's "warm up to partial accuracy" is a stop_when)."""
    ses = session or open_session(cfg, need_target=True, dist=dist)
    layout = None
    if cfg.rollout.multi_turn:  # a warm-up trains exactly the ids (and tools in the prompt) a rollout makes
        layout = episode_renderer(ses.tokenizer, cfg.rollout, tool_functions=ses.tool_functions).transcript
    examples = build_sft_examples(ses.train_rows, ses.tokenizer, cfg.data, cfg.sft.max_seq_len,
                                  context_len=ses.context_len, overlong=cfg.sft.overlong, stats=ses.data_stats,
                                  chat_layout=layout, vision=ses.vision)
    stream = PromptStream(examples, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    trainer = SFTStep(cfg, ses.model, make_optimizer(ses.model, cfg, ses.dist), stream, dist=ses.dist)
    evaluation = None
    if cfg.rewards:
        prompts = ses.eval_prompts()
        # completions as long as the GRPO stage's, which SFT usually precedes
        evaluation = Evaluation(prompts=prompts, rewards=ses.rewards(),
                                max_new_tokens=cfg.grpo.max_new_tokens) if prompts else None
    return run_loop(trainer, ses, evaluation=evaluation, stop_after=stop_after, stop_when=stop_when)
