"""Model-written code run by the `python` tool must not escape (issue 37). Each escape found
at 9870a66 with the unisolated subprocess is tried here against the default bubblewrap
sandbox and must fail: reading the trainer's environment through /proc/<ppid>/environ or a
key file in its HOME, finding the run folder through /proc/<ppid>/cmdline and deleting
checkpoint weights, opening a TCP connection, leaving a `setsid` child that outlives the
call, SIGKILL-ing the trainer, and swapping its own stdout for a named pipe. Then: the tool
fails closed when isolation is unusable, `none` warns, and the SandboxFusion adapter
against a fake server on 127.0.0.1.
Run: python -m pytest -q tests/test_sandbox_escapes.py   (needs bwrap: apt-get install bubblewrap)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlfuse.rollout.agent import sandbox as sb
from rlfuse.rollout.agent.sandbox import RemoteSandbox, Sandbox
from rlfuse.rollout.agent.tools import ToolError, ToolTimeout, load_tools, python_tool

WHY = sb._probe("bwrap", False)
needs_bwrap = pytest.mark.skipif(WHY is not None, reason=f"bubblewrap is not usable here ({WHY}); .ci/run "
                                                         "installs it (apt-get install bubblewrap)")
BOX = Sandbox(timeout_s=5, memory_mb=512, cpu_s=5)


def _run(code: str) -> sb.SandboxResult:
    return BOX.run(code)


@needs_bwrap
def test_no_trainer_environment_no_home_and_no_trainer_proc(tmp_path, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("RLFUSE_TEST_SECRET", secret)
    key = tmp_path / "home" / ".ssh" / "id_key"
    key.parent.mkdir(parents=True)
    key.write_text(secret)
    code = f"""
import os
found = []
for pid in os.listdir('/proc'):
    if pid.isdigit():
        for part in ('environ', 'cmdline'):
            try:
                found.append(open(f'/proc/{{pid}}/{{part}}', 'rb').read().decode(errors='replace'))
            except OSError:
                pass
for path in ({str(key)!r}, os.path.expanduser('~/.ssh/id_key')):
    try:
        found.append(open(path).read())
    except OSError as e:
        print('no key:', type(e).__name__)
