"""The training commands, one table: `rlfuse sft | grpo | ppo | dpo CONFIG [--set k=v ...] [--resume]`.

Every training command loads a recipe (CONFIG with --set overrides), runs one trainer of the
Python API to the end (stopping at a step on SIGINT/SIGTERM, resumable) and prints a summary.
`TRAIN_COMMANDS` holds what differs: the help line, the config sections `--help` names, the
trainer and the summary. Under torchrun every one of them runs data-parallel
(docs/distributed.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rlfuse.api import DPOTrainer, GRPOTrainer, PPOTrainer, SFTTrainer
from rlfuse.cli.common import (
    add_config_arguments,
    agent_flags,
    as_rank,
    end_distributed,
    fail,
    load_run_config,
    print_data,
    print_summary,
    run_evals,
    run_flags,
    setup_threads,
    start_distributed,
    stopped,
)
from rlfuse.run import Interrupted, stop_on_signals
from rlfuse.run.distributed import RankFailed


def _sft_summary(res: dict) -> None:
    last = res["history"][-1] if res["history"] else {}
    print(f"sft done: {res['steps']} steps, last loss {last.get('loss', float('nan')):.4f}; "
          f"run folder {res['run_dir']} (weights in final/)")
    for ev in res["evals"][-1:]:
        key = "accuracy" if "accuracy" in ev else "reward"
        rest = ", ".join(f"{k} {v:.4g}" for k, v in ev.items() if k not in (key, "step"))
        print(f"held-out {key} {ev[key]:.4f} at step {ev['step']} ({rest})")
    print_data(res)


def _dpo_summary(res: dict) -> None:
    last = res["history"][-1] if res["history"] else {}
    print(f"dpo done: {res['steps']} steps, last loss {float(last.get('loss', float('nan'))):.4f}, reward margin "
          f"{float(last.get('rewards/margin', float('nan'))):.4f}; run folder {res['run_dir']} (weights in final/)")
    if evals := run_evals(res):
        first, lastev = evals[0], evals[-1]
        key = "accuracy" if "accuracy" in lastev else "reward"
        print(f"held-out {key} {first[key]:.4f} (step {first['step']}) -> {lastev[key]:.4f} (step {lastev['step']})")
    if "pair_evals" in res:
        pe = res["pair_evals"]
        print(f"held-out pairs ({pe['num_pairs']}): " + ", ".join(
            f"{k} {pe['before'][k]:.4f} -> {pe['after'][k]:.4f}" for k in ("pair_accuracy", "logp_margin")))
    print_data(res)


@dataclasses.dataclass(frozen=True)
class TrainCommand:
    """One training command: what `COMMANDS` needs of a subcommand (HELP, add_arguments, run)."""
    name: str
    HELP: str
    uses: tuple[str, ...]
    """Config sections and keys the command reads (named in its --help)."""
    trainer: type
    summary: Callable[[dict], None]

    def add_arguments(self, p) -> None:
        add_config_arguments(p, uses=self.uses)

    def run(self, args) -> int:
        return as_rank(lambda: self._run(args))()  # every trainer runs data-parallel under torchrun

    def _run(self, args) -> int:
        ctx = None
        try:
            cfg = load_run_config(args)
            setup_threads(args.threads, model_decides=True)  # the trainer picks by the model's size
            ctx = start_distributed(args, cfg)  # None unless launched by torchrun
            with stop_on_signals():
                res = self.trainer(config=cfg, dist=ctx, **run_flags(args),
                                   **agent_flags(cfg)).train()
        except (ValueError, RankFailed) as e:  # RankFailed: another rank's error, with its message
            return fail(e)
        except Interrupted as e:
            return stopped(args, e, ctx)
        end_distributed(ctx)
        if ctx is not None and not ctx.is_main:
            return 0
        self.summary(res)
        return 0


TRAIN_COMMANDS = {c.name: c for c in (
    TrainCommand(name="sft", HELP="supervised fine-tuning from a recipe (YAML)", trainer=SFTTrainer,
                 uses=("sft", "grpo.max_new_tokens"),  # held-out answers' length
                 summary=_sft_summary),
    TrainCommand(name="grpo", HELP="GRPO / DAPO / Dr. GRPO / GSPO training from a recipe (YAML)", trainer=GRPOTrainer,
                 uses=("grpo",), summary=lambda res: print_summary("grpo", res)),
    TrainCommand(name="ppo", HELP="PPO with a critic (GAE, clipped value loss, KL-shaped reward) from a recipe (YAML)",
                 trainer=PPOTrainer, uses=("ppo",), summary=lambda res: print_summary("ppo", res)),
    TrainCommand(name="dpo", HELP="DPO / IPO / conservative DPO on preference pairs from a recipe (YAML)",
                 trainer=DPOTrainer, uses=("dpo", "grpo.max_new_tokens"),  # held-out answers' length
                 summary=_dpo_summary),
)}
"""Command name -> TrainCommand."""
