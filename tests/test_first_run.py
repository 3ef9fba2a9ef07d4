"""What a newcomer meets on a first run (issue 24, "small things"): the closing line after
--resume, `rlfuse eval`'s readable numbers, `rlfuse generate`'s legend and flag help,
per-command --help, `rlfuse --version`, the install line of the docs.
(Their error messages are in the bad-input corpus, tests/test_bad_inputs.py.)
Run: python -m pytest -q tests/test_first_run.py
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from train_setup import tiny_recipe

from rlfuse.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]


def _cli(argv, capsys):
    rc = main(["--log-level", "WARNING", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_closing_line_after_resume_spans_the_whole_run(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path / "r.yaml", logging={"run_dir": str(tmp_path / "run"), "tensorboard": False},
                         grpo={"steps": 1})
    rc, out, err = _cli(["grpo", str(recipe)], capsys)
    assert rc == 0, err
    rc, out, err = _cli(["grpo", str(recipe), "--resume", "--set", "grpo.steps=2"], capsys)
    assert rc == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("grpo done"))
    assert re.match(r"grpo done: held-out accuracy \d\.\d{4} \(step 0\) -> \d\.\d{4} \(step 2\); run folder", line), line


def test_eval_prints_readable_numbers(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path / "r.yaml", logging={"run_dir": str(tmp_path / "run"), "tensorboard": False})
    rc, _, err = _cli(["sft", str(recipe)], capsys)
    assert rc == 0, err
    rc, out, err = _cli(["eval", str(recipe), "--checkpoint", str(tmp_path / "run" / "final")], capsys)
    assert rc == 0, err
    assert out.splitlines()[0].startswith("eval of ") and "held-out problems (greedy):" in out
    for ln in out.splitlines()[1:-1]:
        value = ln.split()[-1]
        assert len(value) <= 8 and not value.startswith("{"), ln  # 4 significant digits, no JSON
    assert out.splitlines()[-1] == f"written to {tmp_path / 'run' / 'eval.json'}"


def test_generate_explains_its_lines_and_its_flags(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path / "r.yaml", logging={"run_dir": str(tmp_path / "run"), "tensorboard": False})
    assert _cli(["sft", str(recipe)], capsys)[0] == 0
    rc, out, err = _cli(["generate", str(tmp_path / "run" / "final"), "--prompt", "1+1=", "--max-tokens", "3",
                         "--device", "cpu"], capsys)
    assert rc == 0, err
    assert "# [prompt.sample] (stop: end of sequence or a --stop string | length: --max-tokens reached)" in err
    assert re.match(r"\[0\.0\] \((stop|length)\) ", out.splitlines()[0]), out
    sub = build_parser()._subparsers._group_actions[0].choices["generate"]
    for action in sub._actions:
        if action.dest not in ("help", "model"):
            assert action.help, f"--{action.dest} has no help"
    assert "(default: 128)" in sub.format_help()


@pytest.mark.parametrize("command,other", [("sft", "ppo."), ("grpo", "dpo."), ("ppo", "grpo."), ("dpo", "sft.")])
def test_command_help_lists_only_its_sections(command, other):
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    text = sub.format_help()
    assert f"  {command}.steps " in text and f"\n  {other}" not in text


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and re.fullmatch(r"rlfuse \d+\.\d+\.\d+\n", capsys.readouterr().out)


def test_getting_started_installs_as_the_readme_does():
    readme = (REPO / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("pip install torch=="))
    assert f"`{line}`" in (REPO / "docs" / "getting-started.md").read_text()
