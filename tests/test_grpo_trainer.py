"""The GRPO trainer on a tiny model with the TinySampler: in-place updates seen by the
next rollout, micro-batching invariance, dynamic sampling, truncation masking, mismatch
logging, KL reference, every loss type with mu/mini-batches, metrics and samples files."""

import json

import pytest
import torch
from tiny_sampler import TinySampler
from train_setup import tiny_cfg, tiny_session

from rlfuse.data.prompts import PromptStream, build_prompts
from rlfuse.train.advantages import group_advantages
from rlfuse.train.grpo import GRPOStep, run_grpo
from rlfuse.train.loop import make_optimizer


def _trainer(cfg, ses, seed=0):
    prompts = build_prompts(ses.train_rows, ses.tokenizer, cfg.data)
    return GRPOStep(cfg, ses.model, ses.sampler, ses.rewards(), PromptStream(prompts, seed=seed),
                       make_optimizer(ses.model, cfg))


def test_step_updates_shared_weights_in_place_and_next_rollout_uses_them(tmp_path):
    cfg = tiny_cfg(tmp_path)
    ses = tiny_session(cfg)
    tr = _trainer(cfg, ses)
    params = dict(ses.model.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    before = {n: p.detach().clone() for n, p in params.items()}
    probe = [ses.tokenizer.encode("3+4=")]
    lp0 = ses.sampler.generate(probe, n=1, temperature=0.0, max_tokens=3, seed=0)[0].logprobs
    m = tr.step(0)
    assert all(p.data_ptr() == ptrs[n] for n, p in params.items())  # same storage: no copies
    assert any(not torch.equal(p, before[n]) for n, p in params.items())
    lp1 = ses.sampler.generate(probe, n=1, temperature=0.0, max_tokens=3, seed=0)[0].logprobs
    assert not torch.equal(lp0, lp1)  # the sampler sees the updated tensors
    for key in ("reward/mean", "reward/arithmetic", "accuracy", "completion_len/mean", "truncated_frac", "adv/std",
                "loss", "clip_frac", "kl", "entropy", "grad_norm", "lr", "tokens_per_s/rollout", "tokens_per_s/train",
                "time/generate", "time/score", "time/train", "memory/peak_mb", "mismatch/max_abs", "mismatch/kl_k3"):
        assert key in m, key
    assert torch.isfinite(torch.as_tensor(m["loss"]))


def test_rollout_and_training_logprobs_agree(tmp_path):
    cfg = tiny_cfg(tmp_path)
    ses = tiny_session(cfg)
    m = _trainer(cfg, ses).step(0)
    # same weights, same function (token_logprobs), different forward layout: fp32 drift only
    assert float(m["mismatch/max_abs"]) < 1e-5
    assert abs(float(m["mismatch/kl_k3"])) < 1e-9
    assert float(m["ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
    assert float(m["clip_frac"]) == 0.0  # first (on-policy) pass never clips


def test_greedy_rollouts_train_on_temperature_one_logprobs(tmp_path):
    # greedy (T = 0) samples come with the unscaled policy's log-probs; the trainer
    # recomputes the same quantity (logprob_temperature), so the first pass is on-policy
    cfg = tiny_cfg(tmp_path)
    # RunConfig refuses grpo.temperature 0 (identical completions per group); the trainer's
    # greedy branch is what PPO's temperature 0 runs, so it is checked here on a set field
    object.__setattr__(cfg.grpo, "temperature", 0.0)
    ses = tiny_session(cfg)
    m = _trainer(cfg, ses).step(0)
    assert float(m["mismatch/max_abs"]) < 1e-5
    assert float(m["ratio_mean"]) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_micro_batching_does_not_change_the_gradient(tmp_path, loss_type):
    grads = []
    for budget in (10_000, 9):  # one micro-batch vs one sequence per micro-batch
        cfg = tiny_cfg(tmp_path / str(budget), f"grpo.micro_batch_tokens={budget}", f"grpo.loss_type={loss_type}",
                       "grpo.mask_truncated=true")
        ses = tiny_session(cfg)
        tr = _trainer(cfg, ses)
        prompts = tr.stream.take(4)
        samples = ses.sampler.generate([p.ids for p in prompts], n=4, temperature=1.0, max_tokens=3, seed=5)
        r = torch.tensor([float(len(s.token_ids) % 2) for s in samples])  # any reward with variance
        adv = group_advantages(r, 4)
        # perturb the old log-probs so ratios differ from 1 and clipping is exercised
        for k, s in enumerate(samples):
            s.logprobs = s.logprobs + 0.3 * torch.sin(torch.arange(len(s.token_ids)) + k)
        tr.update.accumulate_gradients(prompts, samples, adv, list(range(16)))
        grads.append([p.grad.clone() for p in ses.model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_dynamic_sampling_and_no_update_when_every_group_is_flat(tmp_path):
    # reward 1 for everything: every group has zero variance -> nothing to learn
    (tmp_path / "flat.py").write_text("def one(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    cfg = tiny_cfg(tmp_path, "grpo.dynamic_sampling=true", rewards=[{"name": f"{tmp_path}/flat.py:one"}])
    ses = tiny_session(cfg)
    before = [p.detach().clone() for p in ses.model.parameters()]
    m = _trainer(cfg, ses).step(0)
    assert m["groups/kept"] == 0.0 and m["skipped_update"] == 1.0 and float(m["groups/zero_variance_frac"]) == 1.0
    assert all(torch.equal(p, b) for p, b in zip(ses.model.parameters(), before))


def test_masked_truncated_completions_get_no_gradient(tmp_path):
    cfg = tiny_cfg(tmp_path, "grpo.mask_truncated=true", "grpo.max_new_tokens=1")  # 1 token: all truncated
    ses = tiny_session(cfg)
    tr = _trainer(cfg, ses)
    prompts = tr.stream.take(4)
    samples = ses.sampler.generate([p.ids for p in prompts], n=4, temperature=1.0, max_tokens=1, seed=1)
    assert all(s.truncated or s.token_ids[-1] in ses.tokenizer.eos_token_ids for s in samples)
    trunc = [j for j, s in enumerate(samples) if s.truncated]
    adv = torch.randn(16)
    tr.update.accumulate_gradients(prompts, samples, adv, trunc)
    assert all(p.grad is None or not p.grad.any() for p in ses.model.parameters())


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_loss_types_with_mu_and_mini_batches_and_kl(tmp_path, loss_type):
    clip = "grpo.clip_low=0.0003" if loss_type == "gspo" else "grpo.clip_low=0.2"
    cfg = tiny_cfg(tmp_path, f"grpo.loss_type={loss_type}", "grpo.mu=2", "grpo.mini_batches=2", "grpo.kl_coef=0.1",
                   clip, "grpo.dual_clip=3")
    ses = tiny_session(cfg)
    tr = _trainer(cfg, ses)
    assert tr.ref_model is not None and tr.ref_model is not ses.model
    for step in range(2):
        m = tr.step(step)
        assert torch.isfinite(torch.as_tensor(m["loss"])), m
    # by the second step the policy has moved away from the frozen reference
    assert float(m["kl"]) > 0.0
    assert tr.optimizer.step_count == 2 * 2 * 2  # steps x mu x mini_batches


def test_run_grpo_writes_metrics_samples_config_and_checkpoints(tmp_path):
    cfg = tiny_cfg(tmp_path / "run", "checkpoint.every=2", "checkpoint.save_final=true", "grpo.steps=3")
    ses = tiny_session(cfg)
    res = run_grpo(cfg, session=ses)
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["stage"] == "grpo"] == [1, 2, 3]
    assert [r["step"] for r in rows if r["stage"] == "eval"] == [0, 3]
    assert (run / "config.yaml").exists() and (run / "final" / "model.safetensors").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["step"] == 2 and {"prompt", "completion", "reward", "advantage"} <= set(samples[0])
    assert len(res["history"]) == 3


def test_tiny_sampler_matches_seeded_reproduction(tmp_path):
    cfg = tiny_cfg(tmp_path)
    ses = tiny_session(cfg)
    s = TinySampler(ses.model, ses.tokenizer)
    a = s.generate([[4, 5]], n=3, temperature=1.0, max_tokens=3, seed=7)
    b = s.generate([[4, 5]], n=3, temperature=1.0, max_tokens=3, seed=7)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]


@pytest.mark.parametrize("mu, mini_batches", [(1, 1), (2, 2)])
def test_exact_numerics_rollout_logprobs_are_the_trainers_bitwise(tmp_path, mu, mini_batches):
    """The real engine in exact numerics: at every step the trainer's first-pass log-probs
    (with grad, micro-batched) equal the engine's rollout log-probs bit for bit, also after
    updates to the shared weights; fast numerics on the same run drifts (the check can fail)."""
    from rlfuse.train.session import open_session

    seen = {}
    for numerics in ("exact", "fast"):
        cfg = tiny_cfg(tmp_path / numerics, f"engine.numerics={numerics}", f"grpo.mu={mu}",
                       f"grpo.mini_batches={mini_batches}", "grpo.micro_batch_tokens=40", "grpo.max_new_tokens=6")
        ses = open_session(cfg)
        tr = _trainer(cfg, ses)
        seen[numerics] = [tr.step(s) for s in range(2)]
    for m in seen["exact"]:
        assert float(m["mismatch/max_abs"]) == 0.0 and float(m["mismatch/kl_k3"]) == 0.0
        assert float(m["mismatch/ratio_max"]) == 1.0
    assert max(float(m["mismatch/max_abs"]) for m in seen["fast"]) > 0.0


def test_fast_numerics_recomputes_the_old_policy_and_applies_the_corrections(tmp_path):
    """Fast numerics with TIS + MIS + IcePop: the trainer recomputes the old log-probs, the
    corrections log their metrics, and the first pass's ratio is then exactly 1 (old ==
    the trainer's own log-probs); exact numerics with check_every logs a full mismatch of 0."""
    from rlfuse.train.session import open_session

    cfg = tiny_cfg(tmp_path / "fast", "engine.numerics=fast", "grpo.tis_cap=2.0", "grpo.mis_bounds=[0.5, 2.0]",
                   "grpo.icepop_bounds=[0.5, 2.0]", "grpo.max_new_tokens=6")
    m = _trainer(cfg, open_session(cfg)).step(0)
    for key in ("offpolicy/ratio_mean", "offpolicy/tis_weight", "offpolicy/tis_capped_frac",
                "offpolicy/mis_masked_frac", "offpolicy/icepop_masked_frac", "mismatch/full_max_abs"):
        assert key in m, key
    assert float(m["ratio_mean"]) == 1.0 and float(m["clip_frac"]) == 0.0
    assert float(m["mismatch/max_abs"]) == 0.0  # logp vs the recomputed old: same forward
    assert float(m["mismatch/full_max_abs"]) > 0.0  # the engine's log-probs drift (fast)
    cfg = tiny_cfg(tmp_path / "exact", "engine.numerics=exact", "grpo.check_every=1", "grpo.tis_cap=2.0",
                   "grpo.max_new_tokens=6")
    tr = _trainer(cfg, open_session(cfg))
    assert not tr.update.recompute_old
    m = tr.step(0)
    assert float(m["mismatch/full_max_abs"]) == 0.0 and float(m["mismatch/full_kl_k3"]) == 0.0
    assert "offpolicy/tis_weight" not in m


def test_a_step_without_reward_signal_takes_no_optimizer_step(tmp_path, caplog):
    """Every group's rewards equal (a random model never solves a problem): zero policy
    gradient, so no optimizer step either -- AdamW would still move the weights (its momentum
    after an informative step, its weight decay) with nothing learnt. The step is logged,
    with the temperature hint when sampled accuracy is ~0 (docs/agents.md)."""
    import logging

    cfg = tiny_cfg(tmp_path, "optim.weight_decay=0.1", rewards=[{"name": "arithmetic"}])
    ses = tiny_session(cfg)
    tr = _trainer(cfg, ses)
    before = {n: p.detach().clone() for n, p in ses.model.named_parameters()}
    with caplog.at_level(logging.WARNING):
        m = tr.step(0)
    assert float(m["groups/zero_variance_frac"]) == 1.0 and float(m["skipped_update"]) == 1.0
    assert all(torch.equal(p, before[n]) for n, p in ses.model.named_parameters())
    assert "mismatch/max_abs" in m and "loss" in m  # the forward ran: metrics as on any step
    assert "no signal to learn from" in caplog.text and "grpo.temperature=1 samples too far" in caplog.text
