"""Exact numerics across turns: multi-turn rollout log-probs vs the trainer's, token by token.

`multi_turn_setting` plays episodes against `ScriptedToolEnv` (a tool that answers every turn
with a seeded observation after a seeded delay, and ends episodes after 2-4 turns, so the
batch changes as episodes wait and end) on a fresh engine, then teacher-forces every
trajectory through the trainer's forward (`rlfuse.consistency.check.trainer_logprobs`:
observations as context) and compares the log-probs of the model's tokens. In exact
numerics every one must be equal bitwise, with prefix-cache hits between turns,
observations prefilled in chunks and forced preemption. `rlfuse check` runs it as its
multi-turn row.
Test: python -m pytest -q tests/test_rollout_exact.py
"""

from __future__ import annotations

import dataclasses
import random
import time

import torch

from rlfuse.consistency.check import SettingResult, trainer_logprobs
from rlfuse.consistency.mismatch import logprob_mismatch
from rlfuse.engine import LLM, EngineConfig
from rlfuse.engine.config import logprob_temperature
from rlfuse.kernels.backend import use_numerics
from rlfuse.rollout.agent.chat import ChatRenderer
from rlfuse.rollout.agent.env import Step
from rlfuse.rollout.agent.multi_turn import Episode, run_episodes
from rlfuse.run.config import RolloutConfig

_WORDS = ("408", "error: try again", "the tool says 17 and 25", "ok")
PROBE_ROWS = ({"prompt": "What is 12 * 34?"}, {"prompt": "Add 5 and 7."}, {"prompt": "hi"})
DEFAULT = RolloutConfig(max_turns=4, max_turn_tokens=24, max_total_tokens=150)


class ScriptedToolEnv:
    """A scripted tool: observations of 1-3 phrases after 0-`delay_s` seconds; the episode
    ends after 2-4 turns; all drawn from the episode's seed."""

    def __init__(self, delay_s: float = 0.02):
        self.delay_s = delay_s

    def reset(self, row, *, seed):
        self.rng, self.n = random.Random(seed), 0
        self.turns = self.rng.randint(2, 4)
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn):
        self.n += 1
        time.sleep(self.rng.random() * self.delay_s)
        text = " ".join(self.rng.choice(_WORDS) for _ in range(self.rng.randint(1, 3)))
        return Step(messages=[{"role": "tool", "content": text}], done=self.n >= self.turns)


def play(model, tokenizer, *, numerics: str, engine: dict, rows=PROBE_ROWS, group_size: int = 3,
         cfg: RolloutConfig | None = None, temperature: float = 1.0, seed: int = 0):
    """(episodes, rollout metrics, engine counters) of the scripted-tool episodes on a fresh engine."""
    ecfg = EngineConfig(**{"max_num_seqs": 8, "numerics": numerics, "seed": seed, **engine})
    llm = LLM(model, tokenizer, ecfg)
    cfg = cfg or DEFAULT
    eps, m = run_episodes(llm, ChatRenderer(tokenizer), ScriptedToolEnv, list(rows), cfg=cfg,
                          group_size=group_size, seed=seed, sampling=dict(temperature=temperature))
    stats = dataclasses.asdict(llm.stats)
    llm.sleep()
    return eps, m, stats


def compare(model, episodes: list[Episode], *, numerics: str, temperature: float = 1.0,
            micro_batch_tokens: int = 1 << 30) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]:
    """(trainer, rollout) log-probs of every model token, concatenated, and the (episode,
    position in token_ids) of the first difference."""
    with use_numerics(numerics):
        train = trainer_logprobs(model, [(e.prompt_ids, e.token_ids) for e in episodes],
                                 logprob_temperature(temperature), micro_batch_tokens=micro_batch_tokens)
    ts, rs, first = [], [], None
    for i, (e, t) in enumerate(zip(episodes, train)):
        mask = torch.tensor(e.loss_mask, dtype=torch.bool)
        roll = e.logprobs_tensor()
        ts.append(t[mask])
        rs.append(roll[mask])
        diff = ((t != roll) & mask).nonzero()
        if first is None and diff.numel():
            first = (i, int(diff[0, 0]))
    return torch.cat(ts), torch.cat(rs), first


def combined_engine(tokenizer, cfg: RolloutConfig = DEFAULT, block_size: int = 16) -> dict:
    """Engine overrides that exercise everything at once: a per-step budget smaller than an
    observation (chunked prefill) and a KV pool that holds one longest episode and a bit
    (the 9 episodes contend: preemption), prefix caching on."""
    renderer = ChatRenderer(tokenizer)
    longest = max(len(renderer.start([{"role": "user", "content": r["prompt"]}])[1])
                  for r in PROBE_ROWS) + cfg.max_total_tokens + cfg.max_turn_tokens
    return dict(max_num_batched_tokens=8, num_kv_blocks=-(-longest // block_size) + 1, block_size=block_size,
                enable_prefix_caching=True)


def multi_turn_setting(model, tokenizer, *, numerics: str, engine: dict | None = None,
                       name: str = "multi-turn, scripted tool", temperature: float = 1.0, seed: int = 0,
                       micro_batch_tokens: int = 1 << 30) -> SettingResult:
    """One `rlfuse check` row: scripted-tool episodes under `engine` overrides (default:
    `combined_engine`), compared token by token."""
    engine = combined_engine(tokenizer) if engine is None else engine
    eps, m, stats = play(model, tokenizer, numerics=numerics, engine=engine, temperature=temperature, seed=seed)
    t, r, first = compare(model, eps, numerics=numerics, temperature=temperature,
                          micro_batch_tokens=micro_batch_tokens)
    mm = {k: float(v) for k, v in logprob_mismatch(t, r).items()}
    n = t.numel()
    stats["continuation_cached_frac"] = m["rollout/continuation_cached_frac"]
    stats["turns_mean"] = m["rollout/turns_mean"]
    return SettingResult(name=name, tokens=n, bitwise_frac=float((t == r).sum()) / max(n, 1), max_abs=mm["max_abs"],
                         mean_abs=mm["mean_abs"], kl_k3=mm["kl_k3"], first_diff=first, engine_stats=stats,
                         sequences=[(e.prompt_ids, e.token_ids) for e in eps])
