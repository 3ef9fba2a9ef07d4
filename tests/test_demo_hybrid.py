"""`rlfuse demo --hybrid`: the arithmetic demo on a tiny Qwen3.5-style hybrid (one Gated
DeltaNet layer, one gated full attention) with the real engine.

The quick test runs the demo's own config for a few SFT steps and a greedy evaluation
through the engine (the hybrid's linear-attention state in the rollout path); the slow one
runs the shortened demo (size "ci") over 3 seeds and requires GRPO's held-out gain over the
SFT start to exceed the noise margin of tests/test_demo.py (0.082 for 300 problems).
Measured on a loaded 2-core CPU (held-out accuracy after SFT -> after GRPO, fast numerics,
engine-vs-trainer max |delta log-prob| <= 6e-6): seed 0 0.370 -> 0.610, seed 1 0.743 -> 0.940,
seed 2 0.417 -> 0.627; 9-11 min a seed.
Run: python -m pytest -q tests/test_demo_hybrid.py [-m slow]
"""

import math

import pytest
from train_setup import one_thread

from rlfuse.data import build_prompts
from rlfuse.recipes.demo import demo_config, run_demo
from rlfuse.rollout import evaluate
from rlfuse.run.config import replace
from rlfuse.train import open_session, run_sft


def test_demo_hybrid_config_trains_and_evaluates_through_the_engine(tmp_path):
    cfg = replace(demo_config("ci", str(tmp_path), seed=0, hybrid=True),
                  **{"sft.steps": 3, "sft.batch_size": 8, "optim.lr": 2e-3, "model.device": "cpu"})
    with one_thread():
        ses = open_session(cfg, need_target=True)
        assert ses.model.config.is_hybrid and ses.model.config.layer_types == ("linear_attention", "full_attention")
        hist = run_sft(cfg, session=ses)["history"]
        assert len(hist) == 3 and all(math.isfinite(h["loss"]) for h in hist)
        prompts = build_prompts(ses.train_rows[:8], ses.tokenizer, cfg.data, "dev")
        res = evaluate(ses.sampler, prompts, ses.rewards(), max_new_tokens=cfg.grpo.max_new_tokens)
        assert 0.0 <= res["accuracy"] <= 1.0 and ses.sampler.llm.runner.linear is not None


def test_demo_cli_refuses_hybrid_with_agent(tmp_path, capsys):
    from rlfuse.cli import main

    assert main(["demo", "--hybrid", "--agent", "--run-dir", str(tmp_path / "d")]) != 0
    assert "--hybrid runs the arithmetic demo" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_demo_hybrid_grpo_beats_sft_start(tmp_path, seed):
    with one_thread():
        res = run_demo("ci", str(tmp_path), seed=seed, echo=lambda *_: None, hybrid=True)
    n = res["eval_problems"]
    margin = 2 * math.sqrt(2) * math.sqrt(0.25 / n)
    gain = res["accuracy_grpo"] - res["accuracy_sft"]
    assert gain > margin, f"seed {seed}: GRPO gain {gain:+.3f} <= margin {margin:.3f}"
    assert max(float(h["mismatch/max_abs"]) for h in res["grpo_history"]) < 1e-4  # engine and trainer agree
