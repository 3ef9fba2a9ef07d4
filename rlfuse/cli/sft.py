"""`rlfuse sft CONFIG [--set k=v ...] [--resume]`: supervised fine-tuning from a recipe."""

from __future__ import annotations

from rlfuse.cli.common import add_config_arguments, fail, load_run_config, prepare_run, setup_threads
from rlfuse.train.sft import run_sft

HELP = "supervised fine-tuning from a recipe (YAML)"


def add_arguments(p):
    add_config_arguments(p)


def run(args) -> int:
    try:
        cfg = load_run_config(args)
        prepare_run(args, cfg, "sft")
        setup_threads(args.threads)
        res = run_sft(cfg)
    except ValueError as e:
        return fail(e)
    last = res["history"][-1] if res["history"] else {}
    print(f"sft done: {res['steps']} steps, last loss {last.get('loss', float('nan')):.4f}; "
          f"run folder {res['run_dir']} (weights in final/)")
    for ev in res["evals"][-1:]:
        print("eval:", {k: round(v, 4) for k, v in ev.items()})
    return 0
