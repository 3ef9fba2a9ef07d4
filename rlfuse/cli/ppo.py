"""`rlfuse ppo CONFIG [--set k=v ...] [--resume]`: PPO with a critic from a recipe."""

from __future__ import annotations

from rlfuse.cli.common import (
    add_config_arguments,
    fail,
    load_run_config,
    prepare_run,
    print_summary,
    setup_threads,
    single_process_only,
)
from rlfuse.train import run_ppo

HELP = "PPO with a critic (GAE, clipped value loss, KL-shaped reward) from a recipe (YAML)"


def add_arguments(p):
    add_config_arguments(p)


def run(args) -> int:
    try:
        single_process_only("ppo")
        cfg = load_run_config(args)
        prepare_run(args, cfg, "ppo")
        setup_threads(args.threads)
        res = run_ppo(cfg)
    except ValueError as e:
        return fail(e)
    print_summary("ppo", res)
    return 0
