"""An example reward function for `examples/data/reverse_*.jsonl` (reverse a word).

rlfuse calls it with TRL's signature: the rendered prompts, the completions (text), and
every other column of the dataset as a keyword argument, one entry per completion (here
`answer`), plus `completion_ids` and `truncated`. It returns one float per completion
(None = "does not apply"). Use it in a recipe beside this file (examples/grpo.yaml) as
    rewards:
      - {name: my_reward.py:reverse_reward}    # relative to the recipe's folder
"""


def reverse_reward(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
    """1.0 for the exact reversal; otherwise half the share of letters in the right place
    (partial credit gives GRPO a signal before the model gets whole words right)."""
    scores = []
    for completion, target in zip(completions, answer):
        got = completion.strip()
        if got == target:
            scores.append(1.0)
        else:
            right = sum(a == b for a, b in zip(got, target))
            scores.append(0.5 * right / max(len(target), len(got), 1))
    return scores
