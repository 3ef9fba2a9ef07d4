"""`rlfuse grpo CONFIG [--set k=v ...] [--resume]`: GRPO / DAPO / Dr. GRPO / GSPO from a recipe."""

from __future__ import annotations

from rlfuse.cli.common import add_config_arguments, fail, load_run_config, prepare_run, setup_threads
from rlfuse.train.grpo import run_grpo

HELP = "GRPO / DAPO / Dr. GRPO / GSPO training from a recipe (YAML)"


def add_arguments(p):
    add_config_arguments(p)


def run(args) -> int:
    try:
        cfg = load_run_config(args)
        prepare_run(args, cfg, "grpo")
        setup_threads(args.threads)
        res = run_grpo(cfg)
    except ValueError as e:
        return fail(e)
    if res["evals"]:
        first, last = res["evals"][0], res["evals"][-1]
        key = "accuracy" if "accuracy" in last else "reward"
        print(f"grpo done: held-out {key} {first[key]:.4f} (step {first['step']}) -> {last[key]:.4f} "
              f"(step {last['step']}); run folder {res['run_dir']}")
    else:
        print(f"grpo done; run folder {res['run_dir']}")
    return 0
