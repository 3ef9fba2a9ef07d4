"""benchmarks/bench_agent_calls.py (CPU per agent chat call): a two-session run records every
call token-exact and the profile split finds each nested part.
Run: python -m pytest -q tests/test_bench_agent_calls.py
"""

import cProfile
import importlib.util
import pstats
import string
from pathlib import Path

from rlfuse.data import Prompt
from rlfuse.rollout import char_chat_tokenizer
from rlfuse.run.config import RolloutConfig
from rlfuse.serve.agents import AgentSampler, EngineBase

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_agent_calls.py"


def test_two_sessions_are_recorded_and_every_part_is_found():
    spec = importlib.util.spec_from_file_location("bench_agent_calls", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tok = char_chat_tokenizer(string.printable)
    cfg = RolloutConfig(max_turns=3, max_turn_tokens=len(bench.REPLY), max_total_tokens=4096, agent="x")
    sampler = AgentSampler(EngineBase(bench.ScriptedLLM(tok)), tok, cfg, bench.ToolLoop(3))
    prompts = [Prompt(ids=[], text="p", columns={"prompt": f"Problem {i}"}, where="t") for i in range(2)]
    prof = cProfile.Profile()
    cpu, calls = bench.one_run(sampler, prompts, prof)  # asserts token-exact recording itself
    assert calls == 6 and cpu > 0
    reply = tok.encode(bench.REPLY, add_special_tokens=False)
    assert all(c.output_ids == reply for s in sampler.last_sessions for c in s.calls)
    parts = bench.spans(pstats.Stats(prof))
    total = parts["all (main thread)"]
    for part in {p for p, _ in bench.SPANS}:  # each nested part found, and inside the whole
        assert 0 < parts.get(part, 0.0) <= total * 1.01, (part, parts)
    assert parts["rlfuse handler"] < parts["app (FastAPI)"] < parts["client call"]
