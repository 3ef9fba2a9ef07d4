"""The python tool's sandbox: every fault becomes a result, within the time limit, with
bubblewrap isolation (where it is usable here) and without it (`none`). What isolation
keeps the program from reaching: tests/test_sandbox_escapes.py.
Run: python -m pytest -q tests/test_rollout_sandbox.py
"""

import concurrent.futures as cf
import dataclasses
import os
import time

import pytest

from rlfuse.rollout.agent.sandbox import Sandbox, _probe
from rlfuse.rollout.agent.tools import ToolError, ToolTimeout, python_tool

BWRAP_USABLE = _probe("bwrap", False) is None
LIMITS = dict(timeout_s=1.5, memory_mb=256, cpu_s=20, file_bytes=1 << 16, max_output_bytes=200)
BOX = Sandbox(isolation="none", **LIMITS)


@pytest.fixture(params=["bwrap", "none"])
def box(request):
    if request.param == "bwrap" and not BWRAP_USABLE:
        pytest.skip(f"bubblewrap is not usable here ({_probe('bwrap', False)}); .ci/run installs it")
    return Sandbox(isolation=request.param, **LIMITS)


def test_runs_in_a_scratch_folder_with_a_clean_environment(box):
    r = box.run("import os\nprint(sorted(os.listdir('.')), os.environ.get('HOME') == os.getcwd())\n"
                "open('f.txt', 'w').write('x')")
    assert r.error is None and r.returncode == 0
    assert r.stdout.strip() == "['main.py'] True"  # stdout and stderr are kept outside its folder


@pytest.mark.parametrize("code,error", [
    ("raise SystemExit(3)", "exited with status 3"),
    ("1/0", "exited with status 1"),
    ("import time\ntime.sleep(60)", "timed out"),
    ("while True: print('spam' * 100)", "output reached the limit"),
    ("x = bytearray(1 << 30)", "exited with status 1"),             # MemoryError under RLIMIT_AS
])
def test_faults_become_results_within_the_limits(box, code, error):
    t0 = time.perf_counter()
    r = box.run(code)
    assert error in r.error, (r.error, r.stderr)
    assert time.perf_counter() - t0 < box.timeout_s + 2
    if "1/0" in code:
        assert "ZeroDivisionError" in r.stderr and 'File "main.py", line 1' in r.stderr


def test_a_timeout_kills_the_children_too():
    """Without isolation (the child's pid is a host pid here); isolated: test_sandbox_escapes."""
    r = BOX.run("import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(60)\nprint(pid)\ntime.sleep(60)")
    assert "timed out" in r.error
    child = int(r.stdout)
    time.sleep(0.3)
    stat = f"/proc/{child}/stat"
    # gone, or a zombie waiting for an init that does not reap (containers)
    assert not os.path.exists(stat) or open(stat).read().rsplit(")", 1)[1].split()[0] == "Z"


def test_cpu_limit_ends_a_busy_loop(box):
    r = dataclasses.replace(box, timeout_s=20, cpu_s=1).run("while True: pass")
    assert "CPU-time limit" in r.error and r.seconds < 10


def test_output_is_cut_and_the_tool_reports_errors(box):
    r = box.run("print('a' * 1000)")
    assert r.error is None and r.stdout.startswith("a" * 200) and "[output cut at 200 bytes]" in r.stdout
    tool = python_tool(timeout_s=1.0, cpu_s=2, sandbox=box.isolation)
    assert tool.call({"code": "print(6 * 7)"}).strip() == "42"
    with pytest.raises(ToolTimeout):
        tool.call({"code": "import time\nprint('started')\ntime.sleep(30)"})
    with pytest.raises(ToolError, match="NameError"):
        tool.call({"code": "print(undefined)"})


def test_concurrent_runs_are_independent(box):
    with cf.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: box.run(f"print({i} * {i})").stdout.strip(), range(8)))
    assert outs == [str(i * i) for i in range(8)]
