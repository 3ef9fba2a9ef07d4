"""The CLI end to end on a tiny recipe: sft -> grpo (with the engine) from the SFT
weights -> eval -> report. (Config errors of the CLI: tests/test_bad_inputs.py.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_setup import tiny_recipe

from rlfuse.cli import COMMANDS, build_parser, main


@pytest.fixture
def recipe(tmp_path):
    return tiny_recipe(tmp_path / "tiny.yaml")


def test_sft_grpo_eval_report(tmp_path, recipe, capsys):
    sft_dir, grpo_dir = tmp_path / "sft", tmp_path / "grpo"
    assert main(["sft", str(recipe), "--run-dir", str(sft_dir)]) == 0
    assert (sft_dir / "final" / "config.json").exists() and (sft_dir / "config.yaml").exists()
    assert list((sft_dir / "tb").iterdir())  # TensorBoard event file
    final = sft_dir / "final"
    assert main(["grpo", str(recipe), "--run-dir", str(grpo_dir), "--set", f"model.path={final}",
                 "--set", "model.random_init=null", "--set", "model.tokenizer="]) == 0
    assert "grpo done: held-out accuracy" in capsys.readouterr().out
    rows = [json.loads(x) for x in (grpo_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["stage"] == "grpo"] == [1, 2]
    assert main(["eval", str(recipe), "--run-dir", str(grpo_dir), "--checkpoint", str(grpo_dir / "final"),
                 "--limit", "5"]) == 0
    assert json.loads((grpo_dir / "eval.json").read_text())["num_problems"] == 5.0
    assert main(["report", str(tmp_path)]) == 0
    index = (tmp_path / "report" / "index.html").read_text()
    assert "grpo" in index and "sft" in index and list((tmp_path / "report").glob("*.png"))


def test_help_lists_only_commands_that_exist_and_python_m_rlfuse_runs_main():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert list(sub.choices) == list(COMMANDS)
    for mod in COMMANDS.values():  # every listed command has a real implementation
        assert callable(mod.run) and callable(mod.add_arguments) and mod.HELP
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "rlfuse", "--help"], capture_output=True, text=True, env=env,
                         cwd=root, check=True).stdout
    assert all(name in out for name in COMMANDS) and "consistency" not in out


def test_version_and_help_import_no_torch():
    """`rlfuse --version` / `--help` answer without importing torch or matplotlib (issue 37:
    4-5 s idle, 21 s on a busy machine); each command's help line is its module's HELP."""
    from rlfuse.cli import COMMAND_HELP

    assert all(COMMAND_HELP[name] == COMMANDS[name].HELP for name in COMMANDS)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    probe = ("import runpy, sys\nsys.argv = ['rlfuse', *sys.argv[1:]]\ntry:\n"
             "    runpy.run_module('rlfuse', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print('HEAVY', sorted(m for m in ('torch', 'matplotlib', 'numpy') if m in sys.modules))")
    for flag in ("--version", "--help"):
        out = subprocess.run([sys.executable, "-c", probe, flag], capture_output=True, text=True, env=env, cwd=root,
                             check=True).stdout
        assert "HEAVY []" in out and ("rlfuse 0." in out if flag == "--version" else "COMMAND" in out), out


def test_missing_model_folder_is_said_so(tmp_path, recipe, capsys):
    nope = tmp_path / "nope"
    assert main(["generate", str(nope), "--prompt", "1+1="]) == 2
    assert f"rlfuse: error: MODEL: {nope}: no such model folder" in capsys.readouterr().err
    assert main(["eval", str(recipe), "--checkpoint", str(nope), "--run-dir", str(tmp_path / "ev")]) == 2
    assert f"rlfuse: error: --checkpoint: {nope}: no such model folder" in capsys.readouterr().err
    assert main(["generate", str(nope)]) == 2
    assert "rlfuse: error: no prompts: give --prompt TEXT or --prompts-file FILE" in capsys.readouterr().err


def test_a_failed_start_leaves_the_runs_config_as_it_was(tmp_path, recipe, capsys):
    """Issue 37: a resume that failed on its data ("data.train is empty") had already
    rewritten the run's config.yaml (train: ''): the run no longer named its own data. (An
    empty data.train on resume now takes the run's own; any failed start is tried here.)"""
    run = tmp_path / "run"
    assert main(["sft", str(recipe), "--run-dir", str(run), "--set", "sft.steps=1"]) == 0
    before = (run / "config.yaml").read_text()
    assert main(["sft", str(recipe), "--run-dir", str(run), "--resume", "--force", "--set", "data.max_prompt_len=500",
                 "--set", "sft.steps=2"]) == 2
    assert "data.max_prompt_len (500) does not fit" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == before


def test_threads_are_chosen_automatically_and_logged(caplog, monkeypatch, recipe, tmp_path):
    """Issue 37: speed swung up to 19x with torch's default threads, and nothing said which.
    No --threads / RLFUSE_THREADS: a command takes the idle cores (cores less the load
    average), a trainer on the CPU 1 thread for a tiny model; each choice is logged."""
    import logging

    import torch

    import rlfuse.run.build as build
    from rlfuse import SFTTrainer
    from rlfuse.cli.common import setup_threads

    before = torch.get_num_threads()
    monkeypatch.delenv("RLFUSE_THREADS", raising=False)
    monkeypatch.setattr(build, "_threads_set_by", [])
    monkeypatch.setattr(build.os, "getloadavg", lambda: (before - 0.6, 0.0, 0.0))  # all but ~1 core busy
    try:
        with caplog.at_level(logging.INFO):
            assert build.choose_threads(400_000)[0] == 1 and build.choose_threads(10**9)[0] == 1
            setup_threads(None, model_decides=True)  # a training command: the trainer decides
            assert not build.threads_chosen()
            monkeypatch.setattr(build.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
            assert build.choose_threads(10**9)[0] == before  # idle: torch's default
            SFTTrainer(config=str(recipe), run_dir=tmp_path / "api")
            assert torch.get_num_threads() == 1 and build.threads_chosen()
            assert "torch CPU threads: 1 (a 0." in caplog.text and "intra-op threads" in caplog.text
            monkeypatch.setattr(build, "_threads_set_by", [])
            setup_threads(None)  # check, serve, generate, eval: by the load
            assert f"torch CPU threads: {before} ({before} cores, 1-minute load average 0.0" in caplog.text
            setup_threads(2)
            assert "torch CPU threads: 2 (--threads" in caplog.text
    finally:
        torch.set_num_threads(before)


def test_the_tiny_char_model_trains_on_your_own_jsonl(tmp_path, recipe, capsys):
    """Issue 37: model.tokenizer: char with a JSONL file failed ("'char' needs a builtin task").
    The alphabet now comes from the file's own text, and the run's final/ carries it."""
    rows = [{"prompt": f"reverse {w}: ", "completion": w[::-1]} for w in ("abc", "hello", "rlfuse", "tiny", "xyz")]
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    assert main(["sft", str(recipe), "--run-dir", str(run), "--set", f"data.train={data}", "--set", "data.eval=",
                 "--set", "rewards=[]", "--set", "sft.steps=2", "--set", "data.max_prompt_len=15"]) == 0, \
        capsys.readouterr().err
    tok = json.loads((run / "final" / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    assert all(c in vocab for c in "reverslhofuntiyxz:")
