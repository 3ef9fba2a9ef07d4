"""benchmarks/bench_agent.py (issue 35's agent-vs-environment benchmark): its token accounting
(fast), its CPU smoke run (`--small`, slow: ~20 s on 2 cores) and a reduced run on a GPU
(the Qwen3-0.6B shape with CUDA graphs, a few sessions: correctness, not the timing).
Run: python -m pytest -q tests/test_bench_agent.py; python -m pytest -m slow tests/test_bench_agent.py;
     python -m pytest -m gpu tests/test_bench_agent.py
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlfuse.rollout.agent.recording import AgentSession, Call, Segment

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_agent.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_agent", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _call(prompt, out, lps):
    return Call([], prompt, out, lps, "length", "", "", [], None, None)


class _Edited(AgentSession):
    """A session whose samples carry one trained id that the model did not sample."""

    def segments(self):
        segs = super().segments()
        seg = segs[0]
        i = seg.loss_mask.index(1)
        return [Segment(seg.prompt_ids, seg.token_ids[:i] + [99] + seg.token_ids[i + 1:], seg.loss_mask,
                        seg.logprobs, seg.calls), *segs[1:]]


def test_trained_vs_sampled_finds_every_sampled_run_and_misses_an_edited_one():
    bench = _bench()
    for cls, found in ((AgentSession, 5), (_Edited, 3)):
        ses = cls()
        ses.record(_call([1, 2], [3, 4], [-.1, -.2]))
        ses.record(_call([1, 2, 3, 4, 9], [5], [-.3]))     # extends: merged
        ses.record(_call([1, 2, 7], [8, 6], [-.4, -.5]))   # edited history: a second sample
        assert bench.trained_vs_sampled([ses]) == (5, found)


def _run(out: Path, *args: str) -> dict:
    env = dict(os.environ, OUT=str(out), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "bench_agent.md").read_text().splitlines()[-1] in proc.stdout  # the table is printed last
    return json.loads((out / "bench_agent.json").read_text())


def _check(result: dict, numerics: list[str], switch_ms: tuple[float, ...] = ()) -> None:
    rows = result["rows"]
    for n in numerics:
        env = [r for r in rows if r["numerics"] == n and r["path"] == "env"]
        agents = {(r["template"], r["observations"], r["gil_switch_ms"]): r for r in rows
                  if r["numerics"] == n and r["path"] == "agent"}
        default = 1000 * sys.getswitchinterval()
        assert len(env) == 1 and set(agents) == {("plain", "tool", default), ("think", "tool", default),
                                                 ("think", "user", default),
                                                 *(("plain", "tool", ms) for ms in switch_ms)}, rows
        agents = {k[:2] if k[2] == default else k: r for k, r in agents.items()}
        env = env[0]
        assert env["tokens_per_s"] > 0 and env["turns_mean"] == result["turns"]
        for key, r in agents.items():
            assert r["tokens_per_s"] > 0 and r["failed_frac"] == 0, r
            assert r["model_tokens"] == env["model_tokens"], (key, r, env)  # the same episodes' model tokens
            assert r["retokenized_trained_tokens"] == 0 and r["trained_eq_sampled_frac"] == 1.0, r
            assert r["tokens_trained"] == r["tokens_sampled"] == r["model_tokens"], r
            assert r["calls_per_episode"] == result["turns"], r
        for key in (("plain", "tool"), ("think", "tool"), *(("plain", "tool", ms) for ms in switch_ms)):
            # append-only: one merged sample per episode
            assert agents[key]["split_samples"] == 0 and agents[key]["rerendered_context_tokens"] == 0
        split = agents[("think", "user")]  # the template strips earlier reasoning: every call its own sample
        assert split["split_samples"] == env["sessions"] * (result["turns"] - 1) and split["merged_frac"] == 0
        if n == "exact":
            assert agents[("plain", "tool")]["same_ids_as_env_frac"] == 1.0
            for r in (env, *agents.values()):
                assert r["mismatch_max_abs"] == 0.0 and r["bitwise_frac"] == 1.0 and r["compared_tokens"] > 0, r


@pytest.mark.slow
def test_small_run_records_both_paths_token_exact(tmp_path):
    result = _run(tmp_path, "--small", "--gil-switch-ms", "1")
    assert result["small"] and result["episodes"] == "4 prompts x 2"
    _check(result, ["fast", "exact"], (1.0,))


@pytest.mark.gpu
def test_gpu_run_at_the_qwen3_shape_is_token_exact_and_bitwise(tmp_path):
    """The real shape, bf16 and CUDA graphs, with the engine driven from the serve worker's
    thread; a few short sessions (the timing is the benchmark's, not this test's)."""
    result = _run(tmp_path, "--prompts", "4", "--group", "4", "--turn-tokens", "32", "--tool-ms", "5")
    _check(result, ["fast", "exact"])
