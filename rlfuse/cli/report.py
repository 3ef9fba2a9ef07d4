"""`rlfuse report RUN_DIR`: PNG plots and a one-page HTML summary of a run folder."""

from __future__ import annotations

from rlfuse.cli.common import fail
from rlfuse.run.report import render

HELP = "render PNG plots and an HTML summary of a run folder"


def add_arguments(p):
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (holding metrics.jsonl, or sft/ and grpo/)")


def run(args) -> int:
    try:
        index = render(args.run_dir)
    except ValueError as e:
        return fail(e)
    print(f"report: {index}")
    return 0
