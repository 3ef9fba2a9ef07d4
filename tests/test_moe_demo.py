"""A tiny Qwen3-MoE learns the arithmetic demo task (issue 36, item 6): `rlfuse demo --moe`,
the demo's SFT warm-up then GRPO with the real engine, on the cpu model with an MoE block
(4 experts, top-2) in every layer.

The slow test runs the ci size over seeds 0, 1, 2 and asks each for a held-out gain above
the demo test's margin (tests/test_demo.py: twice the largest standard error of a
difference of two accuracies on n problems). The smoke test runs two SFT steps and one
GRPO step: the pipeline runs on an MoE model and logs the moe/* metrics, routing included.
Run: python -m pytest -q tests/test_moe_demo.py [-m slow]
"""

import json
import math

import pytest
from train_setup import one_thread

from rlfuse.recipes.demo import MOE_MODEL, run_demo

QUIET = {"logging.progress": False, "logging.tensorboard": False}


def test_moe_demo_smoke(tmp_path):
    over = {**QUIET, "model.random_init": MOE_MODEL, "sft.steps": 2, "sft.batch_size": 8, "grpo.steps": 1, "grpo.prompts_per_step": 4,
            "grpo.group_size": 4, "data.eval_size": 8, "data.train_size": 300, "engine.numerics": "exact"}
    lines = []
    with one_thread():
        res = run_demo("ci", str(tmp_path), overrides=over, echo=lines.append)
    assert "tiny Qwen3-MoE model" in lines[0]
    (h,) = res["grpo_history"]
    assert float(h["moe/routing_mismatch"]) == 0.0 and float(h["mismatch/max_abs"]) == 0.0
    assert all(k in h for k in ("moe/aux_loss", "moe/z_loss", "moe/load_max", "moe/load_min"))
    cfg = json.loads((tmp_path / "grpo" / "final" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["num_experts"] == 4


def test_cli_moe_refuses_the_agent_demo(tmp_path, capsys):
    from rlfuse.cli import main
    assert main(["demo", "--moe", "--agent", "--run-dir", str(tmp_path / "d")]) != 0
    assert "pick different demos" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_moe_demo_grpo_beats_sft_start(tmp_path, seed):
    with one_thread():
        res = run_demo("ci", str(tmp_path), seed=seed, overrides={**QUIET, "model.random_init": MOE_MODEL},
                       echo=lambda s: None)
    n = res["eval_problems"]
    margin = 2 * math.sqrt(2) * math.sqrt(0.25 / n)
    gain = res["accuracy_grpo"] - res["accuracy_sft"]
    summary = {k: v for k, v in res.items() if k != "grpo_history"}
    assert gain > margin, f"seed {seed}: GRPO gain {gain:+.3f} <= margin {margin:.3f}: {json.dumps(summary)}"
