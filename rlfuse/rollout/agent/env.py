"""Environments: what answers a model turn in a multi-turn rollout.

    class Guess:                                   # any object with these methods
        def reset(self, row, *, seed):             # -> the first messages of the episode
            self.secret = random.Random(seed).randint(1, 100)
            return [{"role": "user", "content": "Guess my number (1-100)."}]
        def step(self, turn):                      # may be `async def`
            g = int(turn.text.strip() or 0)
            if g == self.secret:
                return Step(done=True, reward=1.0)
            return Step(messages=[{"role": "user", "content": "higher" if g < self.secret else "lower"}])
        def reward(self):                          # optional: the episode's reward
            ...

`Step.messages` are rendered through the chat template and appended as ids (see
rlfuse.rollout.agent.chat); `Step.reward` is an optional per-turn reward; `done` ends the episode.
`ToolEnv` is the environment of `rollout.tools`: it runs the turn's tool calls (concurrently,
each under `timeout_s`) and answers with one 'tool' message per call; a turn without a tool
call ends the episode (its text is the answer the rewards score).
Test: python -m pytest -q tests/test_rollout_multi_turn.py
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import inspect
import threading
from typing import Protocol, runtime_checkable

from rlfuse.rollout.agent.tool_calls import ToolCall
from rlfuse.rollout.agent.tools import Tool, ToolError, ToolTimeout


@dataclasses.dataclass(slots=True)
class Turn:
    """One model turn, as the environment sees it."""
    index: int
    """0 for the first turn of the episode."""
    text: str
    """The turn's text (decoded for the environment; training uses `token_ids`)."""
    token_ids: list[int]
    finish_reason: str
    """"stop" (the model ended its turn) or "length" (the turn's token limit)."""
    tool_calls: list[ToolCall]
    parse_errors: list[str]
    """Malformed tool calls, one message each."""


@dataclasses.dataclass(slots=True)
class Step:
    messages: list[dict] = dataclasses.field(default_factory=list)
    """Observation messages ({"role": "tool" | "user", "content": ...}) appended to the conversation."""
    done: bool = False
    reward: float | None = None
    """Optional reward of this turn."""
    info: dict = dataclasses.field(default_factory=dict)
    """Numbers the rollout sums into metrics (tool_calls, tool_errors, tool_timeouts, ...)."""


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict, *, seed: int) -> list[dict]: ...

    def step(self, turn: Turn) -> Step: ...


def call(fn, *args, **kwargs):
    """Call a sync or async method (an async one runs on a fresh event loop in this thread)."""
    r = fn(*args, **kwargs)
    return asyncio.run(r) if inspect.isawaitable(r) else r


class UserCodeExit(RuntimeError):
    """User code (a tool, an environment) raised SystemExit or KeyboardInterrupt on a
    worker thread: that is the code's failure, not a request to end the run."""


class DaemonPool:
    """Runs user calls (tool functions, env.step) on daemon threads, at most `max_workers`
    at once, each returning a Future. Not a ThreadPoolExecutor: Python joins its worker
    threads at exit, so one hung tool kept the process alive after the run had finished
    ("grpo done", then no exit). A daemon thread is left behind at exit instead. A caller
    that stops waiting on a call (its time limit) calls `abandon(fut)`: the call's slot is
    freed for the next one, and the hung thread, if it ever returns, frees nothing."""

    def __init__(self, max_workers: int, name: str):
        self._slots = threading.Semaphore(max_workers)
        self._name, self._n = name, 0
        self._lock = threading.Lock()
        self._held: set[cf.Future] = set()     # calls whose thread holds a slot
        self._waiting: set[cf.Future] = set()  # calls waiting for a slot

    def submit(self, fn, *args, **kwargs) -> cf.Future:
        fut: cf.Future = cf.Future()
        self._n += 1
        with self._lock:
            self._waiting.add(fut)
        threading.Thread(target=self._run, args=(fut, fn, args, kwargs), name=f"{self._name}-{self._n}",
                         daemon=True).start()
        return fut

    def _run(self, fut: cf.Future, fn, args, kwargs) -> None:
        self._slots.acquire()
        with self._lock:
            self._waiting.discard(fut)
            self._held.add(fut)
        try:
            if not fut.set_running_or_notify_cancel():  # cancelled while it waited for a slot
                return
            try:
                fut.set_result(fn(*args, **kwargs))
            except Exception as e:  # noqa: BLE001 -- the caller reads it from the future
                fut.set_exception(e)
            except BaseException as e:  # noqa: BLE001 -- SystemExit / KeyboardInterrupt raised by the user's code
                fut.set_exception(UserCodeExit(f"{type(e).__name__}({e}) raised inside the call"))
        finally:
            self._release(fut)

    def _release(self, fut: cf.Future) -> None:
        with self._lock:
            if fut not in self._held:
                return
            self._held.discard(fut)
        self._slots.release()

    def abandon(self, fut: cf.Future) -> None:
        """Stop waiting for `fut`: cancel it if it has not started, else free its slot."""
        if not fut.cancel():
            self._release(fut)

    def shutdown(self) -> None:
        """Cancel the calls not started; running ones are left to their daemon threads
        (nothing is joined)."""
        with self._lock:
            waiting, self._waiting = self._waiting, set()
        for f in waiting:
            f.cancel()


