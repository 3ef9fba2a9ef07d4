"""`rlfuse dpo CONFIG [--set k=v ...] [--resume]`: DPO / IPO / conservative DPO from a recipe."""

from __future__ import annotations

from rlfuse.api import DPOTrainer
from rlfuse.cli.common import (
    add_config_arguments,
    fail,
    load_run_config,
    print_data,
    run_flags,
    setup_threads,
    single_process_only,
)

HELP = "DPO / IPO / conservative DPO on preference pairs from a recipe (YAML)"


def add_arguments(p):
    add_config_arguments(p)


def run(args) -> int:
    try:
        single_process_only("dpo")
        cfg = load_run_config(args)
        setup_threads(args.threads)
        res = DPOTrainer(config=cfg, **run_flags(args)).train()
    except ValueError as e:
        return fail(e)
    last = res["history"][-1] if res["history"] else {}
    print(f"dpo done: {res['steps']} steps, last loss {float(last.get('loss', float('nan'))):.4f}, reward margin "
          f"{float(last.get('rewards/margin', float('nan'))):.4f}; run folder {res['run_dir']} (weights in final/)")
    if res["evals"]:
        first, lastev = res["evals"][0], res["evals"][-1]
        key = "accuracy" if "accuracy" in lastev else "reward"
        print(f"held-out {key} {first[key]:.4f} (step {first['step']}) -> {lastev[key]:.4f} (step {lastev['step']})")
    if "pair_evals" in res:
        pe = res["pair_evals"]
        print(f"held-out pairs ({pe['num_pairs']}): " + ", ".join(
            f"{k} {pe['before'][k]:.4f} -> {pe['after'][k]:.4f}" for k in ("pair_accuracy", "logp_margin")))
    print_data(res)
    return 0
