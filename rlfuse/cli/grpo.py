"""`rlfuse grpo CONFIG [--set k=v ...] [--resume]`: GRPO / DAPO / Dr. GRPO / GSPO from a recipe."""

from __future__ import annotations

from rlfuse.api import GRPOTrainer
from rlfuse.cli.common import (
    add_config_arguments,
    as_rank,
    end_distributed,
    fail,
    load_run_config,
    print_summary,
    run_flags,
    setup_threads,
    start_distributed,
)
from rlfuse.run.distributed import RankFailed

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
        res = GRPOTrainer(config=cfg, dist=ctx, **run_flags(args)).train()
    except (ValueError, RankFailed) as e:  # RankFailed: another rank's error, with its message
        return fail(e)
    end_distributed(ctx)
    if ctx is not None and not ctx.is_main:
        return 0
    print_summary("grpo", res)
    return 0
