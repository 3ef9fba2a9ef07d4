"""`rlfuse demo --vision` (rlfuse/recipes/vision_demo.py): a tiny Qwen3-VL, SFT warm-up then
GRPO on builtin:count_squares.

Default suite: a few steps of each stage through the CLI (the wiring: image prompts in the
engine, vision/encodes, the sampled held-out evaluation, the report files). Slow (`-m slow`):
the ci size over seeds 0, 1, 2, where GRPO must raise held-out accuracy, greedy and sampled at
the rollout temperature, above its SFT start by more than evaluation noise: 2 standard errors
of a difference of two accuracies on the same n problems, 2 * sqrt(2) * sqrt(0.25 / n) (0.1 for
n = 200; the sampled accuracy averages 4 samples per problem, whose variance is at most that
of one). Measured: docs/vision.md, "The demo" (seed 0: greedy 0.660 -> 1.000, sampled 0.319 ->
0.691, about a minute on an idle 2-core CPU)."""

import json
import math

import pytest
from engine_helpers import one_thread  # noqa: F401 -- an autouse fixture

from rlfuse.cli import main
from rlfuse.recipes.vision_demo import run_vision_demo


def test_vision_demo_runs_a_few_steps(tmp_path, monkeypatch, capsys):
    from rlfuse.recipes import vision_demo
    monkeypatch.setitem(vision_demo._SCHEDULE, "ci", (2, 4, 1, 2, 4, 4, 40))
    assert main(["demo", "--vision", "--size", "ci", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tiny Qwen3-VL" in out and "after GRPO" in out and "4 samples each at temperature 1" in out
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert summary["grpo_steps"] == 1 and summary["eval_problems"] == 4
    assert 0 <= summary["accuracy_sampled_sft"] <= 1 and 0 <= summary["accuracy_sampled_grpo"] <= 1
    rows = [json.loads(ln) for ln in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["vision/encodes"] for r in rows if r.get("stage") == "grpo"] == [2.0]  # 2 prompts x 4 samples


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vision_demo_grpo_beats_sft_start(tmp_path, seed):
    res = run_vision_demo("ci", str(tmp_path), seed=seed, echo=lambda *_: None)
    n = res["eval_problems"]
    margin = 2 * math.sqrt(2) * math.sqrt(0.25 / n)
    summary = json.dumps({k: v for k, v in res.items() if k != "grpo_history"})
    for kind, before, after in (("greedy", "accuracy_sft", "accuracy_grpo"),
                                ("sampled", "accuracy_sampled_sft", "accuracy_sampled_grpo")):
        gain = res[after] - res[before]
        assert gain > margin, f"seed {seed}: GRPO {kind} gain {gain:+.3f} <= margin {margin:.3f}: {summary}"
    assert all(h["vision/encodes"] == 16.0 for h in res["grpo_history"])  # 16 prompts x 8 samples
