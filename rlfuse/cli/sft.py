"""`rlfuse sft CONFIG [--set k=v ...] [--resume]`: supervised fine-tuning from a recipe."""

from __future__ import annotations

from rlfuse.api import SFTTrainer
from rlfuse.cli.common import (
    add_config_arguments,
    as_rank,
    end_distributed,
    fail,
    load_run_config,
    print_data,
    run_flags,
    setup_threads,
    start_distributed,
)
from rlfuse.run.distributed import RankFailed

HELP = "supervised fine-tuning from a recipe (YAML)"


def add_arguments(p):
    add_config_arguments(p)


def run(args) -> int:
    return as_rank(lambda: _run(args))()


def _run(args) -> int:
    try:
        cfg = load_run_config(args)
        setup_threads(args.threads)
        ctx = start_distributed(args, cfg)  # None unless launched by torchrun
        res = SFTTrainer(config=cfg, dist=ctx, **run_flags(args)).train()
    except (ValueError, RankFailed) as e:  # RankFailed: another rank's error, with its message
        return fail(e)
    end_distributed(ctx)
    if ctx is not None and not ctx.is_main:
        return 0
    last = res["history"][-1] if res["history"] else {}
    print(f"sft done: {res['steps']} steps, last loss {last.get('loss', float('nan')):.4f}; "
          f"run folder {res['run_dir']} (weights in final/)")
    for ev in res["evals"][-1:]:
        key = "accuracy" if "accuracy" in ev else "reward"
        rest = ", ".join(f"{k} {v:.4g}" for k, v in ev.items() if k not in (key, "step"))
        print(f"held-out {key} {ev[key]:.4f} at step {ev['step']} ({rest})")
    print_data(res)
    return 0
