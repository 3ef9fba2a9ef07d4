"""rlfuse.rollout.evaluate with `samples` > 1: the mean over every draw of every problem, the
problem count unchanged, the draws requested as n per prompt; greedy with samples > 1 refused.
A scripted sampler stands in for the engine (the engine's seeded sampling is tested elsewhere)."""

import pytest
import torch

from rlfuse.data import Prompt
from rlfuse.rollout import RewardSet, Sample
from rlfuse.rollout.evaluate import evaluate
from rlfuse.run.config import RewardSpec


class ScriptedSampler:
    """Prompt i's k-th draw answers answers[i][k]; records each call's n and temperature."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def wake(self):
        pass

    def generate(self, prompt_ids, *, n, temperature, top_p, top_k, max_tokens, seed):
        self.calls.append((len(prompt_ids), n, temperature))
        return [Sample(i, [0], torch.zeros(1), False, self.answers[i][k]) for i in range(len(prompt_ids))
                for k in range(n)]


def _prompts(answers):
    return [Prompt(ids=[1, 2], text="q", columns={"answer": a}, where=f"row {i}") for i, a in enumerate(answers)]


def test_sampled_accuracy_averages_every_draw():
    # problem 0: 3 of 4 right, problem 1: 1 of 4, problem 2: 0 of 4 -> 4 / 12
    sampler = ScriptedSampler([["2", "2", "2", "5"], ["7", "1", "1", "1"], ["0", "0", "0", "0"]])
    rewards = RewardSet([RewardSpec(name="arithmetic")])
    out = evaluate(sampler, _prompts(["2", "7", "3"]), rewards, max_new_tokens=2, temperature=1.0, samples=4,
                   batch_size=2)
    assert out["accuracy"] == pytest.approx(4 / 12) and out["num_problems"] == 3.0
    assert sampler.calls == [(2, 4, 1.0), (1, 4, 1.0)]  # n draws per prompt, batch_size counts problems
    greedy = evaluate(ScriptedSampler([["2"], ["1"], ["3"]]), _prompts(["2", "7", "3"]), rewards, max_new_tokens=2)
    assert greedy["accuracy"] == pytest.approx(2 / 3) and greedy["num_problems"] == 3.0


@pytest.mark.parametrize("samples,temperature", [(2, 0.0), (0, 1.0)])
def test_evaluate_refuses_draws_that_cannot_differ(samples, temperature):
    with pytest.raises(ValueError, match="samples must be >= 1, and 1 when greedy"):
        evaluate(ScriptedSampler([["1"]]), _prompts(["1"]), RewardSet([RewardSpec(name="arithmetic")]),
                 max_new_tokens=2, temperature=temperature, samples=samples)
