"""User reward functions run in a worker process, so that a hung one can be stopped.

`WorkerReward(name, kwargs, timeout_s)` is a callable with a reward function's signature.
`start()` (RewardSet calls it when it is built; else the first call) starts a worker
(`python rlfuse/utils/user_code.py`: a fresh interpreter that imports no torch, safe beside
CUDA and the engine's threads) that imports the user's `module:function` /
`file.py:function` and checks the recipe's kwargs against it, within `timeout_s` (a module
that hangs as it imports is stopped like a hung call); each call sends (prompts, completions,
columns) over a pipe and waits at most `timeout_s` seconds for the list of rewards. An
exception in the function comes back and is raised here (the same type and message;
rlfuse.rollout.rewards then finds the failing example). A call that does not answer in
time kills the worker (SIGKILL: a function stuck in C code or sleep() is stopped too) and
raises `RewardTimeout`; the next call starts a fresh worker.
Cost (the reward_timeout_s field says it too): one Python process per user reward
function, started on its first call (Python's start plus the user module's imports, a
fraction of a second for a plain module); per call, pickling the batch's prompts,
completions and columns both ways (milliseconds for thousands of completions); a
timed-out call costs its timeout plus a restart. The user's module is imported in the
worker only (its import errors and kwargs errors come back as one ValueError at start).
Built-in and model rewards run in the trainer's process (they cannot hang on user code,
and a reward model holds GPU weights).
Test: python -m pytest -q tests/test_bad_inputs.py -k "hung or worker"
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys

from rlfuse.utils import user_code
from rlfuse.utils.user_code import rebuild_exception, receive, send


class RewardTimeout(Exception):
    """A reward call that did not return within reward_timeout_s (its worker was killed)."""


class RewardImportError(ValueError):
    """The worker could not import the user's reward function (its message says why)."""


class WorkerReward:
    """A user reward function `name` (with its kwargs bound) called in a worker process
    with a per-call timeout (module docstring)."""

    def __init__(self, name: str, kwargs: dict, timeout_s: float):
        self.name, self.kwargs, self.timeout_s = name, dict(kwargs), timeout_s
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the worker and wait until it has imported the function (ValueError when it cannot)."""
        # the worker imports what this process can: its module search path, not only the
        # installed packages (a reward file importing a helper beside it, a package on a
        # path added at run time); the rest of the environment passes through unchanged
        path = os.pathsep.join(dict.fromkeys(os.path.abspath(p or os.curdir) for p in sys.path))
        # by path, not -m: importing the rlfuse package would import torch (seconds)
        self._proc = subprocess.Popen([sys.executable, user_code.__file__], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": path})
        send(self._proc.stdin, (self.name, self.kwargs, "reward"))
        kind, msg = self._answer(self.timeout_s, "importing it")
        if kind == "import-error":
            self.close()
            raise RewardImportError(msg)

    def _answer(self, timeout: float, doing: str):
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:
            self.close()
            raise RewardTimeout(f"timed out after {timeout:g} s {doing} (reward_timeout_s); its worker process "
                                f"was stopped")
        try:
            return receive(self._proc.stdout)
        except EOFError:
            code = self._proc.wait()
            self.close()
            raise RuntimeError(f"its worker process died while {doing} (exit status {code})") from None

    def __call__(self, prompts, completions, **columns):
        if self._proc is None:
            self.start()
        try:
            send(self._proc.stdin, ((list(prompts), list(completions)), columns))
        except BrokenPipeError:
            self.close()
            raise RuntimeError("its worker process had exited") from None
        kind, value = self._answer(self.timeout_s, "scoring")
        if kind == "raise":
            raise rebuild_exception(value)
        return value

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout):
                with contextlib.suppress(OSError):  # a pipe the dead worker broke
                    f.close()
        self._proc = None

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing left to report to
            self.close()
