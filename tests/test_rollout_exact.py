"""Exact numerics across turns: every model token's rollout log-prob == the trainer's, bitwise.

A tiny random model plays multi-turn episodes on the real engine (exact numerics): an
environment answers each turn with an observation of varying length after a varying delay,
and ends episodes at different turns, so the batch changes as episodes wait and end. Each
setting must exercise what it names (prefix-cache hits on continuation turns, observations
prefilled in chunks, preemptions), every model token's log-prob must equal the trainer's
teacher-forced log-prob over the whole trajectory (observations as context) bitwise, and
the trajectories' ids must be the same in every setting (preemption and caching lose nothing).
Run: python -m pytest -q tests/test_rollout_exact.py
"""

import dataclasses
import random
import time

import pytest
import torch
from agent_setup import chat_tokenizer

from engine_helpers import one_thread  # noqa: F401 (fixture)
from engine_helpers import tiny_model
from rlfuse.consistency.check import trainer_logprobs
from rlfuse.engine import LLM, EngineConfig
from rlfuse.kernels import use_backend
from rlfuse.kernels.backend import use_numerics
from rlfuse.rollout import ChatRenderer, MultiTurnConfig, Step, run_episodes

WORDS = ["408", "error: try again", "the tool says 17 and 25", "ok"]


class Echo:
    """Observations of 1-3 words after 0-20 ms; the episode ends after 2-4 turns (by seed)."""

    def reset(self, row, *, seed):
        self.rng, self.n = random.Random(seed), 0
        self.turns = self.rng.randint(2, 4)
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn):
        self.n += 1
        time.sleep(self.rng.random() * 0.02)
        text = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 3)))
        return Step(messages=[{"role": "tool", "content": text}], done=self.n >= self.turns)


SETTINGS = {
    "plain": dict(),
    "chunked prefill": dict(max_num_batched_tokens=8),
    "forced preemption": dict(num_kv_blocks=14),
    "prefix cache off": dict(enable_prefix_caching=False),
    "combined": dict(max_num_batched_tokens=8, num_kv_blocks=12, enforce_eager=True, look_ahead=False),
}


def _play(model, tok, engine_over, numerics="exact"):
    cfg = EngineConfig(**{"max_num_seqs": 8, "block_size": 16, "numerics": numerics, **engine_over})
    llm = LLM(model, tok, cfg)
    renderer = ChatRenderer(tok)
    rows = [{"prompt": "What is 12 * 34?"}, {"prompt": "Add 5 and 7."}, {"prompt": "hi"}]
    eps, m = run_episodes(llm, renderer, Echo, rows, group_size=2, seed=5, sampling=dict(temperature=1.0),
                          cfg=MultiTurnConfig(max_turns=4, max_turn_tokens=10, max_total_tokens=150))
    stats = dataclasses.asdict(llm.stats)
    llm.sleep()
    return eps, m, stats


def _compare(model, eps, numerics="exact"):
    """(model tokens, bitwise-equal ones) over all episodes."""
    with use_numerics(numerics):
        train = trainer_logprobs(model, [(e.prompt_ids, e.token_ids) for e in eps], 1.0, micro_batch_tokens=200)
    n = eq = 0
    for e, t in zip(eps, train):
        mask = torch.tensor(e.loss_mask, dtype=torch.bool)
        roll = e.logprobs_tensor()
        n += int(mask.sum())
        eq += int((t[mask] == roll[mask]).sum())
    return n, eq


def test_multi_turn_rollout_logprobs_are_the_trainers_bitwise():
    tok = chat_tokenizer("qwen2")
    model = tiny_model(vocab=tok.vocab_size, std=0.05)
    ids = None
    with use_backend("torch"):
        for name, over in SETTINGS.items():
            eps, m, stats = _play(model, tok, over)
            assert max(e.turns for e in eps) >= 3 and len({e.turns for e in eps}) > 1, name
            assert sum(e.info.get("obs_tokens", 0) for e in eps) > 0
            if over.get("enable_prefix_caching", True):
                # a small pool evicts some cached blocks of waiting episodes
                assert m["rollout/continuation_cached_frac"] > (0.05 if "num_kv_blocks" in over else 0.5), (name, m)
            else:
                assert m["rollout/continuation_cached_frac"] == 0
            if "num_kv_blocks" in over:
                assert stats["preemptions"] > 0, name
            if "max_num_batched_tokens" in over:
                # every observation is longer than a step's budget: it is prefilled in chunks
                gaps = [b[0] - a[1] for e in eps for a, b in zip(e.turn_spans, e.turn_spans[1:])]
                assert gaps and min(gaps) > over["max_num_batched_tokens"], name
            n, eq = _compare(model, eps)
            assert n > 100 and eq == n, (name, n, eq)
            got = [(e.prompt_ids, e.token_ids, e.loss_mask) for e in eps]
            assert ids is None or got == ids, name  # the same trajectories whatever the setting
            ids = got


def test_fast_numerics_differs_so_the_comparison_can_fail():
    tok = chat_tokenizer("qwen2")
    model = tiny_model(vocab=tok.vocab_size, std=0.05)
    with use_backend("torch"):
        eps, _, _ = _play(model, tok, {}, numerics="fast")
        n, eq = _compare(model, eps, numerics="fast")
    assert eq < n
