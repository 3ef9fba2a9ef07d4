"""Stopping a run on SIGINT / SIGTERM at a step boundary, with a checkpoint.

`stop_on_signals()` (entered by the training commands of rlfuse.cli) installs handlers for
SIGINT (Ctrl-C) and SIGTERM (what SLURM and Kubernetes send before they kill a job):
  * the first signal only records itself (`requested()`) and says so on stderr; the run
    loop sees it at the next step boundary, writes a checkpoint of the steps done and
    raises `Interrupted`, which the command turns into the resume command and exit status
    128 + signal (130 for SIGINT, 143 for SIGTERM);
  * a second signal ends the process at once (os._exit, same exit status), without a
    checkpoint: the last complete one stays the resume point.
Under torchrun the loop takes the decision over all ranks (`stop_agreed`: one all_reduce MAX
of the signal number per step), so every rank stops after the same step, even when the
signal reached the ranks at different steps or only one of them.
Test: python -m pytest -q tests/test_bad_inputs.py -k signal
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from rlfuse.run.distributed import DistContext, max_across_ranks

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_requested: int | None = None  # the first signal received while stop_on_signals is active


class Interrupted(Exception):
    """A run stopped by a signal after `step` steps; `checkpoint` holds them (None: no step
    was done since the last checkpoint or the start)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"{signal.Signals(signum).name} received: stopped after step {step}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def requested() -> int | None:
    """The signal number of a stop request in this process, or None."""
    return _requested


def stop_agreed(dist: DistContext | None) -> int | None:
    """The stop request as every rank sees it: this process's, or under data parallelism
    the highest signal number over the ranks (a collective: every rank calls it at the
    same step)."""
    if dist is None:
        return _requested
    sig = max_across_ranks(dist, _requested or 0)
    return sig or None


def _handler(signum, frame) -> None:
    global _requested
    name = signal.Signals(signum).name
    if _requested is not None:
        os.write(2, f"\nrlfuse: second {name}: stopping now, without a checkpoint (the last complete "
                    f"checkpoint is kept)\n".encode())
        os._exit(128 + signum)
    _requested = signum
    sys.stderr.write(f"\nrlfuse: {name} received: stopping after the current step and writing a checkpoint "
                     f"(send it again to stop at once)\n")
    sys.stderr.flush()


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT and SIGTERM handled as in the module docstring while the block runs (the
    previous handlers are restored after it). Only from the main thread."""
    global _requested
    _requested = None
    old = {s: signal.signal(s, _handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _requested = None
