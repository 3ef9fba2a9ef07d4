"""PPO learns on CPU with the real engine: held-out greedy accuracy after PPO beats its
SFT starting point by more than run-to-run noise (rlfuse/recipes/ppo_demo.py).

Margin as in tests/test_demo.py: n held-out problems, an accuracy near 0.5 has standard
error sqrt(0.25 / n), the difference of two on the same problems at most sqrt(2) times
that; we require a gain above 2 of those (0.082 for n = 300). Gains measured over seeds
0-4 are in docs/algorithms.md, "PPO" (seed 0, the one tested, is typical). Slow-marked (35 s):
the default suite keeps PPO's unit and one-step tests, and the CPU suite's 15-minute budget.
Runs single-threaded (faster for a 0.4M-parameter model on a shared 2-core machine)."""

import json
import math

import pytest
from train_setup import one_thread

from rlfuse.recipes.ppo_demo import run_ppo_demo


@pytest.mark.slow
def test_ppo_beats_sft_start(tmp_path):
    lines = []
    with one_thread():
        res = run_ppo_demo(str(tmp_path), seed=0, echo=lines.append)
    n = res["eval_problems"]
    margin = 2 * math.sqrt(2) * math.sqrt(0.25 / n)
    gain = res["accuracy_ppo"] - res["accuracy_start"]
    summary = {k: v for k, v in res.items() if k != "ppo_history"}
    assert gain > margin, f"PPO gain {gain:+.3f} <= margin {margin:.3f}: {json.dumps(summary)}"
    assert 0.15 <= res["accuracy_start"] <= 0.6, "SFT should warm the model up to partial accuracy only"
    hist = res["ppo_history"]
    assert max(float(h["mismatch/max_abs"]) for h in hist) < 1e-4  # engine and trainer agree (fp32)
    for key in ("critic/value_loss", "critic/explained_variance", "critic/value_clip_frac", "returns/mean",
                "kl_coef", "kl", "clip_frac", "entropy"):
        assert all(math.isfinite(float(h[key])) for h in hist), key
