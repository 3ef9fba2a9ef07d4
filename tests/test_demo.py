"""The demo (shortened, `size="ci"`) with the real engine: GRPO raises held-out greedy
accuracy above its SFT starting point by more than run-to-run noise.

Margin: the held-out set has n problems; the standard error of one accuracy near 0.5 is
sqrt(0.25 / n) (0.029 for n = 300), so the difference of two accuracies on the same
problems has a standard error of at most sqrt(2) times that (0.041). We require a gain
above 2 of those (0.082): a gain that large is not evaluation noise. Measured gains over
seeds 0-4 on a 2-core CPU are in docs/architecture.md, "The demo" (seed 0, the one tested, is typical).
Runs single-threaded (faster for a 0.4M-parameter model on a shared 2-core machine)."""

import json
import math

from train_setup import one_thread

from rlfuse.recipes.demo import run_demo


def test_demo_grpo_beats_sft_start(tmp_path):
    lines = []
    with one_thread():
        res = run_demo("ci", str(tmp_path), seed=0, echo=lines.append)
    n = res["eval_problems"]
    margin = 2 * math.sqrt(2) * math.sqrt(0.25 / n)
    gain = res["accuracy_grpo"] - res["accuracy_sft"]
    summary = {k: v for k, v in res.items() if k != "grpo_history"}
    assert gain > margin, f"GRPO gain {gain:+.3f} <= margin {margin:.3f}: {json.dumps(summary)}"
    assert 0.2 <= res["accuracy_sft"] <= 0.8, "SFT should warm the model up to partial accuracy only"
    assert any("after GRPO" in ln for ln in lines)
    assert (tmp_path / "grpo" / "final" / "model.safetensors").exists()
    hist = res["grpo_history"]
    assert max(float(h["mismatch/max_abs"]) for h in hist) < 1e-4  # engine and trainer agree (fp32)
