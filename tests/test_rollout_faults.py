"""Tool and environment faults stay inside their episode (issue 37): a hung tool or env.step
never keeps the process from exiting, a huge tool output is cut by bytes before it is
encoded, SystemExit / KeyboardInterrupt inside a tool are the tool's error, env.reset raising
or env.step returning a wrong type is one line naming the environment class, and a
non-finite environment reward is refused where it comes from. Scripted policy, no model.
Run: python -m pytest -q tests/test_rollout_faults.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from agent_setup import ScriptedEngine, chat_tokenizer

from rlfuse.rollout import ChatRenderer, Step, ToolEnv, ToolRunner, run_episodes
from rlfuse.rollout.agent.env import DaemonPool
from rlfuse.rollout.agent.multi_turn import truncate_content
from rlfuse.rollout.agent.tool_calls import ToolCall, format_tool_call
from rlfuse.rollout.agent.tools import Tool, ToolError
from rlfuse.run.config import RolloutConfig

REPO = Path(__file__).resolve().parents[1]


def _call(name: str, **args) -> str:
    return format_tool_call(ToolCall(name, args), "hermes")


def _rollout(tools, first_turn: str, cfg: RolloutConfig | None = None, timeout_s: float = 5.0):
    tok = chat_tokenizer("qwen2")
    runner = ToolRunner([Tool.from_function(f) for f in tools], timeout_s=timeout_s)
    renderer = ChatRenderer(tok, tools=runner.schemas())
    eng = ScriptedEngine(tok, lambda ids, k: first_turn if k == 0 else "done")
    try:
        return run_episodes(eng, renderer, lambda: ToolEnv(runner), [{"prompt": "go"}],
                            cfg=cfg or RolloutConfig(max_turns=3))
    finally:
        runner.close()


def test_hung_tool_and_env_step_never_keep_the_process_alive():
    """Before: "grpo done", then the process never exited (Python's shutdown joined the
    tool's ThreadPoolExecutor thread). The script's tool and env.step block forever."""
    script = textwrap.dedent("""
        import threading, time
        from agent_setup import ScriptedEngine, chat_tokenizer
        from rlfuse.rollout import ChatRenderer, Step, ToolEnv, ToolRunner, run_episodes
        from rlfuse.rollout.agent.tool_calls import ToolCall, format_tool_call
        from rlfuse.rollout.agent.tools import Tool
        from rlfuse.run.config import RolloutConfig

        def hang(x: int) -> str:
            '''Never returns.

            Args:
                x: ignored.
            '''
            threading.Event().wait()

        class HungEnv:
            def reset(self, row, *, seed):
                return [{"role": "user", "content": "hi"}]
            def step(self, turn):
                threading.Event().wait()

        tok = chat_tokenizer("qwen2")
        runner = ToolRunner([Tool.from_function(hang)], timeout_s=0.2)
        renderer = ChatRenderer(tok, tools=runner.schemas())
        call = format_tool_call(ToolCall("hang", {"x": 1}), "hermes")
        eng = ScriptedEngine(tok, lambda ids, k: call if k == 0 else "done")
        eps, m = run_episodes(eng, renderer, lambda: ToolEnv(runner), [{"prompt": "go"}], cfg=RolloutConfig())
        assert eps[0].info["tool_timeouts"] == 1, eps[0].info
        eps, m = run_episodes(eng, renderer, HungEnv, [{"prompt": "go"}], cfg=RolloutConfig(env_timeout_s=0.2))
        assert eps[0].stop == "env_timeout", eps[0].stop
        print("rollouts done", flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process did not exit after its rollouts: {e.stdout!r}")
    assert r.returncode == 0 and "rollouts done" in r.stdout, r.stderr[-2000:]
    assert time.monotonic() - t0 < 90


def test_daemon_pool_limits_concurrency_and_frees_an_abandoned_slot():
    pool = DaemonPool(1, "test")
    gate = threading.Event()
    first = pool.submit(gate.wait)
    second = pool.submit(lambda: "ran")
    time.sleep(0.1)
    assert not second.done()          # one slot, held by the blocked call
    pool.abandon(first)               # its caller gave up: the slot goes to the next call
    assert second.result(timeout=5) == "ran"
    third = pool.submit(gate.wait)
    fourth = pool.submit(lambda: "never")
    time.sleep(0.05)
    pool.shutdown()                   # the waiting call is cancelled, the running one left alone
    assert fourth.cancelled() and not third.done()
    gate.set()
    assert first.result(timeout=5) is True and third.result(timeout=5) is True


def big(n: int) -> str:
    """Return n characters.

    Args:
        n: how many.
    """
    return "é" * n


def test_a_huge_tool_output_is_cut_by_bytes_before_encoding():
    """Before: a 50 MB output was encoded whole (170 s) before being cut to max_obs_tokens."""
    tok = chat_tokenizer("qwen2")
    renderer = ChatRenderer(tok)
    calls = {"chars": 0}
    real = renderer.encode

    def counting(text):
        calls["chars"] = max(calls["chars"], len(text))
        return real(text)
    renderer.encode = counting
    text = "é" * 5_000_000 + "THE END"
    for side, keep in (("right", "é"), ("left", "THE END")):
        cut, was_cut = truncate_content(renderer, text, 16, side)
        assert was_cut and keep in cut and "[truncated]" in cut
        assert len(real(cut)) <= 32  # 16 tokens of content + the note
        assert calls["chars"] <= 16 * 64  # never more than max_tokens * 64 bytes were encoded
    # through a rollout: bounded time, one truncated observation
    t0 = time.monotonic()
    eps, _ = _rollout([big], _call("big", n=20_000_000), RolloutConfig(max_turns=2, max_obs_tokens=32))
    assert time.monotonic() - t0 < 10 and eps[0].info["obs_truncated"] == 1


def quit_tool(how: str) -> str:
    """Leave in a bad way.

    Args:
        how: exit, interrupt or error.
    """
    if how == "exit":
        sys.exit(0)
    if how == "interrupt":
        raise KeyboardInterrupt
    raise SystemExit("bye")


@pytest.mark.parametrize("how", ["exit", "interrupt", "error"])
def test_system_exit_and_keyboard_interrupt_in_a_tool_are_tool_errors(how):
    """Before: sys.exit(0) in a tool ended the run with status 0, KeyboardInterrupt with 130."""
    eps, m = _rollout([quit_tool], _call("quit_tool", how=how))
    assert eps[0].info["tool_errors"] == 1 and eps[0].stop == "done"
    assert m["rollout/tool_errors_per_episode"] == 1.0
    obs = chat_tokenizer("qwen2").decode(eps[0].token_ids)
    assert ("SystemExit" if how != "interrupt" else "KeyboardInterrupt") in obs


def test_keyboard_interrupt_on_the_main_thread_stays_the_users():
    tool = Tool.from_function(quit_tool)
    with pytest.raises(KeyboardInterrupt):
        tool.call({"how": "interrupt"})  # a Ctrl-C while a tool runs on the main thread
    with pytest.raises(ToolError, match="SystemExit"):
        tool.call({"how": "exit"})


def _env_rollout(env_cls, cfg: RolloutConfig | None = None):
    tok = chat_tokenizer("qwen2")
    eng = ScriptedEngine(tok, lambda ids, k: "answer")
    return run_episodes(eng, ChatRenderer(tok), env_cls, [{"prompt": "a"}, {"prompt": "b"}],
                        cfg=cfg or RolloutConfig(max_turns=2))


class _Base:
    def reset(self, row, *, seed):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn):
        return Step(done=True, reward=1.0)


class ResetRaises(_Base):
    def reset(self, row, *, seed):
        return [{"role": "user", "content": row["question"]}]


class ResetReturnsText(_Base):
    def reset(self, row, *, seed):
        return row["prompt"]


class ResetExits(_Base):
    def reset(self, row, *, seed):
        sys.exit(0)


class StepReturnsDict(_Base):
    def step(self, turn):
        return {"done": True}


class StepExits(_Base):
    def step(self, turn):
        sys.exit(3)


@pytest.mark.parametrize("env_cls,msg", [
    (ResetRaises, r"ResetRaises\.reset raised KeyError: 'question' \(row 0"),
    (ResetReturnsText, r"ResetReturnsText\.reset must return a list of message dicts .* got 'a' \(row 0\)"),
    (ResetExits, r"ResetExits\.reset raised SystemExit: 0 \(row 0"),
    (StepReturnsDict, r"StepReturnsDict\.step returned dict \{'done': True\} \(episode \d\); it must return "
                      r"rlfuse\.rollout\.Step"),
])
def test_env_reset_and_step_type_errors_are_one_line_naming_the_class(env_cls, msg):
    """Before: a raw KeyError / TypeError traceback."""
    with pytest.raises(ValueError, match=msg):
        _env_rollout(env_cls)


def test_system_exit_in_env_step_is_a_counted_failed_episode():
    eps, m = _env_rollout(StepExits)
    assert [e.stop for e in eps] == ["env_error"] * 2 and m["rollout/env_errors_per_episode"] == 1.0


class NanReward(_Base):
    def reward(self):
        return float("nan")


class InfStepReward(_Base):
    def step(self, turn):
        return Step(done=True, reward=float("-inf"))


class TextReward(_Base):
    def reward(self):
        return "1.0"


@pytest.mark.parametrize("env_cls,msg", [
    (NanReward, r"NanReward\.reward\(\) gave nan for episode \d \(row \d\): an environment reward must be a finite"),
    (InfStepReward, r"InfStepReward\.step\(\) -> Step\.reward gave -inf for episode \d"),
    (TextReward, r"TextReward\.reward\(\) gave '1\.0' for episode"),
])
def test_a_non_finite_env_reward_is_refused_at_the_source(env_cls, msg):
    """Before: NaN reached the loss; optimizer steps were skipped without naming the env."""
    with pytest.raises(ValueError, match=msg):
        _env_rollout(env_cls)


def test_finite_rewards_still_pass():
    class IntReward(_Base):
        def reward(self):
            return 1

    eps, _ = _env_rollout(IntReward)
    assert [e.env_reward for e in eps] == [1.0, 1.0]


def test_system_exit_in_env_reward_is_a_counted_env_error():
    class RewardExits(_Base):
        def reward(self):
            sys.exit(1)

    eps, m = _env_rollout(RewardExits)
    assert [e.env_reward for e in eps] == [None, None] and m["rollout/env_errors_per_episode"] == 1.0