class ToolRunner:
    """Runs tool calls on a thread pool, each under a wall-clock limit; shared by the
    episodes of a rollout. A plain function past its limit cannot be killed: its thread is
    left to finish on its daemon thread (it never delays the process's exit) and the call is
    reported as a timeout (the `python` tool kills its process)."""

    def __init__(self, tools: list[Tool], *, timeout_s: float = 10.0, workers: int = 8):
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.pool = DaemonPool(workers, "rlfuse-tool")

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    def run(self, calls: list[ToolCall]) -> list[tuple[str, str | None]]:
        """(text, error kind: None | "error" | "timeout") per call, in order."""
        futs = []
        for c in calls:
            tool = self.tools.get(c.name)
            futs.append(None if tool is None else self.pool.submit(tool.call, c.arguments))
        out = []
        for c, f in zip(calls, futs):
            if f is None:
                out.append((f"error: no tool named {c.name!r} (tools: {sorted(self.tools)})", "error"))
                continue
            try:
                out.append((f.result(timeout=self.timeout_s), None))
            except cf.TimeoutError:
                self.pool.abandon(f)
                out.append((f"error: {c.name} timed out after {self.timeout_s:g} s", "timeout"))
            except ToolTimeout as e:
                out.append((f"error: {e}", "timeout"))
            except ToolError as e:
                out.append((f"error: {e}", "error"))
            except Exception as e:  # noqa: BLE001 -- a tool object whose call() itself fails is still a tool error
                out.append((f"error: {c.name} raised {type(e).__name__}: {e}", "error"))
        return out

    def close(self) -> None:
        self.pool.shutdown()


class ToolEnv:
    """The environment of `rollout.tools`: the first messages are the row's (`messages` up
    to the first assistant one; or `prompt_template` filled from the row as one user
    message after an optional `system` prompt); each turn's tool calls
    are run and answered in 'tool' messages; a turn without tool calls ends the episode."""

    def __init__(self, runner: ToolRunner, *, system: str | None = None, prompt_template: str = "{prompt}"):
        self.runner, self.system, self.prompt_template = runner, system, prompt_template

    def reset(self, row: dict, *, seed: int) -> list[dict]:
        if isinstance(row.get("messages"), list):  # a chat row: the messages before its first answer
            msgs = row["messages"]
            k = next((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), len(msgs))
            return list(msgs[:k])
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": self.prompt_template.format_map(row)}]

    def step(self, turn: Turn) -> Step:
        if not turn.tool_calls and not turn.parse_errors:
            return Step(done=True)
        results = self.runner.run(turn.tool_calls)
        msgs = [{"role": "tool", "content": f"error: {e}"} for e in turn.parse_errors]
        msgs += [{"role": "tool", "name": c.name, "content": text} for c, (text, _) in zip(turn.tool_calls, results)]
        kinds = [k for _, k in results]
        info = {"tool_calls": len(turn.tool_calls) + len(turn.parse_errors),
                "tool_errors": kinds.count("error") + len(turn.parse_errors), "tool_timeouts": kinds.count("timeout")}
        return Step(messages=msgs, info=info)
