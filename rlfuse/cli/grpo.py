"""`rlfuse grpo CONFIG [--set k=v ...] [--resume]`: GRPO / DAPO / Dr. GRPO / GSPO from a recipe."""

from __future__ import annotations

from rlfuse.cli.common import (
    add_config_arguments,
    as_rank,
    end_distributed,
    fail,
    load_run_config,
    prepare_run,
    print_summary,
    setup_threads,
    start_distributed,
)
from rlfuse.run.distributed import RankFailed
from rlfuse.train import run_grpo

HELP = "GRPO / DAPO / Dr. GRPO / GSPO training from a recipe (YAML)"


def add_arguments(p):
    add_config_arguments(p)


def run(args) -> int:
    return as_rank(lambda: _run(args))()


def _run(args) -> int:
    try:
        cfg = load_run_config(args)
        setup_threads(args.threads)
        ctx = start_distributed(args, cfg)  # None unless launched by torchrun
        prepare_run(args, cfg, "grpo", ctx)
        res = run_grpo(cfg, dist=ctx)
    except (ValueError, RankFailed) as e:  # RankFailed: another rank's error, with its message
        return fail(e)
    end_distributed(ctx)
    if ctx is not None and not ctx.is_main:
        return 0
    print_summary("grpo", res)
    return 0
