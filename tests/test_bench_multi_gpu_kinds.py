"""benchmarks/bench_multi_gpu.py's `kinds2` phase (benchmarks/multi_gpu_kinds.py: DPO, GRPO with an
environment, tools, image rows and the Python API, 1 vs N GPUs): its recipes load (fast: a bad
key would otherwise surface only on the GPUs), its GPU pool runs jobs on free GPUs (fast), and its
CPU smoke run (`--small`, 2 gloo ranks; slow: ~70-130 s on 2 cores): every job exits 0, exact
mismatch 0 on 1 and 2 processes, metrics and final weights within fp32 rounding, the generated
texts equal.
Run: python -m pytest -q tests/test_bench_multi_gpu_kinds.py; python -m pytest -q -m slow tests/test_bench_multi_gpu_kinds.py
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfuse.run.config import load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import multi_gpu_jobs as M  # noqa: E402
import multi_gpu_kinds as K  # noqa: E402


@pytest.mark.parametrize("small", [True, False])
def test_kinds2_recipes_load(tmp_path, small, monkeypatch):
    monkeypatch.setattr(M, "SMALL", [small])
    monkeypatch.setattr(K, "SMALL", M.SMALL)
    M.setup(tmp_path)
    kinds = K.kinds2_recipes(tmp_path)
    assert set(kinds) == set(K.EVIDENCE)
    for name, (stage, path, _) in kinds.items():
        cfg = load_config(str(path))
        assert cfg.checkpoint.save_final and cfg.seed == 0, name
        assert cfg.engine.numerics == "exact", name
        section = getattr(cfg, stage)
        batch = section.batch_size if stage == "dpo" else section.prompts_per_step
        assert batch % 4 == 0 and section.steps == 3, name  # the same global batch on 1, 2 and 4 GPUs
    assert load_config(str(kinds["dpo_live"][1])).dpo.reference == "live"


class _Proc:
    """A job that ends after `polls` polls."""

    def __init__(self, polls):
        self.polls = polls

    def poll(self):
        self.polls -= 1
        return 0 if self.polls < 0 else None


class _Jobs:
    """Jobs.start / wait without processes: records which GPUs each job got and checks that
    running jobs never share a GPU or exceed the pool."""

    def __init__(self, slots, polls):
        self.slots, self.polls, self.busy, self.gpus, self.done = slots, polls, set(), {}, []

    def start(self, name, argv, *, gpu=None, timeout=0):
        ids = {int(i) for i in gpu.split(",")}
        assert not ids & self.busy and ids <= set(range(self.slots)), (name, ids, self.busy)
        self.busy |= ids
        self.gpus[name] = ids
        return (name, argv, _Proc(self.polls[name]), None, time.perf_counter(), 60)

    def wait(self, handle):
        self.busy -= self.gpus[handle[0]]
        self.done.append(handle[0])


def test_run_pool_fills_free_gpus(monkeypatch):
    monkeypatch.setattr(K.time, "sleep", lambda s: None)
    # a long 1-GPU job, short ones: the 2-GPU jobs start as soon as two GPUs are free
    polls = {"long": 20, "a1": 1, "a2": 1, "a3": 1, "b1": 2, "b2": 2, "b3": 2}
    jobs = [("long", [], 1), ("a1", [], 1), ("a2", [], 1), ("a3", [], 1), ("b1", [], 2), ("b2", [], 2),
            ("b3", [], 2)]
    J = _Jobs(4, polls)
    K.run_pool(J, jobs, 4, 60)
    assert sorted(J.done) == sorted(polls) and J.done[-1] == "long"  # the 2-GPU jobs did not wait for it
    assert all(len(J.gpus[f"b{i}"]) == 2 for i in (1, 2, 3)) and not J.busy
    with pytest.raises(SystemExit, match="needs 4 GPUs"):
        K.run_pool(_Jobs(2, {"c": 0}), [("c", [], 4)], 2, 60)


@pytest.mark.slow
def test_kinds2_small_smoke_run(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), OMP_NUM_THREADS="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_multi_gpu.py"), "kinds2", "--small",
                        "--kinds-gpus", "2", "--work", str(tmp_path / "work")],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "bench_multi_gpu_kinds2.json").read_text())
    assert {j["rc"] for j in res["jobs"].values()} == {0}, res["jobs"]
    assert len(res["jobs"]) == 12
    for name, e in res["equivalence"].items():
        assert len(e["steps"]) == 3, name
        for s in e["steps"]:
            assert s["max_rel_diff"] < 1e-5, (name, s)
            if not name.startswith("dpo"):  # DPO has no rollout
                assert s["mismatch_max_abs_1gpu"] == 0.0 and s["mismatch_max_abs_2gpu"] == 0.0, (name, s)
        assert e["weights"]["max_abs"] < 1e-6, (name, e["weights"])
    gen = res["equivalence"]["api"]["generated"]
    assert gen["before"] == gen["after"] == "6/6 equal", gen
