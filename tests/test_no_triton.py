"""Triton is optional: without it the package imports, trains and generates on the
PyTorch references, and asking for the Triton backend is a clear error.

A subprocess hides triton (`sys.modules["triton"] = None`, which is how Python spells
"not installed" for both `import triton` and `importlib.util.find_spec`), then runs the
tiny recipe's `rlfuse sft` and `rlfuse grpo` (the engine included) through the CLI.
Run: python -m pytest -q tests/test_no_triton.py
"""

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from train_setup import tiny_recipe

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, pkgutil, sys
    sys.modules["triton"] = None  # not installed
    import rlfuse
    from rlfuse.cli import main
    # the Triton halves: rlfuse/kernels/triton/ and an op family's triton_*.py
    mods = [m.name for m in pkgutil.walk_packages(rlfuse.__path__, "rlfuse.")
            if not m.name.startswith("rlfuse.kernels.triton")
            and not (m.name.startswith("rlfuse.kernels.") and m.name.rsplit(".", 1)[1].startswith("triton_"))]
    for m in mods:
        __import__(m)
    recipe, run = sys.argv[1], sys.argv[2]
    codes = [main(["sft", recipe, "--run-dir", run + "/sft"]),
             main(["grpo", recipe, "--run-dir", run + "/grpo"]),
             main(["sft", recipe, "--run-dir", run + "/t", "--set", "model.kernel_backend=triton"])]
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "triton" and sys.modules[m] is not None)
    print(json.dumps({"codes": codes, "modules": len(mods), "triton_loaded": loaded}))
""")


def test_runs_without_triton(tmp_path):
    recipe = tiny_recipe(tmp_path / "tiny.yaml", grpo={"steps": 1}, logging={"tensorboard": False})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(recipe), str(tmp_path / "runs")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["codes"] == [0, 0, 2], r.stderr[-3000:]
    assert out["modules"] > 40 and out["triton_loaded"] == []
    assert "model.kernel_backend: 'triton' asked for, but triton is not installed" in r.stderr
    assert "Traceback" not in r.stderr
    assert (tmp_path / "runs/grpo/final/model.safetensors").exists()


def test_triton_is_an_extra_not_a_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda req: req.split(">")[0].split("=")[0].split("<")[0].strip()  # noqa: E731
    assert "triton" not in {name(r) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    assert "triton" in {name(r) for r in extras["gpu"]} and "triton" in {name(r) for r in extras["dev"]}
