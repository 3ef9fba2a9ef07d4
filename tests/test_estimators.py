"""Critic-free estimators (rlfuse.train.advantages: rloo, reinforce_pp, reinforce_pp_baseline)
and the CISPO loss (rlfuse.kernels.loss.policy, both backends) on hand-computed cases.

    python -m pytest -q tests/test_estimators.py
"""

import math
import statistics

import pytest
import torch

from rlfuse.kernels.loss.policy import policy_loss_ref
from rlfuse.kernels.loss.triton_policy import policy_loss_triton
from rlfuse.train.advantages import group_advantages, reinforce_pp_advantages, rloo_advantages, token_advantages


def test_rloo_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 5.0, 2.0])  # two groups of G=3
    # each reward minus the mean of the other two of its group
    want = [1 - 0, 0 - 0.5, 0 - 0.5, 2 - 3.5, 5 - 2, 2 - 3.5]
    torch.testing.assert_close(rloo_advantages(r, 3), torch.tensor(want), rtol=0, atol=1e-7)
    # = G / (G - 1) times the centred reward (Dr. GRPO's advantage)
    torch.testing.assert_close(rloo_advantages(r, 3), 1.5 * group_advantages(r, 3, "none"))
    with pytest.raises(ValueError, match="groups of 4"):
        rloo_advantages(r, 4)


def test_reinforce_pp_global_normalization_hand_computed():
    # rewards 1 and 0 on sequences of 1 and 3 tokens: token returns (1, 0, 0, 0), mean 0.25,
    # unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5 -> (1.5, -0.5, -0.5, -0.5)
    a = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), [1, 3], eps=0.0)
    torch.testing.assert_close(a, torch.tensor([1.5, -0.5, -0.5, -0.5]), rtol=0, atol=1e-7)


def test_reinforce_pp_kl_folded_into_returns():
    # two sequences of 2 tokens, k1 KL per token, kl_coef 0.1: R_t = r - 0.1 * sum_{u >= t} kl_u
    kl = torch.tensor([0.5, 1.0, -1.0, 2.0])
    returns = [1 - 0.1 * 1.5, 1 - 0.1 * 1.0, 0 - 0.1 * 1.0, 0 - 0.1 * 2.0]
    mu, sd = statistics.mean(returns), statistics.stdev(returns)
    a = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), [2, 2], kl_N=kl, kl_coef=0.1, eps=0.0)
    torch.testing.assert_close(a, torch.tensor([(x - mu) / sd for x in returns]), rtol=0, atol=1e-6)
    # kl_coef 0 ignores the KL
    b = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), [2, 2], kl_N=kl, kl_coef=0.0, eps=0.0)
    torch.testing.assert_close(b, torch.tensor([1.0, 1.0, -1.0, -1.0]) / math.sqrt(4 / 3))


def test_reinforce_pp_baseline_hand_computed():
    # groups of 2: centred rewards (0.5, -0.5 | -0.5, 0.5) on 1, 2, 1, 1 tokens:
    # tokens (0.5, -0.5, -0.5, -0.5, 0.5): mean -0.1, unbiased var (2 * 0.36 + 3 * 0.16) / 4 = 0.3
    a = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), [1, 2, 1, 1], group_size=2, eps=0.0)
    want = (torch.tensor([0.5, -0.5, -0.5, -0.5, 0.5]) + 0.1) / math.sqrt(0.3)
    torch.testing.assert_close(a, want, rtol=0, atol=1e-6)


def test_token_advantages_dispatch():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    lens = [2, 1, 3, 1]
    g = token_advantages("group", r, lens, 2)
    seq = group_advantages(r, 2)
    assert [t.shape[0] for t in g] == lens and all(torch.equal(t, seq[i].expand(n)) for i, (t, n) in
                                                   enumerate(zip(g, lens)))
    lo = token_advantages("rloo", r, lens, 2)
    assert [float(t[0]) for t in lo] == [1.0, -1.0, -1.0, 1.0]
    pp = token_advantages("reinforce_pp_baseline", r, lens, 2)
    torch.testing.assert_close(torch.cat(pp), reinforce_pp_advantages(r, lens, group_size=2))
    with pytest.raises(ValueError, match="advantage must be one of"):
        token_advantages("ppo", r, lens, 2)


