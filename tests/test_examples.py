"""The getting-started walk-through (docs/getting-started.md) end to end on CPU, on the
shipped example data, reward and recipes, with a tiny random model and fewer steps:
make_tiny_model -> sft -> grpo (engine rollouts, user reward file) -> eval -> report ->
generate.
    python -m pytest -q tests/test_examples.py
"""

import importlib.util
import json
from pathlib import Path

from rlfuse.cli import main

ROOT = Path(__file__).resolve().parents[1]
DATA = ["examples/data/reverse_train.jsonl", "examples/data/reverse_eval.jsonl"]


def _make_tiny_model():
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "examples" / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def test_getting_started_walkthrough(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the recipes name the data and reward files relative to the repository
    model, sft, grpo = tmp_path / "tiny-model", tmp_path / "sft", tmp_path / "grpo"
    quiet = ["--set", "logging.progress=false", "--set", "logging.tensorboard=false", "--threads", "1"]

    assert _make_tiny_model()([str(model), "--data", *DATA]) == 0
    assert main(["sft", "examples/sft.yaml", "--run-dir", str(sft), "--set", f"model.path={model}",
                 "--set", "sft.steps=4", "--set", "sft.eval_every=0", *quiet]) == 0
    assert (sft / "final" / "config.json").exists() and (sft / "final" / "tokenizer.json").exists()

    assert main(["grpo", "examples/grpo.yaml", "--run-dir", str(grpo), "--set", f"model.path={sft / 'final'}",
                 "--set", "grpo.steps=2", "--set", "grpo.prompts_per_step=2", "--set", "grpo.group_size=4",
                 "--set", "grpo.eval_every=0", *quiet]) == 0
    rows = [json.loads(x) for x in (grpo / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["stage"] == "grpo"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(0.0 <= r["reward/reverse_reward"] <= 1.0 for r in steps)  # the user's reward file ran

    assert main(["eval", "examples/grpo.yaml", "--run-dir", str(grpo), "--checkpoint", str(grpo / "final"),
                 "--limit", "5", *quiet]) == 0
    assert json.loads((grpo / "eval.json").read_text())["num_problems"] == 5.0
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report" / "index.html").exists()

    capsys.readouterr()
    assert main(["generate", str(grpo / "final"), "--prompt", "reverse abc:", "--max-tokens", "6",
                 "--device", "cpu", "--json"]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert len(out) == 1 and set(out[0]["text"]) <= set(" abcdef:reviso<>")
