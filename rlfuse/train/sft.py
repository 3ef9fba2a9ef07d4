"""Supervised fine-tuning on completion / assistant tokens only.

One optimizer step takes `sft.batch_size` examples, packs them into micro-batches of at
most `sft.micro_batch_tokens` tokens, and accumulates gradients of
    loss = -(1 / N) sum_{target tokens t} log p(y_t | y_<t),   N = target tokens of the step,
so the result does not depend on how the step was split into micro-batches. Log-probs
come from `rlfuse.kernels.logprob.token_logprobs` on the rows that predict targets only
(no (T, V) logits). Then grad-norm clipping, the scheduled LR and MasterAdamW.
Run: rlfuse sft RECIPE.yaml   Test: python -m pytest -q tests/test_train_sft.py
"""

from __future__ import annotations

import logging
import time

import torch

from rlfuse.kernels.logprob import token_logprobs
from rlfuse.train.batching import PackedBatch, pack_by_tokens
from rlfuse.train.checkpoint import load_checkpoint, resolve_resume, save_checkpoint, save_final
from rlfuse.train.config import RunConfig
from rlfuse.train.data import PromptStream, SFTExample, build_sft_examples
from rlfuse.train.evaluate import evaluate
from rlfuse.train.metrics import RunLog, peak_memory_mb
from rlfuse.train.optim import MasterAdamW, clip_grad_norm_, lr_at
from rlfuse.train.session import Session, open_session

log = logging.getLogger(__name__)


def make_optimizer(model, cfg: RunConfig) -> MasterAdamW:
    o = cfg.optim
    return MasterAdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


class SFTTrainer:
    def __init__(self, model, optimizer: MasterAdamW, cfg: RunConfig):
        self.model, self.opt, self.cfg = model, optimizer, cfg
        self.device = model.lm_head_weight.device

    def train_step(self, examples: list[SFTExample], step: int) -> dict:
        s, o = self.cfg.sft, self.cfg.optim
        self.model.train()
        n_ctx = [ex.mask.index(True) for ex in examples]
        total_targets = sum(sum(ex.mask[c:]) for ex, c in zip(examples, n_ctx))
        loss_sum = torch.zeros((), device=self.device)
        t0 = time.perf_counter()
        n_tok = 0
        for mb in pack_by_tokens([len(ex.ids) for ex in examples], s.micro_batch_tokens):
            batch = PackedBatch.build([(examples[i].ids, n_ctx[i]) for i in mb], self.device)
            w_N = torch.tensor([float(m) for i in mb for m in examples[i].mask[n_ctx[i]:]],
                               device=self.device)
            h_TD = self.model(batch.input_ids, batch.positions, batch.attn)
            logp_N = token_logprobs(h_TD[batch.rows], self.model.lm_head_weight, batch.targets)
            loss = -(logp_N * w_N).sum() / total_targets
            loss.backward()
            loss_sum += loss.detach()
            n_tok += batch.num_tokens
        grad_norm = clip_grad_norm_(self.opt.grads(), o.max_grad_norm)
        lr = lr_at(step, lr=o.lr, total_steps=s.steps, warmup_steps=o.warmup_steps, schedule=o.schedule,
                   min_lr_ratio=o.min_lr_ratio)
        self.opt.step(lr)
        self.opt.zero_grad()
        dt = time.perf_counter() - t0
        return {"loss": loss_sum, "grad_norm": grad_norm, "lr": lr, "tokens": float(n_tok),
                "target_tokens": float(total_targets), "tokens_per_s": n_tok / max(dt, 1e-9), "time/step": dt}


def run_sft(cfg: RunConfig, *, session: Session | None = None, stop_after: int | None = None,
            stop_when=None) -> dict:
    """Train for cfg.sft.steps (resuming per cfg.checkpoint.resume). `stop_after` ends the
    run after that many steps of this invocation (tests of resume); `stop_when(step)`, if
    given, is called after every step and ends training early when it returns True (the
    demo's "warm up to partial accuracy")."""
    ses = session or open_session(cfg, need_target=True)
    model, tok = ses.model, ses.tokenizer
    examples = build_sft_examples(ses.train_rows, tok, cfg.data, cfg.sft.max_seq_len)
    stream = PromptStream(examples, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    opt = make_optimizer(model, cfg)
    trainer = SFTTrainer(model, opt, cfg)
    start = 0
    ckpt = resolve_resume(cfg.checkpoint.resume, ses.run_dir)
    if ckpt is not None:
        state = load_checkpoint(ckpt, model, opt)
        stream.load_state_dict(state["data"])
        start = state["step"]
    runlog = RunLog(ses.run_dir, tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress,
                    total=cfg.sft.steps, desc="sft", initial=start)
    rewards = ses.rewards() if cfg.rewards else None
    eval_prompts = ses.eval_prompts() if rewards is not None else []
    history, evals = [], []

    def do_eval(step):
        if not eval_prompts:
            return
        res = evaluate(ses.sampler, eval_prompts, rewards, max_new_tokens=cfg.grpo.max_new_tokens)
        ses.sampler.sleep()
        runlog.log(step, res, stage="eval")
        evals.append({"step": step, **res})
        log.info("sft eval step %d: %s", step, {k: round(v, 4) for k, v in res.items()})

    def save(step):
        save_checkpoint(ses.run_dir, step, model, opt, {"data": stream.state_dict()}, tokenizer=tok,
                        keep_last=cfg.checkpoint.keep_last)

    done = start
    finished = False
    try:
        while done < cfg.sft.steps:
            if stop_after is not None and done - start >= stop_after:
                break
            m = trainer.train_step(stream.take(cfg.sft.batch_size), done)
            m["memory/peak_mb"] = peak_memory_mb(ses.device)
            done += 1
            if done % cfg.logging.log_every == 0 or done == cfg.sft.steps:
                row = runlog.log(done, m, stage="sft")
                history.append(row)
                runlog.progress(1, loss=row["loss"], s_per_step=row["time/step"])
            else:
                runlog.progress(1)
            if stop_when is not None and stop_when(done):
                log.info("sft: stop condition met after step %d", done)
                finished = True
                break
            if cfg.sft.eval_every and done % cfg.sft.eval_every == 0 and done < cfg.sft.steps:
                do_eval(done)
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < cfg.sft.steps:
                save(done)
        finished = finished or done >= cfg.sft.steps
        if finished:
            if cfg.checkpoint.save_final:
                save(done)
            save_final(ses.run_dir, model, tok)
            do_eval(done)
    finally:
        runlog.close()
    return {"history": history, "evals": evals, "steps": done, "run_dir": str(ses.run_dir), "model": model,
            "tokenizer": tok}
