"""Multi-turn at full speed (issue 38, item 4): a turn's tool calls run together instead of
queueing behind rollout.env_workers threads while the decode batch thins.

* auto workers (env_workers 0): every episode's environment step runs at once; a fixed
  count caps them (the bookkeeping of how many are in flight);
* the trajectories do not depend on the worker count, nor on a KV pool too small for all
  episodes (preemption, no deadlock): in exact numerics identical ids and log-probs.
Run: python -m pytest -q tests/test_multi_turn_speed.py
"""

import dataclasses
import threading
import time

from agent_setup import ScriptedEngine, chat_tokenizer
from engine_helpers import (
    one_thread,  # noqa: F401 (fixture)
    tiny_model,
)

from rlfuse.kernels import use_backend
from rlfuse.rollout import ChatRenderer, Step, run_episodes
from rlfuse.rollout.exactness import DEFAULT, PROBE_ROWS, play
from rlfuse.run.config import RolloutConfig


class _Slow:
    """Every step sleeps 0.15 s and counts the steps running at once; two turns."""
    lock = threading.Lock()
    now = peak = 0

    def reset(self, row, *, seed):
        self.n = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn):
        cls = type(self)
        with cls.lock:
            cls.now += 1
            cls.peak = max(cls.peak, cls.now)
        time.sleep(0.15)
        with cls.lock:
            cls.now -= 1
        self.n += 1
        return Step(messages=[{"role": "tool", "content": "ok"}], done=self.n >= 2)


def _peak(workers: int) -> tuple[int, dict]:
    tok = chat_tokenizer("qwen2")
    _Slow.now = _Slow.peak = 0
    eng = ScriptedEngine(tok, lambda ids, k: "thinking")
    eps, m = run_episodes(eng, ChatRenderer(tok), _Slow, [{"prompt": f"p{i}"} for i in range(4)],
                          cfg=RolloutConfig(max_turns=4, env_workers=workers), group_size=4)
    assert [e.turns for e in eps] == [2] * 16
    return _Slow.peak, m


def test_auto_env_workers_step_every_episode_at_once():
    peak, m = _peak(0)
    assert peak == 16 and m["rollout/env_workers"] == 16  # one thread per episode
    peak, m = _peak(4)
    assert peak == 4 and m["rollout/env_workers"] == 4


def test_trajectories_do_not_depend_on_workers_or_a_full_kv_pool():
    tok = chat_tokenizer("qwen2")
    model = tiny_model(vocab=tok.vocab_size, std=0.05, layers=1)
    runs = []
    with use_backend("torch"):
        for workers, engine in ((1, {}), (0, {"num_kv_blocks": 12})):
            cfg = dataclasses.replace(DEFAULT, env_workers=workers)
            eps, m, stats = play(model, tok, numerics="exact", engine=engine, seed=2, cfg=cfg, rows=PROBE_ROWS[:2],
                                  group_size=2)
            runs.append([(e.prompt_ids, e.token_ids, e.loss_mask, e.logprobs) for e in eps])
            if engine:
                assert stats["preemptions"] > 0  # the small pool held fewer episodes than were in flight
    assert runs[0] == runs[1]
