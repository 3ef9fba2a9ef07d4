"""SFT: the loss is the mean NLL of completion tokens only; packing into micro-batches
and activation checkpointing do not change loss or gradient; training lowers the loss."""

import pytest
import torch
from train_setup import tiny_cfg, tiny_session

from rlfuse.data.prompts import PromptStream, build_sft_examples
from rlfuse.engine.naive import teacher_forced_logprobs
from rlfuse.train.loop import make_optimizer
from rlfuse.train.sft import SFTStep, run_sft


def _examples(cfg, ses, n=8):
    return build_sft_examples(ses.train_rows, ses.tokenizer, cfg.data, cfg.sft.max_seq_len)[:n]


def _trainer(cfg, ses, examples):
    return SFTStep(cfg, ses.model, make_optimizer(ses.model, cfg), PromptStream(examples))


def test_loss_is_mean_nll_over_completion_tokens(tmp_path):
    cfg = tiny_cfg(tmp_path, "optim.lr=1e-3")
    ses = tiny_session(cfg, need_target=True)
    ex = _examples(cfg, ses)
    # oracle: teacher-forced log-probs of the completion given the prompt, one sequence at a time
    nll, n = 0.0, 0
    for e in ex:
        k = e.mask.index(True)
        with torch.no_grad():
            lp = teacher_forced_logprobs(ses.model, [e.ids[:k]], [e.ids[k:]])[0]
        nll -= float(lp.sum())
        n += len(e.ids) - k
    m = _trainer(cfg, ses, ex).train_step(ex, 0)
    assert float(m["loss"]) == pytest.approx(nll / n, rel=1e-6)
    assert m["target_tokens"] == n


@pytest.mark.parametrize("variant", ["micro_batch_tokens=7", "gradient_checkpointing"])
def test_packing_and_checkpointing_do_not_change_loss_or_gradient(tmp_path, variant):
    res = []
    for v in (None, variant):
        over = [] if v is None else ([f"sft.{v}"] if v.startswith("micro") else ["model.gradient_checkpointing=true"])
        cfg = tiny_cfg(tmp_path / str(v), *over)
        ses = tiny_session(cfg, need_target=True)
        ex = _examples(cfg, ses)
        m = _trainer(cfg, ses, ex).train_step(ex, 0)
        res.append((float(m["loss"]), float(m["grad_norm"]), [p.detach().clone() for p in ses.model.parameters()]))
    (l0, g0, p0), (l1, g1, p1) = res
    assert l1 == pytest.approx(l0, rel=1e-6) and g1 == pytest.approx(g0, rel=1e-5)
    if variant == "gradient_checkpointing":  # same op sequence: identical update
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))


def test_sft_lowers_the_loss(tmp_path):
    cfg = tiny_cfg(tmp_path, "sft.steps=30", "optim.lr=0.01")
    res = run_sft(cfg, session=tiny_session(cfg, need_target=True))
    losses = [r["loss"] for r in res["history"]]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
