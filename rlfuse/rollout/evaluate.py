"""Held-out evaluation: greedy completions of the eval prompts, scored by the reward set.

accuracy = mean of the correctness reward (math_accuracy / arithmetic / countdown, the
first one in the list) -- 1 per solved problem; reward = mean weighted total.
Greedy (temperature 0) so the number is a property of the weights, not of a seed. With a
multi-turn sampler (rollout.tools / rollout.env) each problem is a greedy episode and the
final turn is scored. `temperature` > 0 samples instead (seed 0): what a rollout at that
temperature would score (the agent demo's warm-up checks it before GRPO); `samples` > 1
draws that many per problem and averages them (a tighter estimate of the expected reward,
the quantity GRPO maximizes).
"""

from __future__ import annotations

import math

from rlfuse.data import Prompt
from rlfuse.rollout.rewards import RewardSet
from rlfuse.rollout.sampler import Sampler, media_kwargs


def _conversational(prompts: list[Prompt], samples) -> tuple[list, list] | None:
    """For chat rows (each holds `messages`): the prompt messages (up to the first assistant
    one) and each completion as [{"role": "assistant", "content": text}], as TRL gives
    conversational data to reward functions; None for plain-text rows."""
    rows = [prompts[s.prompt_index].columns for s in samples]
    if not rows or not all(isinstance(r.get("messages"), list) for r in rows):
        return None
    firsts = []
    for r in rows:
        msgs = r["messages"]
        k = next((i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "assistant"), len(msgs))
        firsts.append([dict(m) for m in msgs[:k]])
    return firsts, [[{"role": "assistant", "content": s.text}] for s in samples]


def score_samples(prompts: list[Prompt], samples, rewards: RewardSet, n: int):
    """(total, per-function) rewards of samples (prompt-major, n per prompt); an
    environment's episode reward (Sample.env_reward) is added as the function "env". Chat
    rows reach user reward functions as message lists (`_conversational`)."""
    p_text = [prompts[s.prompt_index].text for s in samples]
    cols: dict[str, list] = {}
    keys = [k for k in dict.fromkeys(k for p in prompts for k in p.columns) if k not in ("prompts", "completions")]
    for k in keys:
        cols[k] = [prompts[s.prompt_index].columns.get(k) for s in samples]
    cols["completion_ids"] = [s.token_ids for s in samples]
    cols["truncated"] = [s.truncated for s in samples]
    total, per = rewards.score(p_text, [s.text for s in samples], cols, chat=_conversational(prompts, samples))
    env = [getattr(s, "env_reward", None) for s in samples]
    if any(r is not None for r in env):
        per["env"] = [float("nan") if r is None else float(r) for r in env]
        total = [t + (0.0 if r is None else float(r)) for t, r in zip(total, env)]
    return total, per


def evaluate(sampler: Sampler, prompts: list[Prompt], rewards: RewardSet, *, max_new_tokens: int,
             batch_size: int = 256, temperature: float = 0.0, samples: int = 1) -> dict:
    if samples < 1 or (samples > 1 and temperature == 0.0):
        raise ValueError(f"evaluate: samples must be >= 1, and 1 when greedy (temperature 0); got samples={samples}, "
                         f"temperature={temperature}")
    totals, correct, lengths, trunc = [], [], [], []
    sampler.wake()
    multi_turn = hasattr(sampler, "episodes")
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        if multi_turn:  # episodes with the recipe's tools or environment, greedy unless told
            drawn = sampler.episodes(chunk, n=samples, temperature=temperature, seed=0)
        else:
            drawn = sampler.generate([p.ids for p in chunk], n=samples, temperature=temperature, top_p=1.0, top_k=0,
                                     max_tokens=max_new_tokens, seed=0, **media_kwargs(chunk))
        total, per = score_samples(chunk, drawn, rewards, samples)
        totals += total
        if rewards.correctness:
            correct += [0.0 if math.isnan(v) else v for v in per[rewards.correctness]]
        lengths += [len(s.token_ids) for s in drawn]
        trunc += [float(s.truncated) for s in drawn]
    n = max(len(totals), 1)  # every problem has the same number of samples: the mean over samples is over problems too
    out = {"reward": sum(totals) / n, "completion_len": sum(lengths) / n, "truncated_frac": sum(trunc) / n,
           "num_problems": float(len(totals) // samples)}
    if correct:
        out["accuracy"] = sum(correct) / n
    return out
