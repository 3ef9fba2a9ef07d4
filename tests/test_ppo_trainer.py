"""The PPO trainer on a tiny model with the TinySampler: both models updated (the policy in
place, seen by the next rollout), metrics, micro-batching invariance of both updates, the
KL reference and its adaptive coefficient, the entropy bonus, a critic from a checkpoint,
exact resume (critic and its optimizer, KL coefficient, reward statistics), and the CLI
with the engine. Run: python -m pytest -q tests/test_ppo_trainer.py"""

import json

import pytest
import torch
from train_setup import tiny_cfg, tiny_recipe, tiny_session

from rlfuse.cli import main
from rlfuse.data.prompts import PromptStream, build_prompts
from rlfuse.train.loop import make_optimizer
from rlfuse.train.ppo import PPOStep, build_critic, make_critic_optimizer, run_ppo

PPO = {"steps": 3, "prompts_per_step": 4, "samples_per_prompt": 2, "max_new_tokens": 3, "mu": 2,
       "critic_lr": 1e-2, "kl_coef": 0.1}
_CLOCK = ("time/", "tokens_per_s", "memory/")


def _cfg(tmp_path, *over, **ppo):
    return tiny_cfg(tmp_path, *over, ppo={**PPO, **ppo})


def _trainer(cfg, ses):
    prompts = build_prompts(ses.train_rows, ses.tokenizer, cfg.data)
    critic = build_critic(cfg, ses.model)
    return PPOStep(cfg, ses.model, ses.sampler, ses.rewards(), PromptStream(prompts, seed=0),
                      make_optimizer(ses.model, cfg), critic, make_critic_optimizer(critic, cfg))


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_step_updates_policy_in_place_and_critic(tmp_path):
    cfg = _cfg(tmp_path)
    ses = tiny_session(cfg)
    tr = _trainer(cfg, ses)
    ptrs = {n: p.data_ptr() for n, p in ses.model.named_parameters()}
    pol0, crit0 = _snapshot(ses.model), _snapshot(tr.critic)
    probe = [ses.tokenizer.encode("3+4=")]
    lp0 = ses.sampler.generate(probe, n=1, temperature=0.0, max_tokens=3, seed=0)[0].logprobs
    m = tr.step(0)
    assert all(p.data_ptr() == ptrs[n] for n, p in ses.model.named_parameters())
    assert any(not torch.equal(p, pol0[n]) for n, p in ses.model.named_parameters())
    assert not torch.equal(tr.critic.score.weight, crit0["score.weight"])  # the zero head moved
    assert not torch.equal(ses.sampler.generate(probe, n=1, temperature=0.0, max_tokens=3, seed=0)[0].logprobs, lp0)
    for key in ("reward/mean", "accuracy", "critic/value_loss", "critic/explained_variance",
                "critic/value_clip_frac", "critic/grad_norm", "returns/mean", "values/mean", "kl_coef", "kl",
                "kl/seq", "adv/std", "loss", "clip_frac", "ratio_mean", "entropy", "grad_norm", "lr",
                "mismatch/max_abs", "time/prepare"):
        assert key in m, key
        assert torch.isfinite(torch.as_tensor(m[key])), key
    # first step: V = 0 everywhere (zero head), so the values explain nothing
    assert float(m["values/mean"]) == 0.0 and float(m["critic/explained_variance"]) == pytest.approx(0.0, abs=1e-6)
    assert float(m["mismatch/max_abs"]) < 1e-5
    assert float(m["kl"]) == pytest.approx(0.0, abs=1e-6)  # the reference is the initial policy
    m2 = tr.step(1)
    assert float(m2["kl"]) != 0.0 and float(m2["values/mean"]) != 0.0


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_micro_batching_does_not_change_either_gradient(tmp_path, loss_type):
    results = []
    for budget in (10_000, 12):  # one micro-batch vs about one sequence per micro-batch
        cfg = _cfg(tmp_path / str(budget), mu=1, micro_batch_tokens=budget, loss_type=loss_type,
                   entropy_coef=0.01)
        ses = tiny_session(cfg)
        tr = _trainer(cfg, ses)
        grads = {}
        for name, opt in (("policy", tr.optimizer), ("critic", tr.critic_optimizer)):
            def record(lr, opt=opt, name=name, step=opt.step, grads=grads):  # the gradients each optimizer steps on
                grads[name] = [g.clone() for g in opt.grads()]
                step(lr)
            opt.step = record
        results.append((tr.step(0), grads))
    (m_a, g_a), (m_b, g_b) = results
    for key in ("loss", "critic/value_loss", "grad_norm", "critic/grad_norm", "entropy"):
        assert float(m_a[key]) == pytest.approx(float(m_b[key]), rel=1e-5, abs=1e-7), key
    for name in ("policy", "critic"):
        for a, b in zip(g_a[name], g_b[name], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_no_reference_without_kl_and_adaptive_coefficient(tmp_path):
    cfg = _cfg(tmp_path / "nokl", kl_coef=0.0)
    ses = tiny_session(cfg)
    tr = _trainer(cfg, ses)
    assert tr.ref_model is None
    assert float(tr.step(0)["kl"]) == 0.0
    cfg = _cfg(tmp_path / "adaptive", kl_coef=0.1, kl_target=1e-6, kl_horizon=8)
    ses = tiny_session(cfg)
    tr = _trainer(cfg, ses)
    tr.step(0)  # KL 0 < target: beta * (1 - 0.2 * 8 / 8)
    assert tr.kl_coef == pytest.approx(0.1 * 0.8)
    tr.step(1)  # the policy moved: KL >> target: beta * (1 + 0.2)
    assert tr.kl_coef == pytest.approx(0.1 * 0.8 * 1.2)


def test_entropy_bonus_changes_the_policy_update_only(tmp_path):
    out = []
    for coef in (0.0, 1.0):
        cfg = _cfg(tmp_path / str(coef), mu=1, entropy_coef=coef)
        ses = tiny_session(cfg)
        tr = _trainer(cfg, ses)
        tr.step(0)
        out.append((_snapshot(ses.model), _snapshot(tr.critic)))
    assert any(not torch.equal(out[0][0][n], out[1][0][n]) for n in out[0][0])
    assert all(torch.equal(out[0][1][n], out[1][1][n]) for n in out[0][1])  # same rollout, same critic step


def test_resume_reproduces_uninterrupted_run(tmp_path):
    def rows(run_dir):
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith(_CLOCK)}
                for r in map(json.loads, lines) if r["stage"] == "ppo"}

    kw = dict(steps=4, kl_target=0.5, kl_horizon=16)
    full = _cfg(tmp_path / "full", "checkpoint.every=2", **kw)
    run_ppo(full, session=tiny_session(full))
    part = _cfg(tmp_path / "part", "checkpoint.every=2", **kw)
    run_ppo(part, session=tiny_session(part), stop_after=2)
    resumed = _cfg(tmp_path / "part", "checkpoint.every=2", "checkpoint.resume=auto", **kw)
    run_ppo(resumed, session=tiny_session(resumed))
    a, b = rows(tmp_path / "full"), rows(tmp_path / "part")
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        assert a[step] == b[step], f"step {step} differs after resume"


