"""GRPO on multi-turn episodes: masks over the model's tokens, every estimator and loss, and
exact numerics across turns inside a training run.

* Observation tokens are context only: for every advantage estimator and loss type, the
  gradient (and REINFORCE++'s KL-shaped advantages) do not change when the rollout's
  log-probs at observation positions are replaced by garbage, and do change when the mask
  is dropped (the comparison can fail).
* A short GRPO run with an environment (rollout.env) on the real engine in exact numerics:
  episodes of several turns, the trainer's log-probs equal the rollout's bitwise at every
  step (mismatch/full_max_abs 0), the env reward reaches the total reward, rollout metrics logged.
Run: python -m pytest -q tests/test_rollout_grpo.py
"""

import pytest
import torch
from train_setup import one_thread, tiny_cfg, tiny_session

from rlfuse.data import Prompt
from rlfuse.kernels.loss.policy import LOSS_TYPES
from rlfuse.rollout import Sample
from rlfuse.rollout.evaluate import score_samples
from rlfuse.run.config import ESTIMATORS
from rlfuse.train.grpo import GRPOStep, run_grpo
from rlfuse.train.loop import make_optimizer, reference_model


class _Stub:
    """A multi-turn sampler the trainer is built with (its episodes are made by the test)."""
    last_metrics: dict = {}

    def episodes(self, *a, **k):
        raise AssertionError("not called")

    def generate(self, *a, **k):
        raise AssertionError("not called")

    def sleep(self):
        pass

    def wake(self):
        pass


def _episodes(vocab: int, G: int = 4):
    """2 prompts x G episodes: model turns (mask 1) and observations (mask 0) of varied lengths."""
    g = torch.Generator().manual_seed(0)
    prompts = [Prompt([3, 4, 5], "p0", {}, "t:0"), Prompt([6, 7], "p1", {}, "t:1")]
    samples = []
    for i in range(2 * G):
        mask = []
        for _ in range(1 + i % 3):
            model_n, obs_n = int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
            mask += [1.0] * model_n + [0.0] * obs_n
        mask += [1.0] * 3
        n = len(mask)
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        m = torch.tensor(mask)
        lps = -torch.rand(n, generator=g) * m  # 0 at observation tokens, as the driver writes them
        samples.append(Sample(i // G, ids, lps, False, "x", m, [1, 2] + prompts[i // G].ids))
    return prompts, samples


def _grads(trainer, prompts, samples, rewards):
    adv = trainer._advantages(prompts, samples, rewards)
    trainer.model.zero_grad(set_to_none=True)
    trainer.update.accumulate_gradients(prompts, samples, adv, list(range(len(samples))))
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]), adv


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_observation_tokens_never_reach_the_loss(tmp_path, estimator, loss_type):
    kl = 0.05 if estimator.startswith("reinforce_pp") else 0.0
    cfg = tiny_cfg(tmp_path, "rollout.tools=[calculator]", f"grpo.advantage={estimator}",
                   f"grpo.loss_type={loss_type}", f"grpo.kl_coef={kl}")
    with one_thread():
        ses = tiny_session(cfg)
        model = ses.model
        trainer = GRPOStep(cfg, model, _Stub(), ses.rewards(), None, make_optimizer(model, cfg),
                              ref_model=reference_model(model) if kl else None)
        with torch.no_grad():  # a reference that differs from the policy: the KL is not 0
            for p in trainer.ref_model.parameters() if kl else ():
                p.add_(0.01 * torch.randn_like(p))
        prompts, samples = _episodes(model.config.vocab_size)
        r = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.25])
        base, adv = _grads(trainer, prompts, samples, r)
        for s in samples:  # garbage rollout log-probs at the observation positions
            s.logprobs = torch.where(s.loss_mask > 0, s.logprobs, torch.full_like(s.logprobs, 7.0))
        again, adv2 = _grads(trainer, prompts, samples, r)
        assert torch.equal(base, again) and all(torch.equal(a, b) for a, b in zip(adv, adv2))
        for s in samples:  # the mask is what protects them
            s.loss_mask = None
        unmasked, _ = _grads(trainer, prompts, samples, r)
        assert not torch.equal(base, unmasked)


ENV = '''
import random
from rlfuse.rollout import Step

class Echo:
    """Answers every turn with a short observation; ends after 3 turns; reward 1 if the last
    turn has an even number of tokens."""
    def __init__(self, turns=3):
        self.turns = turns

    def reset(self, row, *, seed):
        self.n = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn):
        self.n += 1
        self.last = len(turn.token_ids)
        return Step(messages=[{"role": "tool", "content": str(self.n * 7)}], done=self.n >= self.turns)

    def reward(self):
        return float(self.last % 2 == 0)
'''


