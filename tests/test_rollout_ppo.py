"""PPO on multi-turn episodes: observation tokens are context only (policy loss, KL, entropy,
values, GAE, value loss), GAE skips them, rewards sit on the model's tokens, and exact
numerics hold across turns inside a PPO run.

* GAE with holes in the mask equals GAE on the model's tokens alone (holes removed), and
  is 0 in the holes.
* On scripted episodes (model turns and observations of varied lengths): values,
  advantages and returns are 0 at observation tokens; the advantages and both gradients
  (policy and critic) do not change when the rollout's log-probs at observation positions
  are garbage, and do when the mask is dropped (the comparison can fail).
* Per-turn rewards land on their turns' last model tokens, the rest on the last model token.
* A 2-step PPO run with an environment (per-turn rewards) on the real engine in exact
  numerics: the first update's log-probs equal the rollout's bitwise over every turn
  (mismatch/max_abs 0), and the rollout/* metrics are logged.
Run: python -m pytest -q tests/test_rollout_ppo.py
"""

import pytest
import torch
from test_rollout_grpo import ENV as ECHO_ENV
from test_rollout_grpo import _episodes, _Stub
from train_setup import one_thread, tiny_cfg, tiny_session

from rlfuse.train.grpo import reference_model
from rlfuse.train.loop import make_optimizer
from rlfuse.train.ppo import PPOStep, build_critic, make_critic_optimizer, run_ppo
from rlfuse.train.ppo_math import gae

PPO = {"steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2, "mu": 1, "critic_lr": 1e-2, "eval_every": 0}


def test_gae_skips_masked_positions():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1, 0], [1, 0, 1, 1, 1, 1, 0, 0, 0.0]])
    r, v = torch.randn(2, 9, generator=g), torch.randn(2, 9, generator=g)
    adv, ret = gae(r, v, mask, 0.9, 0.8)
    for b in range(2):
        on = mask[b] > 0
        a1, r1 = gae(r[b][on][None], v[b][on][None], torch.ones(1, int(on.sum())), 0.9, 0.8)
        assert torch.equal(adv[b][on], a1[0]) and torch.equal(ret[b][on], r1[0])
        assert not adv[b][~on].any() and not ret[b][~on].any()
    # a hole is not a reset: the advantage before it sees the rewards after it
    a_plain, _ = gae(r, v, torch.ones(2, 9), 0.9, 0.8)
    assert not torch.equal(adv[0, :2], a_plain[0, :2])


def _trainer(tmp_path, **ppo):
    cfg = tiny_cfg(tmp_path, "rollout.tools=[calculator]", ppo={**PPO, **ppo})
    ses = tiny_session(cfg)
    model = ses.model
    critic = build_critic(cfg, model)
    with torch.no_grad():  # a critic whose values are not 0 everywhere
        for prm in critic.parameters():
            prm.add_(0.05 * torch.randn_like(prm))
    ref = reference_model(model) if cfg.ppo.kl_coef > 0 else None
    trainer = PPOStep(cfg, model, _Stub(), ses.rewards(), None, make_optimizer(model, cfg), critic,
                         make_critic_optimizer(critic, cfg), ref_model=ref)
    if ref is not None:
        with torch.no_grad():  # a reference that differs from the policy: the KL is not 0
            for prm in ref.parameters():
                prm.add_(0.01 * torch.randn_like(prm))
    trainer.grads = {}
    for name, opt in (("policy", trainer.optimizer), ("critic", trainer.critic_optimizer)):
        opt.step = lambda lr=None: None  # weights kept: every call takes gradients of the same models

        def record(opt=opt, name=name, zero=opt.zero_grad):  # the gradients each update would step on
            trainer.grads[name] = torch.cat([g.flatten().clone() for g in opt.grads()])
            zero()
        opt.zero_grad = record
    return trainer