def test_critic_from_checkpoint_and_config_errors(tmp_path):
    import transformers
    from tiny_hf import hf_config, randomize_

    cfg = _cfg(tmp_path / "run")
    ses = tiny_session(cfg)
    v = ses.model.config.vocab_size
    hf = transformers.AutoModelForSequenceClassification.from_config(
        hf_config("qwen3", vocab_size=v, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_labels=1, pad_token_id=0),
        dtype=torch.float32)
    randomize_(hf, 1).save_pretrained(tmp_path / "rm")
    crit = build_critic(_cfg(tmp_path / "run", critic_path=str(tmp_path / "rm")), ses.model)
    torch.testing.assert_close(crit.score.weight, hf.score.weight)  # a reward model's head is kept
    small = transformers.AutoModelForSequenceClassification.from_config(
        hf_config("qwen3", vocab_size=8, num_labels=1), dtype=torch.float32)
    small.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="vocab_size 8, fewer than the policy's"):
        build_critic(_cfg(tmp_path / "run", critic_path=str(tmp_path / "small")), ses.model)
    for bad, msg in ((dict(prompts_per_step=3, mini_batches=2), "multiple of ppo.mini_batches"),
                     (dict(lam=1.5), "ppo.lam must be in"), (dict(kl_target=1.0, kl_coef=0.0), "kl_target"),
                     (dict(loss_type="gspo"), "ppo.loss_type")):
        with pytest.raises(ValueError, match=msg):
            _cfg(tmp_path, **bad)


def test_cli_ppo_with_the_engine(tmp_path, capsys):
    path = tiny_recipe(tmp_path / "tiny.yaml", logging={"tensorboard": False},
                       ppo={"steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 3, "mu": 2})
    run_dir = tmp_path / "run"
    assert main(["ppo", str(path), "--run-dir", str(run_dir)]) == 0
    assert "ppo done: held-out accuracy" in capsys.readouterr().out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["stage"] == "ppo"] == [1, 2]
    assert (run_dir / "final" / "model.safetensors").exists()


def test_nonfinite_policy_and_value_steps_are_skipped(tmp_path, monkeypatch):
    """A NaN policy loss skips the policy step and a NaN value loss the critic step: the
    weights stay bitwise, the skips are counted per rollout step (issue 16)."""
    import rlfuse.train.ppo as ppo_mod

    cfg = _cfg(tmp_path)
    ses = tiny_session(cfg)
    tr = _trainer(cfg, ses)
    before = {n: p.detach().clone() for n, p in ses.model.named_parameters()}
    critic_before = {n: p.detach().clone() for n, p in tr.critic.named_parameters()}
    real_loss, real_value = ppo_mod.policy_loss, ppo_mod.value_loss
    monkeypatch.setattr(ppo_mod, "policy_loss", lambda *a, **k: (lambda l, s: (l * float("nan"), s))(*real_loss(*a, **k)))
    monkeypatch.setattr(ppo_mod, "value_loss", lambda *a, **k: (lambda v, c: (v * float("nan"), c))(*real_value(*a, **k)))
    m = tr.step(0)
    assert m["optim/skipped_steps"] == cfg.ppo.mu * cfg.ppo.mini_batches
    assert m["critic/skipped_steps"] == cfg.ppo.mu * cfg.ppo.mini_batches
    assert all(torch.equal(p, before[n]) for n, p in ses.model.named_parameters())
    assert all(torch.equal(p, critic_before[n]) for n, p in tr.critic.named_parameters())
