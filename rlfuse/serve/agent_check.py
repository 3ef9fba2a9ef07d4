"""Exact numerics through the OpenAI API: a scripted agent's recorded log-probs vs the trainer's.

`agent_setting` runs `ScriptedAgent` (an `openai.AsyncOpenAI` tool loop: each reply goes back
as the client returned it, followed by seeded tool results; every third episode edits its
history once, so its calls split into two samples) through `AgentSampler` on a fresh engine
with chunked prefill, a small KV pool (preemption) and prefix caching, then teacher-forces
every recorded segment through the trainer's forward and compares the log-probs of the
model's tokens. In exact numerics every one must be equal bitwise. `rlfuse check` runs it
as its "agent via OpenAI API" row.
Test: python -m pytest -q tests/test_agent_sessions.py
"""

from __future__ import annotations

import random

from rlfuse.consistency.check import SettingResult
from rlfuse.consistency.mismatch import logprob_mismatch
from rlfuse.data import Prompt
from rlfuse.engine import LLM, EngineConfig
from rlfuse.rollout import PROBE_ROWS, combined_engine
from rlfuse.rollout import compare_episode_logprobs as compare
from rlfuse.rollout.agent import Episode
from rlfuse.run.config import RolloutConfig
from rlfuse.serve.agents import MODEL_NAME, AgentSampler, EngineBase

_WORDS = ("408", "error: try again", "the tool says 17 and 25", "ok")
CHECK_ROLLOUT = RolloutConfig(max_turns=4, max_turn_tokens=24, max_total_tokens=150, agent="scripted")


class ScriptedAgent:
    """2-4 calls per episode, drawn from the row's prompt; each call's reply is sent back as
    the OpenAI client parsed it, then 1-2 tool messages. `edit`: episodes whose index is a
    multiple of 3 rewrite their first reply before the last call (a split)."""

    def __init__(self, edit: bool = True):
        self.edit, self.count = edit, 0

    async def __call__(self, client, row):
        k, self.count = self.count, self.count + 1
        rng = random.Random(f"{row['prompt']}:{k}")
        messages = [{"role": "user", "content": row["prompt"]}]
        turns = rng.randint(2, 4)
        for t in range(turns):
            if self.edit and k % 3 == 0 and t == turns - 1:
                messages[1] = {"role": "assistant", "content": "(edited)"}
            r = await client.chat.completions.create(model=MODEL_NAME, messages=messages)
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            for _ in range(rng.randint(1, 2)):
                messages.append({"role": "tool", "content": " ".join(rng.choice(_WORDS)
                                                                    for _ in range(rng.randint(1, 3)))})
        return 0.0


def agent_setting(model, tokenizer, *, numerics: str, engine: dict | None = None, temperature: float = 1.0,
                  seed: int = 0, name: str = "agent via OpenAI API") -> SettingResult:
    """One `rlfuse check` row: the scripted agent's episodes (3 rows x 3), every segment compared."""
    engine = combined_engine(tokenizer, CHECK_ROLLOUT) if engine is None else engine
    llm = LLM(model, tokenizer, EngineConfig(**{"max_num_seqs": 8, "numerics": numerics, "seed": seed, **engine}))
    sampler = AgentSampler(EngineBase(llm), tokenizer, CHECK_ROLLOUT, ScriptedAgent())
    rows = [Prompt(ids=[], text=r["prompt"], columns=dict(r), where="check") for r in PROBE_ROWS]
    sampler.episodes(rows, n=3, temperature=temperature, seed=seed)
    llm.sleep()
    segs = [s for ses in sampler.last_sessions for s in ses.segments()]
    eps = [Episode(i, 0, s.prompt_ids, s.token_ids, s.loss_mask, s.logprobs) for i, s in enumerate(segs)]
    t, r, first = compare(model, eps, numerics=numerics, temperature=temperature)
    mm = {k: float(v) for k, v in logprob_mismatch(t, r).items()}
    n = t.numel()
    stats = {k: float(v) for k, v in sampler.last_metrics.items()}
    return SettingResult(name=name, tokens=n, bitwise_frac=float((t == r).sum()) / max(n, 1),
                         max_abs=mm["max_abs"], mean_abs=mm["mean_abs"], kl_k3=mm["kl_k3"], first_diff=first,
                         engine_stats=stats, sequences=[(e.prompt_ids, e.token_ids) for e in eps])