print('pids', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
print('env', dict(os.environ))
print('ppid', os.getppid())
print('\\n'.join(found))
"""
    r = _run(code)
    assert r.error is None, r.stderr
    assert secret not in r.stdout and r.stdout.count("no key:") == 2
    pids = json.loads(r.stdout.split("pids ", 1)[1].split("\n", 1)[0])
    assert os.getpid() not in pids and max(pids) < 100  # a PID namespace of its own
    assert "RLFUSE_TEST_SECRET" not in r.stdout


@needs_bwrap
def test_the_run_folder_and_its_checkpoints_are_out_of_reach(tmp_path):
    weights = tmp_path / "runs" / "my_grpo" / "checkpoints" / "step_000002" / "model" / "model.safetensors"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"weights")
    code = f"""
import os, shutil
try:
    print(open('/proc/' + str(os.getppid()) + '/cmdline', 'rb').read())
except OSError as e:
    print('cmdline:', e)
for attempt in (lambda: os.remove({str(weights)!r}), lambda: shutil.rmtree({str(tmp_path / 'runs')!r})):
    try:
        attempt()
        print('DELETED')
    except OSError as e:
        print('refused:', type(e).__name__)
"""
    r = _run(code)
    assert "DELETED" not in r.stdout and r.stdout.count("refused:") == 2, (r.stdout, r.stderr)
    assert weights.read_bytes() == b"weights"


@needs_bwrap
def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = f"""
import socket
for host in ('127.0.0.1', '1.1.1.1'):
    try:
        socket.create_connection((host, {port}), timeout=1).close()
        print('CONNECTED', host)
    except OSError as e:
        print('no connection:', type(e).__name__)
"""
    try:
        r = _run(code)
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert "CONNECTED" not in r.stdout and r.stdout.count("no connection:") == 2, (r.stdout, r.stderr)


def _processes_with(marker: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                    out.append(int(pid))
            except OSError:
                pass
    return out


@needs_bwrap
@pytest.mark.parametrize("ending", ["returns", "times-out"])
def test_a_setsid_child_does_not_outlive_the_call(ending):
    marker = f"rlfuse-escape-{uuid.uuid4().hex}"
    code = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print('started')
{'time.sleep(60)' if ending == 'times-out' else ''}
"""
    r = dataclasses.replace(BOX, timeout_s=2).run(code)
    assert "started" in r.stdout, r.stderr
    for _ in range(40):  # bounded: 4 s for the kernel to tear the PID namespace down
        if not _processes_with(marker):
            break
        time.sleep(0.1)
    left = _processes_with(marker)
    for pid in left:  # never leave one behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, "a setsid child outlived the sandboxed call"


_TRAINER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
sandbox = sys.modules["sandbox"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sandbox)  # the sandbox module alone (stdlib only): a quick stand-in trainer
r = sandbox.Sandbox(timeout_s=5, isolation=sys.argv[2]).run(sys.argv[3])
print("trainer survived;", r.stdout.strip().replace(chr(10), "; "), flush=True)
"""


@needs_bwrap
def test_cannot_kill_the_trainer():
    """Before: os.kill(os.getppid(), SIGKILL) ended the run (exit -9). A stand-in trainer
    process runs the call; the code also tries another host process by its pid."""
    victim = subprocess.Popen(["sleep", "30"])
    code = f"""
import os, signal
for pid in (os.getppid(), {victim.pid}):
    try:
        os.kill(pid, signal.SIGKILL)
        print('sent', pid)
    except OSError as e:
        print('refused', pid, type(e).__name__)
"""
    try:
        r = subprocess.run([sys.executable, "-c", _TRAINER, sb.__file__, "bwrap", code], capture_output=True,
                           text=True, timeout=60)
        time.sleep(0.2)
        assert r.returncode == 0 and "trainer survived" in r.stdout, (r.returncode, r.stdout, r.stderr)
        assert victim.poll() is None, "the sandboxed code killed a host process"
    finally:
        victim.kill()
        victim.wait()


@needs_bwrap
def test_swapping_stdout_for_a_named_pipe_does_not_block_the_call():
    """Before: the program replaced its stdout file with a FIFO; the parent's read blocked
    forever and the run never exited."""
    code = """
import os
print('hello', flush=True)
target = os.readlink('/proc/self/fd/1')
for path in (target, '.stdout', 'stdout'):
    try:
        if os.path.exists(path):
            os.unlink(path)
        os.mkfifo(path)
        print('made a fifo at', path, flush=True)
    except OSError as e:
        print('refused', path, type(e).__name__, flush=True)
"""
    done: list = []
    t = threading.Thread(target=lambda: done.append(_run(code)), daemon=True)
    t.start()
    t.join(20)
    assert done, "the sandboxed call blocked on its own output"
    assert "hello" in done[0].stdout


def test_fails_closed_when_bwrap_is_unusable(monkeypatch):
    monkeypatch.setattr(sb, "find_bwrap", lambda: None)
    sb._probe.cache_clear()
    try:
        with pytest.raises(ValueError) as e:
            python_tool()
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("rollout.sandbox: the python tool runs model-written code isolated")
        assert "no bwrap executable found" in msg and "apt-get install bubblewrap" in msg
        assert "rollout.sandbox: none" in msg
        with pytest.raises(ValueError, match="rollout.sandbox"):
            load_tools(["calculator", "python"])
        assert [t.name for t in load_tools(["python"], check=False)] == ["python"]  # schemas only
    finally:
        sb._probe.cache_clear()


def test_opting_out_warns_every_time(caplog):
    with caplog.at_level(logging.WARNING, logger="rlfuse.rollout.agent.sandbox"):
        tool = python_tool(sandbox="none", timeout_s=5)
        python_tool(sandbox="none", timeout_s=5)
    assert len([r for r in caplog.records if "WITHOUT isolation" in r.getMessage()]) == 2
    assert tool.call({"code": "print(2 + 3)"}).strip() == "5"


def test_bad_sandbox_setting():
    with pytest.raises(ValueError, match="rollout.sandbox must be one of .* got 'docker'"):
        python_tool(sandbox="docker")


# ------------------------------------------------------------------ SandboxFusion, faked on 127.0.0.1
class _FakeSandboxFusion(BaseHTTPRequestHandler):
    """Answers POST /run_code as SandboxFusion does, from canned outcomes keyed by the code."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, body))
        code = body["code"]
        run = {"status": "Finished", "execution_time": 0.01, "return_code": 0, "stdout": "", "stderr": ""}
        status = "Success"
        if code == "print('ok')":
            run["stdout"] = "ok\n"
        elif "6 * 7" in code:
            run["stdout"] = "42\n"
        elif "sleep" in code:
            run, status = {**run, "status": "TimeLimitExceeded", "return_code": None}, "Failed"
        elif "undefined" in code:
            run = {**run, "return_code": 1, "stderr": "NameError: name 'undefined' is not defined"}
            status = "Failed"
        elif "big" in code:
            run["stdout"] = "x" * 100_000
        else:
            status, run = "SandboxError", None
        data = json.dumps({"status": status, "message": "" if run else "no executor", "compile_result": None,
                           "run_result": run, "files": {}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture()
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSandboxFusion)
    server.requests = []
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server
    server.shutdown()
    server.server_close()


def test_remote_sandbox_behind_the_same_tool_interface(fake_server):
    url = f"http://127.0.0.1:{fake_server.server_address[1]}"
    tool = python_tool(sandbox=url, timeout_s=3)  # checks the server at once (a test program)
    assert tool.call({"code": "print(6 * 7)"}) == "42\n"
    path, body = fake_server.requests[-1]
    assert path == "/run_code" and body["language"] == "python" and body["run_timeout"] == 3
    with pytest.raises(ToolTimeout):
        tool.call({"code": "import time; time.sleep(9)"})
    with pytest.raises(ToolError, match="(?s)exited with status 1.*NameError"):
        tool.call({"code": "print(undefined)"})
    with pytest.raises(ToolError, match="remote sandbox reported an error .*no executor"):
        tool.call({"code": "anything else"})
    r = RemoteSandbox(url=url + "/run_code", max_output_bytes=100).run("big")
    assert r.error is None and r.stdout.startswith("x" * 100) and "[output cut at 100 bytes]" in r.stdout


def test_remote_sandbox_fails_closed_when_unreachable():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(ValueError, match=r"rollout\.sandbox: the SandboxFusion server at "
                                         r"http://127\.0\.0\.1:\d+/run_code did not run a test program "
                                         r"\(the remote sandbox failed"):
        python_tool(sandbox=f"http://127.0.0.1:{port}", timeout_s=1)