def _prepare_and_grads(trainer, prompts, samples, r):
    adv, ret, vals, _ = trainer._prepare(prompts, samples, r)
    trainer._optimizer_step(prompts, samples, adv, ret, vals, list(range(len(samples))), 0, None)
    return adv, ret, vals, dict(trainer.grads)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_observation_tokens_are_context_only(tmp_path, loss_type):
    with one_thread():
        trainer = _trainer(tmp_path, kl_coef=0.1, entropy_coef=0.01, loss_type=loss_type)
        prompts, samples = _episodes(trainer.model.config.vocab_size, G=2)
        samples = samples[:4]
        r = torch.tensor([1.0, 0.0, 0.5, -1.0])
        adv, ret, vals, grads = _prepare_and_grads(trainer, prompts, samples, r)
        for s, a, rt, v in zip(samples, adv, ret, vals):
            obs = s.loss_mask == 0
            assert obs.any() and not a.cpu()[obs].any() and not rt.cpu()[obs].any() and not v.cpu()[obs].any()
            assert a.cpu()[~obs].abs().sum() > 0 and v.cpu()[~obs].abs().sum() > 0
        for s in samples:  # garbage rollout log-probs at the observation positions
            s.logprobs = torch.where(s.loss_mask > 0, s.logprobs, torch.full_like(s.logprobs, 7.0))
        adv2, _, _, grads2 = _prepare_and_grads(trainer, prompts, samples, r)
        assert all(torch.equal(a, b) for a, b in zip(adv, adv2))
        assert torch.equal(grads["policy"], grads2["policy"]) and torch.equal(grads["critic"], grads2["critic"])
        for s in samples:  # the mask is what protects them
            s.loss_mask = None
        adv3, _, _, grads3 = _prepare_and_grads(trainer, prompts, samples, r)
        assert not torch.equal(grads["policy"], grads3["policy"])
        assert not torch.equal(grads["critic"], grads3["critic"])


@pytest.mark.parametrize("reward_norm", [False, True])
def test_per_turn_rewards_sit_on_their_turns(tmp_path, reward_norm):
    trainer = _trainer(tmp_path, reward_norm=reward_norm)
    trainer.reward_stats.update(torch.tensor([0.0, 3.0, 5.0]))  # used with reward_norm only
    k = trainer.reward_stats.slope() if reward_norm else 1.0
    prompts, samples = _episodes(trainer.model.config.vocab_size, G=2)
    s = samples[2]  # four model turns
    ends = [i for i in range(len(s.token_ids)) if s.loss_mask[i] > 0 and (i + 1 == len(s.token_ids)
                                                                           or s.loss_mask[i + 1] == 0)]
    s.turn_rewards = [(ends[0], 0.25), (ends[1], -0.5)]
    rew = trainer._reward_tokens([samples[0], s], torch.tensor([2.0, 1.0]), len(s.token_ids) + 3)
    assert float(rew[1, ends[0]]) == pytest.approx(0.25 * k) and float(rew[1, ends[1]]) == pytest.approx(-0.5 * k)
    assert float(rew[1, ends[-1]]) == pytest.approx(1.0 + 0.25 * k)  # the rest of the sequence's reward
    assert float(rew[1].sum()) == pytest.approx(1.0) and int((rew[1] != 0).sum()) == 3
    assert rew[0, len(samples[0].token_ids) - 1] == 2.0 and int((rew[0] != 0).sum()) == 1


ENV = ECHO_ENV + '''

class Count:
    """Echo's turns and observations with a per-turn reward (0.1 for an even-length turn)
    and no reward(): the episode's env reward is their sum."""
    def __init__(self, turns=3):
        self.echo = Echo(turns)

    def reset(self, row, *, seed):
        return self.echo.reset(row, seed=seed)

    def step(self, turn):
        s = self.echo.step(turn)
        return Step(messages=s.messages, done=s.done, reward=0.1 * (len(turn.token_ids) % 2 == 0))
'''


def test_ppo_with_an_environment_is_exact_across_turns(tmp_path):
    (tmp_path / "count_env.py").write_text(ENV)
    cfg = tiny_cfg(tmp_path / "run", f"rollout.env={tmp_path / 'count_env.py'}:Count",
                   "rollout.env_kwargs={turns: 3}", "rollout.max_turn_tokens=4", "rollout.max_total_tokens=40",
                   "engine.numerics=exact", "model.kernel_backend=auto", ppo={**PPO, "kl_coef": 0.05})
    with one_thread():
        res = run_ppo(cfg)
    assert len(res["history"]) == 2
    for h in res["history"]:
        assert float(h["rollout/turns_mean"]) == 3.0 and float(h["rollout/obs_tokens_per_episode"]) > 0
        for k in ("rollout/tool_calls_per_episode", "rollout/tool_errors_per_episode",
                  "rollout/tool_timeouts_per_episode", "rollout/truncated_frac"):
            assert k in h
        assert float(h["mismatch/max_abs"]) == 0.0
        assert "reward/env" in h and "critic/value_loss" in h
        assert 0 < float(h["optim/update_ratio"]) < 1 and 0 < float(h["critic/update_ratio"]) < 1
