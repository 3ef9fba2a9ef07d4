"""Golden losses: the per-step metrics and final weights of three tiny seeded CPU runs,
committed under tests/assets/losses/, compared bitwise (as torchtitan's tests/assets/losses
with loss_compare.py). A pure refactor leaves every number here unchanged; a change that
moves numbers on purpose regenerates the files and says so in its commit:

    RLFUSE_UPDATE_GOLDEN=1 PYTHONPATH=. python -m pytest -q tests/test_golden_losses.py

The runs: a 1-layer Qwen3-style model (hidden 32), char tokenizer, 1-digit arithmetic,
fp32, one CPU thread, torch kernels: SFT 4 steps; GRPO 3 steps on the real engine, in fast
numerics and in exact numerics (DAPO loss). Compared: every numeric metric of every logged
row except wall-clock, throughput and memory readings, and sha256 of the final parameters.
Bitwise on one machine and torch build; another CPU (its BLAS kernels) may round
differently, which the failure message says. Recorded with torch 2.13 (CPU).
"""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from train_setup import one_thread, tiny_cfg, tiny_session

from rlfuse.train import open_session, run_grpo, run_sft

ASSETS = Path(__file__).resolve().parent / "assets" / "losses"
VOLATILE = ("time/", "memory/", "tokens_per_s")  # readings of the machine, not of the run's numbers
RUNS = {
    "sft": ("sft", [], {"sft": {"steps": 4}}),
    "grpo_fast": ("grpo", [], {"grpo": {"steps": 3}}),
    "grpo_exact": ("grpo", ["engine.numerics=exact", "grpo.loss_type=dapo"], {"grpo": {"steps": 3}}),
}


def _weights_hash(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _trace(name: str, tmp_path) -> dict:
    algo, overrides, sections = RUNS[name]
    with one_thread():
        cfg = tiny_cfg(tmp_path / name, *overrides, **sections)
        if algo == "sft":
            res = run_sft(cfg, session=tiny_session(cfg, need_target=True))
        else:
            res = run_grpo(cfg, session=open_session(cfg))  # the real engine generates
    rows = [{k: v for k, v in r.items() if not k.startswith(VOLATILE) and isinstance(v, (int, float, str))}
            for r in res["history"]]
    return {"rows": rows, "final_weights_sha256": _weights_hash(res["model"])}


def _diff(want: dict, got: dict) -> list[str]:
    out = []
    if len(want["rows"]) != len(got["rows"]):
        out.append(f"rows: {len(want['rows'])} expected, {len(got['rows'])} now")
    for i, (a, b) in enumerate(zip(want["rows"], got["rows"])):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                out.append(f"row {i} (step {a.get('step')}) {k}: golden {a.get(k)!r}, now {b.get(k)!r}")
    if want["final_weights_sha256"] != got["final_weights_sha256"]:
        out.append("final weights differ")
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_golden_losses(name, tmp_path):
    got = _trace(name, tmp_path)
    path = ASSETS / f"{name}.json"
    if os.environ.get("RLFUSE_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1) + "\n")
        pytest.skip(f"wrote {path}")
    want = json.loads(path.read_text())
    diff = _diff(want, got)
    assert not diff, (f"{name}: the run's numbers moved ({len(diff)} differences; a refactor must leave them "
                      f"bitwise, an intended change regenerates {path.name} and says so in its commit; a "
                      f"different CPU or torch build may round differently):\n  " + "\n  ".join(diff[:20]))


def test_the_comparison_catches_one_ulp(tmp_path):
    got = {"rows": [{"step": 1, "loss": 1.0}], "final_weights_sha256": "x"}
    moved = {"rows": [{"step": 1, "loss": 1.0000000000000002}], "final_weights_sha256": "x"}
    assert _diff(got, got) == [] and _diff(got, moved) == ["row 0 (step 1) loss: golden 1.0, now 1.0000000000000002"]