@pytest.mark.parametrize("clip_low", [False, True])
def test_cispo_hand_computed_both_backends(clip_low):
    """seq 0: ratios (1, 1.5, 0.5), A = +1; seq 1: ratios (1.1, 0.7), A = -2, and a masked
    token. Clip 0.2, capped above only (the paper's form): weights (1, 1.2, 0.5 | 1.1, 0.7);
    with cispo_clip_low also bounded below: (1, 1.2, 0.8 | 1.1, 0.8). pg_t = -w_t A_t logp_t,
    token mean."""
    ratios = [1.0, 1.5, 0.5, 1.1, 0.7, 3.0]
    old = [-1.0, -2.0, -0.5, -1.5, -0.3, -2.5]
    lp = [o + math.log(r) for o, r in zip(old, ratios)]
    w = [1.0, 1.2, 0.8, 1.1, 0.8] if clip_low else [1.0, 1.2, 0.5, 1.1, 0.7]
    a = [1.0, 1.0, 1.0, -2.0, -2.0]
    want = sum(-wi * ai * li for wi, ai, li in zip(w, a, lp)) / 5
    want_grad = [-wi * ai / 5 for wi, ai in zip(w, a)] + [0.0]
    for fn in (policy_loss_ref, policy_loss_triton):
        logp = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
        loss, st = fn(logp, torch.tensor(old, dtype=torch.float64),
                      torch.tensor(a + [-2.0], dtype=torch.float64), torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool),
                      torch.tensor([0, 0, 0, 1, 1, 1]), 2, loss_type="cispo", clip_low=0.2, clip_high=0.2,
                      cispo_clip_low=clip_low)
        assert loss.item() == pytest.approx(want, abs=1e-9), fn.__name__
        # weights changed by a bound: r = 1.5, and with the lower bound 0.5 and 0.7 (1.1 inside)
        assert st["clip_frac"].item() == pytest.approx(3 / 5 if clip_low else 1 / 5)
        loss.backward()
        torch.testing.assert_close(logp.grad, torch.tensor(want_grad, dtype=torch.float64), rtol=0, atol=1e-9)


# ---------------------------------------------------------------- in the GRPO trainer
def _trainer(cfg, ses):
    from rlfuse.data.prompts import PromptStream, build_prompts
    from rlfuse.train.grpo import GRPOStep
    from rlfuse.train.loop import make_optimizer

    prompts = build_prompts(ses.train_rows, ses.tokenizer, cfg.data)
    return GRPOStep(cfg, ses.model, ses.sampler, ses.rewards(), PromptStream(prompts, seed=0),
                       make_optimizer(ses.model, cfg))


@pytest.mark.parametrize("advantage", ["rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_estimators_train_in_grpo(tmp_path, advantage):
    from train_setup import tiny_cfg, tiny_session

    cfg = tiny_cfg(tmp_path, f"grpo.advantage={advantage}", "grpo.kl_coef=0.1", "grpo.loss_type=cispo",
                   "grpo.mu=2", "grpo.mini_batches=2")
    ses = tiny_session(cfg)
    tr = _trainer(cfg, ses)
    for step in range(2):
        m = tr.step(step)
        assert torch.isfinite(torch.as_tensor(m["loss"])), m
    folded = advantage != "rloo"
    assert tr.update.kl_in_loss is not folded
    if folded:
        assert float(m["kl"]) == 0.0  # REINFORCE++: the KL is in the return, not in the loss
        # the trainer's advantages = the estimator on k1 = rollout - reference log-probs
        prompts = tr.stream.take(4)
        samples = ses.sampler.generate([p.ids for p in prompts], n=4, temperature=1.0, max_tokens=3, seed=7)
        r = torch.tensor([float(len(s.token_ids) % 2) for s in samples])
        ref = tr.update.trainer_logprobs(prompts, samples, list(range(16)), model=tr.ref_model)
        kl = torch.cat([s.logprobs - ref[j] for j, s in enumerate(samples)])
        assert kl.abs().max() > 1e-4  # the policy has moved away from the reference
        lens = [len(s.token_ids) for s in samples]
        want = reinforce_pp_advantages(r, lens, kl_N=kl, kl_coef=0.1,
                                       group_size=4 if advantage == "reinforce_pp_baseline" else None)
        torch.testing.assert_close(torch.cat(tr._advantages(prompts, samples, r)), want, rtol=1e-5, atol=1e-5)
    else:
        assert float(m["kl"]) > 0.0
