"""The Python API: SFT then GRPO in one process on one copy of the weights, with a lambda
reward and lists of dicts, on a tiny random model (tests/serve_helpers.py's folder: byte
tokenizer, ChatML template). The summary, trainer.model, save() and generate() work in the
same process; rows in memory land in RUN_DIR/data as JSONL that the run's config names."""

from __future__ import annotations

import json
import re

import pytest
import torch
from engine_helpers import one_thread  # noqa: F401 (fixture)
from serve_helpers import write_model_folder

import rlfuse
from rlfuse import GRPOTrainer, SFTConfig, SFTTrainer, load_model

SMALL = {"model": {"dtype": "float32", "device": "cpu"}, "engine": {"max_num_seqs": 16, "max_model_len": 64},
         "data": {"max_prompt_len": 16},
         "optim": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"},
         "logging": {"tensorboard": False, "progress": False}, "checkpoint": {"save_final": False}}
SFT_ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(4) for b in range(4)]
GRPO_ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]


def test_package_exports_the_api():
    for name in ("SFTTrainer", "GRPOTrainer", "PPOTrainer", "DPOTrainer", "load_model", "RunConfig", "SFTConfig",
                 "GRPOConfig", "PPOConfig", "DPOConfig"):
        assert name in rlfuse.__all__ and getattr(rlfuse, name) is not None


