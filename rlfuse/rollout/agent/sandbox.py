"""A subprocess sandbox for the `python` tool: limits that keep a bad program from stalling a run.

`Sandbox.run(code)` writes `code` to main.py in a fresh scratch folder and runs it with this
interpreter (`python -I -u`: no user site, no PYTHON* variables, unbuffered) in its own
process group, with a minimal environment (PATH, HOME = TMPDIR = the scratch folder) and
stdin closed. Before the program runs, a launcher sets rlimits on it:
  RLIMIT_AS    memory_mb    -> MemoryError (or the kernel kills it)
  RLIMIT_CPU   cpu_s        -> SIGXCPU
  RLIMIT_FSIZE file_bytes   -> any file, stdout and stderr included, stops growing there
                               (an infinite print ends in "File too large")
  RLIMIT_CORE  0
and the parent enforces a wall-clock `timeout_s` (the whole process group is killed, so a
hang, a sleep or a child it spawned ends too). At most `max_output_bytes` of stdout come
back. Every outcome is a `SandboxResult`; nothing raises and nothing waits past the timeout.

NOT a security boundary. The program runs as this user, with this user's files, network and
processes in reach; it can read and write anything the trainer can, open sockets, and start
processes that leave its group (setsid). It isolates faults (crash, hang, memory blow-up,
endless output), not hostile code: run untrusted code in a container or VM.
Test: python -m pytest -q tests/test_rollout_sandbox.py
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_LAUNCHER = """
import resource, sys
mem, cpu, fsize = map(int, sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.argv = ["main.py"]
src = open("main.py", encoding="utf-8").read()
del mem, cpu, fsize, resource
exec(compile(src, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
"""


@dataclasses.dataclass(slots=True)
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool = False
    error: str | None = None
    """Why the run failed (None: exit status 0 within every limit)."""
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Sandbox:
    timeout_s: float = 10.0
    """Wall-clock limit; the process group is killed at it."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS)."""
    cpu_s: int = 10
    """CPU-time limit (RLIMIT_CPU)."""
    file_bytes: int = 1 << 20
    """Largest file the program may write, stdout and stderr included (RLIMIT_FSIZE)."""
    max_output_bytes: int = 8192
    """stdout bytes returned; more is cut with a note."""

    def run(self, code: str) -> SandboxResult:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="rlfuse-sandbox-") as scratch:
            d = Path(scratch)
            (d / "main.py").write_text(code, encoding="utf-8")
            env = {"PATH": os.defpath, "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
                   "PYTHONHASHSEED": "0"}
            argv = [sys.executable, "-I", "-u", "-c", _LAUNCHER, str(self.memory_mb << 20), str(self.cpu_s),
                    str(self.file_bytes)]
            with open(d / ".stdout", "wb") as out, open(d / ".stderr", "wb") as err:
                proc = subprocess.Popen(argv, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=err, start_new_session=True)
                timed_out = False
                try:
                    proc.wait(timeout=self.timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    try:  # the group: children it started, and the program itself on a timeout
                        os.killpg(proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    proc.wait()
            stdout, cut = _read(d / ".stdout", self.max_output_bytes)
            stderr, _ = _read(d / ".stderr", 4096, tail=True)
            full = (d / ".stdout").stat().st_size >= self.file_bytes
        rc = proc.returncode
        error = None
        if timed_out:
            error = f"timed out after {self.timeout_s:g} s"
        elif full:
            error = f"the output reached the limit of {self.file_bytes} bytes"
        elif rc is not None and rc < 0:
            sig = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
            error = f"killed by {sig}" + (" (CPU-time limit)" if sig == "SIGXCPU" else "")
        elif rc:
            error = f"exited with status {rc}"
        if cut:
            stdout += f"\n[output cut at {self.max_output_bytes} bytes]"
        return SandboxResult(stdout, stderr, rc, timed_out, error, time.perf_counter() - t0)


def _read(path: Path, limit: int, tail: bool = False) -> tuple[str, bool]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        if tail and size > limit:
            f.seek(size - limit)
        data = f.read(limit)
    return data.decode("utf-8", errors="replace"), size > limit
