"""`rlfuse ppo CONFIG [--set k=v ...] [--resume]`: PPO with a critic from a recipe."""

from __future__ import annotations

from rlfuse.api import PPOTrainer
from rlfuse.cli.common import (
    add_config_arguments,
    fail,
    load_run_config,
    print_summary,
    run_flags,
    setup_threads,
    single_process_only,
)

HELP = "PPO with a critic (GAE, clipped value loss, KL-shaped reward) from a recipe (YAML)"


def add_arguments(p):
    add_config_arguments(p)


def run(args) -> int:
    try:
        single_process_only("ppo")
        cfg = load_run_config(args)
        setup_threads(args.threads)
        res = PPOTrainer(config=cfg, **run_flags(args)).train()
    except ValueError as e:
        return fail(e)
    print_summary("ppo", res)
    return 0