def test_sft_then_grpo_in_process(tmp_path):
    folder = write_model_folder(tmp_path / "base")
    sft = SFTTrainer(str(folder), train_dataset=SFT_ROWS, config=SMALL, run_dir=tmp_path / "sft",
                     args=SFTConfig(steps=3, batch_size=8, micro_batch_tokens=64))
    before = [p.detach().clone() for p in sft.model.parameters()]
    res = sft.train()
    assert res["steps"] == 3 and len(res["history"]) == 3 and all("loss" in r for r in res["history"])
    assert any(not torch.equal(a, b) for a, b in zip(before, sft.model.parameters()))
    saved = json.loads(json.dumps([json.loads(x) for x in (tmp_path / "sft" / "data" / "train.jsonl").open()]))
    assert saved == SFT_ROWS
    assert str(tmp_path / "sft" / "data" / "train.jsonl") in (tmp_path / "sft" / "config.yaml").read_text()

    calls = []

    def longer(prompts, completions, **kw):  # rewards length: variance within every group
        calls.append(len(completions))
        return [float(len(c)) for c in completions]
    grpo = GRPOTrainer(sft, reward_funcs=[lambda prompts, completions, answer, **kw: [
                           float(c.strip() == a) for c, a in zip(completions, answer)], longer],
                       reward_weights=[1.0, 0.1], train_dataset=GRPO_ROWS, config=SMALL, run_dir=tmp_path / "grpo",
                       args={"steps": 2, "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4})
    assert grpo.model is sft.model  # one copy of the weights: GRPO trains the SFT tensors in place
    before = [p.detach().clone() for p in grpo.model.parameters()]
    out = grpo.train()
    assert out["steps"] == 2 and calls and all(n == 2 * 4 for n in calls[:2])
    assert any(not torch.equal(a, b) for a, b in zip(before, grpo.model.parameters()))
    rows = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").open()]
    assert any("reward/reward_0" in r and "reward/longer" in r for r in rows)
    cfg_text = (tmp_path / "grpo" / "config.yaml").read_text()
    assert "python:reward_0" in cfg_text and "python:longer" in cfg_text

    texts = grpo.generate(["1+2=", "3+0="], max_tokens=4)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    out_dir = grpo.save(tmp_path / "export")
    model, tok = load_model(out_dir, device="cpu")
    for a, b in zip(model.parameters(), grpo.model.parameters()):
        assert torch.equal(a, b)
    assert tok.encode("1+2=") == grpo.tokenizer.encode("1+2=")
    assert grpo.generate("1+2=", max_tokens=4) == texts[:1]  # greedy: the same again


def test_bad_api_inputs_name_what_was_expected(tmp_path):
    folder = write_model_folder(tmp_path / "base")
    with pytest.raises(ValueError, match="train_dataset: expected a path, a list of dicts"):
        SFTTrainer(str(folder), train_dataset=[1, 2], config=SMALL, run_dir=tmp_path / "a")
    with pytest.raises(ValueError, match=r"train_dataset\[0\]: the row cannot be written as JSON"):
        SFTTrainer(str(folder), train_dataset=[{"prompt": object()}], config=SMALL, run_dir=tmp_path / "b")
    with pytest.raises(ValueError, match="args: expected a GRPOConfig"):
        GRPOTrainer(str(folder), reward_funcs=[len], args=SFTConfig(), config=SMALL, run_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="reward_weights: 1 weights for 2 reward functions"):
        GRPOTrainer(str(folder), reward_funcs=[len, len], reward_weights=[1.0], config=SMALL, run_dir=tmp_path / "d")
    with pytest.raises(ValueError, match="model: a CausalLM needs its tokenizer="):
        GRPOTrainer(load_model(folder, device="cpu")[0], reward_funcs=[len], config=SMALL, run_dir=tmp_path / "e")


class _DatasetLike:
    """What the API asks of a `datasets.Dataset`: to_list()."""

    def __init__(self, rows):
        self.rows = rows

    def to_list(self):
        return list(self.rows)


def test_dataset_objects_are_read_through_to_list(tmp_path):
    folder = write_model_folder(tmp_path / "base")
    t = SFTTrainer(str(folder), train_dataset=_DatasetLike(SFT_ROWS[:8]), config=SMALL, run_dir=tmp_path / "r",
                   args={"steps": 1, "batch_size": 4})
    assert [r for _, r in t.session.train_rows] == SFT_ROWS[:8]


def _example(name: str):
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_script_runs(tmp_path, capsys):
    """examples/python_api.py with a few steps: SFT, GRPO, generate, save."""
    data = [str(_example("python_api").HERE / "data" / f) for f in ("reverse_train.jsonl", "reverse_eval.jsonl")]
    assert _example("make_tiny_model").main([str(tmp_path / "m"), "--data", *data]) == 0
    assert _example("python_api").main([str(tmp_path / "m"), "--out", str(tmp_path / "api"), "--sft-steps", "2",
                                        "--grpo-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "sft: 2 steps" in out and "grpo: held-out reward" in out and "generate: [" in out
    assert (tmp_path / "api" / "export" / "config.json").exists()
    assert (tmp_path / "api" / "grpo" / "final" / "config.json").exists()


def test_a_python_reward_of_another_process_is_named(tmp_path):
    """A run's config.yaml records a lambda as python:<name>: a later process (rlfuse eval,
    a resume without the function) is told to pass it again."""
    from rlfuse.rollout import RewardSet
    from rlfuse.run.config import RewardSpec
    with pytest.raises(ValueError, match="'python:reward_0': a Python function given to the API in another process"):
        RewardSet([RewardSpec(name="python:reward_0")])
    fn = lambda prompts, completions, **kw: [0.0] * len(completions)  # noqa: E731
    assert RewardSet([RewardSpec(name="python:reward_0")], functions={"python:reward_0": fn}).fns == [fn]


def test_real_datasets_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = write_model_folder(tmp_path / "base")
    t = SFTTrainer(str(folder), train_dataset=datasets.Dataset.from_list(SFT_ROWS[:8]), config=SMALL,
                   run_dir=tmp_path / "r", args={"steps": 1, "batch_size": 4})
    assert [r for _, r in t.session.train_rows] == SFT_ROWS[:8]


def test_dpo_and_ppo_from_lists(tmp_path):
    """The other two trainers on rows in memory: DPO on preference pairs, PPO with a lambda."""
    from rlfuse import DPOTrainer, PPOTrainer
    folder = write_model_folder(tmp_path / "base")
    pairs = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
             for a in range(3) for b in range(3)]
    dpo = DPOTrainer(str(folder), train_dataset=pairs, config=SMALL, run_dir=tmp_path / "dpo",
                     args={"steps": 2, "batch_size": 4})
    res = dpo.train()
    assert res["steps"] == 2 and all("loss" in r for r in res["history"])
    ppo = PPOTrainer(dpo, reward_funcs=[lambda prompts, completions, **kw: [float(len(c)) for c in completions]],
                     train_dataset=GRPO_ROWS, config=SMALL, run_dir=tmp_path / "ppo",
                     args={"steps": 1, "prompts_per_step": 4, "max_new_tokens": 4})
    assert ppo.model is dpo.model and ppo.train()["steps"] == 1


def test_generate_works_with_tools_set(tmp_path):
    """Before: AttributeError: 'MultiTurnSampler' object has no attribute 'llm'."""
    folder = write_model_folder(tmp_path / "base")
    cfg = {**SMALL, "rollout": {"tools": ["calculator"], "max_turns": 2}}
    grpo = GRPOTrainer(str(folder), reward_funcs=[len], train_dataset=GRPO_ROWS, config=cfg,
                       run_dir=tmp_path / "grpo", args={"steps": 1, "max_new_tokens": 4})
    texts = grpo.generate(["1+2=", "3+0="], max_tokens=4)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    grpo._release()


def lookup(city: str) -> str:
    """Look up a city's temperature.

    Args:
        city: the city's name.
    """
    return f"{city}: 21 degrees"


@pytest.mark.parametrize("how", ["tools-argument", "in-the-config"])
def test_the_api_takes_a_tool_function(tmp_path, how):
    """Before: rollout.tools[0]: expected a string, got <function lookup>."""
    folder = write_model_folder(tmp_path / "base")
    cfg = {**SMALL, "rollout": {"max_turns": 2}}
    kw = {"tools": [lookup, "calculator"]}
    if how == "in-the-config":
        cfg["rollout"] = {**cfg["rollout"], "tools": [lookup, "calculator"]}
        kw = {}
    grpo = GRPOTrainer(str(folder), reward_funcs=[len], train_dataset=GRPO_ROWS, config=cfg,
                       run_dir=tmp_path / "grpo", args={"steps": 1, "max_new_tokens": 4}, **kw)
    try:
        assert grpo.config.rollout.tools == ["python:lookup", "calculator"]
        assert "python:lookup" in (tmp_path / "grpo" / "config.yaml").read_text()
        runner = grpo.session.sampler.runner
        assert [s["function"]["name"] for s in runner.schemas()] == ["lookup", "calculator"]
        assert runner.tools["lookup"].call({"city": "Oslo"}) == "Oslo: 21 degrees"
    finally:
        grpo._release()
    from rlfuse.rollout import load_tools
    with pytest.raises(ValueError, match=r"rollout.tools\[0\]: 'python:lookup' names a function given to the "
                                         r"Python API"):
        load_tools(["python:lookup"])  # the run's config.yaml read by another process (rlfuse eval, --resume)
    with pytest.raises(ValueError, match=r"tools\[0\]: expected a built-in name, FILE.py:FUNCTION or a named"):
        GRPOTrainer(str(folder), reward_funcs=[len], train_dataset=GRPO_ROWS, config=SMALL,
                    run_dir=tmp_path / "g2", tools=[lambda city: city])


@pytest.mark.parametrize("kw,key", [({"learning_rate": 1e-6}, "optim.lr"), ({"num_generations": 4}, "grpo.group_size"),
                                    ({"max_completion_length": 64}, "grpo.max_new_tokens"),
                                    ({"beta": 0.04}, "grpo.kl_coef")])
def test_trl_names_name_rlfuse_s_field(kw, key):
    """Before: a bare TypeError (__init__() got an unexpected keyword argument)."""
    from rlfuse import GRPOConfig
    with pytest.raises(ValueError, match=rf"GRPOConfig: unknown field '{next(iter(kw))}' \(that is TRL's name; "
                                         rf"rlfuse's is {re.escape(key)}"):
        GRPOConfig(**kw)
    with pytest.raises(ValueError, match=r"SFTConfig: unknown field 'lr' \(fields: batch_size, eval_every"):
        SFTConfig(lr=1e-3)


def test_the_api_logs_like_the_cli_unless_logging_is_configured(monkeypatch, capsys):
    """Issue 37: the Python API printed no log lines (no evaluations, no summary)."""
    import logging

    from rlfuse.api.trainers import log_to_stderr_unless_configured
    pkg = logging.getLogger("rlfuse")
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(pkg, "handlers", [])
    monkeypatch.setattr(pkg, "level", logging.NOTSET)
    engine_level = logging.getLogger("rlfuse.engine").level
    try:
        log_to_stderr_unless_configured()
        logging.getLogger("rlfuse.train.demo").info("held-out accuracy 0.5")
        assert "INFO rlfuse.train.demo: held-out accuracy 0.5" in capsys.readouterr().err
        handlers = list(pkg.handlers)
        log_to_stderr_unless_configured()
        assert pkg.handlers == handlers  # once
    finally:
        logging.getLogger("rlfuse.engine").setLevel(engine_level)
    monkeypatch.setattr(pkg, "handlers", [])
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])  # the program's own setup
    log_to_stderr_unless_configured()
    assert pkg.handlers == []


def test_the_next_stage_inherits_the_earlier_trainers_settings(tmp_path):
    """Issue 37: GRPOTrainer(sft, ...) without a config took every default and failed
    (data.max_prompt_len 512 does not fit the 64-token context) only after the SFT ran."""
    folder = write_model_folder(tmp_path / "base")
    sft = SFTTrainer(str(folder), train_dataset=SFT_ROWS, config=SMALL, run_dir=tmp_path / "sft",
                     args={"steps": 1, "batch_size": 4})
    sft._release()
    grpo = GRPOTrainer(sft, reward_funcs=[len], train_dataset=GRPO_ROWS, run_dir=tmp_path / "grpo",
                       args={"steps": 1, "max_new_tokens": 4})
    try:
        assert grpo.config.data.max_prompt_len == 16 and grpo.config.engine.max_model_len == 64
        assert grpo.config.optim.lr == sft.config.optim.lr and grpo.config.grpo.max_new_tokens == 4
        assert grpo.config.logging.run_dir == str(tmp_path / "grpo")
    finally:
        grpo._release()


def test_run_folder_errors_name_the_api_arguments(tmp_path):
    """Issue 37: API errors said --resume / --overwrite / --run-dir."""
    folder = write_model_folder(tmp_path / "base")
    sft = SFTTrainer(str(folder), train_dataset=SFT_ROWS, config=SMALL, run_dir=tmp_path / "sft",
                     args={"steps": 1, "batch_size": 4})
    sft.train()
    with pytest.raises(ValueError) as e:
        SFTTrainer(str(folder), train_dataset=SFT_ROWS, config=SMALL, run_dir=tmp_path / "sft")
    msg = str(e.value)
    assert "resume=True" in msg and "overwrite=True" in msg and "run_dir=" in msg and "--" not in msg, msg


def test_resuming_an_api_run_whose_rows_were_in_memory(tmp_path):
    """Issue 37: resume=True without the datasets was refused (data.train '' against the run's
    RUN_DIR/data/train.jsonl), and with force=True the failed start rewrote config.yaml."""
    folder = write_model_folder(tmp_path / "base")
    cfg = {**SMALL, "checkpoint": {"save_final": False, "every": 1}}
    first = SFTTrainer(str(folder), train_dataset=SFT_ROWS, config=cfg, run_dir=tmp_path / "sft",
                       args={"steps": 1, "batch_size": 4})
    assert first.train()["steps"] == 1
    again = SFTTrainer(str(folder), config=cfg, run_dir=tmp_path / "sft", resume=True,
                       args={"steps": 2, "batch_size": 4})
    assert again.config.data.train == str(tmp_path / "sft" / "data" / "train.jsonl")
    res = again.train()
    assert res["steps"] == 2 and res["history"][-1]["step"] == 2


@pytest.mark.slow  # ~30 s: the doc's own 80 SFT + 20 GRPO steps
def test_python_api_doc_example_runs_as_written(tmp_path):
    """docs/python-api.md's first code block, unchanged, in a folder that holds what the
    block's comment says to make (the tiny model) and the repository's examples/."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    block = re.search(r"```python\n(.*?)```", (root / "docs" / "python-api.md").read_text(), re.S).group(1)
    (tmp_path / "examples").symlink_to(root / "examples")
    data = [str(root / "examples" / "data" / f) for f in ("reverse_train.jsonl", "reverse_eval.jsonl")]
    assert _example("make_tiny_model").main([str(tmp_path / "runs" / "tiny-model"), "--data", *data]) == 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "RLFUSE_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    before, after = (float(x) for x in r.stdout.split("\n")[0].split(" -> "))
    assert before > 0.3 and after > 0.3, r.stdout  # SFT taught the task (held-out reward; GRPO's 20 steps move it little)
    assert (tmp_path / "exports" / "grpo" / "config.json").exists() and "max_new_tokens=256" not in r.stderr