def test_grpo_with_an_environment_is_exact_across_turns(tmp_path):
    (tmp_path / "echo_env.py").write_text(ENV)
    cfg = tiny_cfg(tmp_path / "run", f"rollout.env={tmp_path / 'echo_env.py'}:Echo", "rollout.env_kwargs={turns: 3}",
                   "rollout.max_turn_tokens=4", "rollout.max_total_tokens=40", "engine.numerics=exact",
                   "grpo.check_every=1", "grpo.steps=2", "model.kernel_backend=auto",
                   "grpo.eval_every=0")
    with one_thread():
        res = run_grpo(cfg)
    for h in res["history"]:
        assert float(h["rollout/turns_mean"]) == 3.0 and float(h["rollout/obs_tokens_per_episode"]) > 0
        assert float(h["mismatch/full_max_abs"]) == 0.0 and float(h["mismatch/max_abs"]) == 0.0
        assert "reward/env" in h
    assert res["evals"][-1]["num_problems"] == 20


def test_env_reward_adds_to_the_reward_functions():
    from rlfuse.rollout import RewardSet
    from rlfuse.run.config import RewardSpec
    prompts = [Prompt([1], "2+2=", {"answer": "4"}, "t:0")]
    def mk(text, env):
        return Sample(0, [1], torch.zeros(1), False, text, None, None, env)
    total, per = score_samples(prompts, [mk("4", 0.5), mk("5", None)], RewardSet([RewardSpec(name="arithmetic")]), 2)
    assert total == [1.5, 0.0] and per["arithmetic"] == [1.0, 0.0] and per["env"][0] == 0.5


def test_cli_grpo_and_eval_with_tools(tmp_path):
    """A recipe with rollout.tools: `rlfuse grpo` trains on episodes, and `rlfuse eval` of its
    final folder (tokenizer with the chat template saved beside the weights) plays episodes."""
    import json

    from train_setup import tiny_recipe

    from rlfuse.cli import main
    recipe = tiny_recipe(tmp_path / "r.yaml", rollout={"tools": ["calculator"], "max_turns": 2, "max_turn_tokens": 4,
                                                         "max_total_tokens": 30})
    run = tmp_path / "run"
    with one_thread():
        assert main(["grpo", str(recipe), "--run-dir", str(run)]) == 0
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert any("rollout/turns_mean" in r for r in rows)
        assert main(["eval", str(recipe), "--run-dir", str(run), "--checkpoint", str(run / "final")]) == 0
    assert json.loads((run / "eval.json").read_text())["num_problems"] == 10



def test_an_environment_reward_needs_no_reward_function(tmp_path):
    """Before: an env defining reward() still needed a reward function ("rewards: the list is
    empty"). Its reward alone is the total now."""
    from rlfuse.rollout import RewardSet
    prompts = [Prompt([1], "2+2=", {"answer": "4"}, "t:0")]
    def mk(text, env):
        return Sample(0, [1], torch.zeros(1), False, text, None, None, env)
    total, per = score_samples(prompts, [mk("4", 0.5), mk("5", None)], RewardSet([], allow_empty=True), 2)
    assert total == [0.5, 0.0] and list(per) == ["env"]
    with pytest.raises(ValueError, match="rewards: the list is empty"):
        RewardSet([])  # without an environment, a run still needs a reward function
    (tmp_path / "echo_env.py").write_text(ENV)
    cfg = tiny_cfg(tmp_path / "run", f"rollout.env={tmp_path / 'echo_env.py'}:Echo", "rollout.env_kwargs={turns: 2}",
                   "rollout.max_turn_tokens=3", "rewards=[]", "grpo.steps=1", "grpo.eval_every=0",
                   "data.eval_size=4")
    with one_thread():
        res = run_grpo(cfg)
    assert res["steps"] == 1 and "reward/env" in res["history"][0]


def test_trl_style_reward_functions_get_chat_rows_as_messages():
    """Issue 37: with `messages` rows a TRL-style reward (completions[0][0]["content"]) failed:
    it got the rendered template and plain strings. Built-in rewards keep the text."""
    from rlfuse.rollout import RewardSet
    from rlfuse.run.config import RewardSpec
    seen = {}

    def trl_style(prompts, completions, answer, **kw):
        seen["prompts"], seen["completions"] = prompts, completions
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]  # chat rows, or plain ones
        return [float(t.strip() == a) for t, a in zip(texts, answer)]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="},
            {"role": "assistant", "content": "4"}]
    prompts = [Prompt([1], "<rendered>", {"messages": msgs, "answer": "4"}, "t:0")]
    def mk(text):
        return Sample(0, [1], torch.zeros(1), False, text, None, None, None)
    rs = RewardSet([RewardSpec(name="python:trl_style"), RewardSpec(name="arithmetic")],
                   functions={"python:trl_style": trl_style})
    total, per = score_samples(prompts, [mk("4"), mk("5")], rs, 2)
    assert per["trl_style"] == [1.0, 0.0] and per["arithmetic"] == [1.0, 0.0] and total == [2.0, 0.0]
    assert seen["prompts"] == [msgs[:2], msgs[:2]]
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
    plain = [Prompt([1], "2+2=", {"answer": "4"}, "t:0")]  # plain rows: strings, as before
    score_samples(plain, [mk("4"), mk("5")], rs, 2)
    assert seen["prompts"] == ["2+2=", "2+2="] and seen["completions"] == ["4", "5"]
