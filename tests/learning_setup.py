"""Learning runs for tests/test_learning.py, from one SFT warm start shared by all.

The warm start is the demo's (rlfuse/recipes/demo.py, size "ci"): a tiny Qwen3 model and
a character tokenizer on built-in 2-digit addition, SFT until greedy accuracy on 200
training problems reaches 0.4. Each algorithm then trains a fresh copy of those weights
(GRPO with the engine for rollouts) and is evaluated on the 300 held-out problems before
and after:
  * greedy accuracy; the margin a gain must clear is the demo test's: twice the largest
    standard error of a difference of two accuracies on n problems, 2 sqrt(2) sqrt(0.25 / n);
  * DPO also: the policy's log-prob margin pi(correct) - pi(wrong) on the held-out
    preference pairs (the same problems), its per-pair gain averaged; the margin it must
    clear is 3 standard errors of that mean (paired: same pairs before and after).

Measure over seeds (the table in docs/algorithms.md, "Learning on CPU"):
    PYTHONPATH=$PWD python tests/learning_setup.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import torch
from train_setup import one_thread

from rlfuse.data.preference import build_preference_pairs
from rlfuse.recipes.demo import demo_config, sft_warm_up
from rlfuse.run.build import build_model, pick_device
from rlfuse.run.config.io import replace
from rlfuse.run.config.run_config import RunConfig
from rlfuse.train.dpo import run_dpo, sequence_logprobs
from rlfuse.train.grpo import run_grpo
from rlfuse.train.session import open_session

QUIET = {"logging.progress": False, "logging.tensorboard": False, "checkpoint.save_final": False}

# the algorithms under test: run_dir suffix -> (trainer, config changes on the demo's GRPO-stage config)
RUNS = {
    "rloo": ("grpo", {"grpo.advantage": "rloo"}),
    "reinforce_pp": ("grpo", {"grpo.advantage": "reinforce_pp"}),
    # rank-8 LoRA on every linear layer (alpha 32), lr 10x the full fine-tune's 1e-4
    "lora_rloo": ("grpo", {"grpo.advantage": "rloo", "model.lora": {"rank": 8}, "optim.lr": 1e-3}),
    # 2000 pairs: the 30 x 64 the run visits (the reference log-probs of all are precomputed)
    "dpo": ("dpo", {"data.train": "builtin:arithmetic_pref", "data.train_size": 2000, "optim.lr": 3e-4,
                    "dpo.steps": 30, "dpo.batch_size": 64, "dpo.beta": 0.5}),
}


@dataclasses.dataclass
class WarmStart:
    cfg: RunConfig
    """The demo's GRPO-stage config (seed, data, rewards, optim) the runs start from."""
    state: dict
    tokenizer: object
    sft_steps: int
    seconds: float


def warm_start(run_dir: str | Path, seed: int = 0) -> WarmStart:
    t0 = time.perf_counter()
    base = replace(demo_config("ci", str(run_dir), seed), **QUIET)
    sft_cfg = replace(base, **{"logging.run_dir": str(Path(run_dir) / "sft"), "optim.lr": 2e-3})
    ses = open_session(sft_cfg, need_target=True)
    res, _ = sft_warm_up(ses, sft_cfg, max_new_tokens=base.grpo.max_new_tokens)
    state = {k: v.detach().clone() for k, v in ses.model.state_dict().items()}
    return WarmStart(base, state, ses.tokenizer, res["steps"], time.perf_counter() - t0)


def fresh_model(ws: WarmStart):
    """A new model holding the warm-start weights (its own engine will be built on it)."""
    model = build_model(ws.cfg.model, ws.tokenizer, pick_device(ws.cfg.model.device), seed=ws.cfg.seed)
    model.load_state_dict(ws.state)
    return model


def run_algorithm(name: str, ws: WarmStart, run_dir: str | Path) -> dict:
    """Train `name` of RUNS from the warm start; {before, after, gain, margin, n, seconds}."""
    kind, changes = RUNS[name]
    cfg = replace(ws.cfg, **{"logging.run_dir": str(Path(run_dir) / name), **changes})
    t0 = time.perf_counter()
    ses = open_session(cfg, model=fresh_model(ws), tokenizer=ws.tokenizer)
    pairs, lp0 = None, None
    if kind == "dpo":
        pairs = build_preference_pairs(ses.eval_rows, ses.tokenizer, cfg.data, cfg.dpo)
        lp0 = sequence_logprobs(ses.model, pairs, cfg.dpo.micro_batch_tokens, ses.device).double()
    res = (run_grpo if kind == "grpo" else run_dpo)(cfg, session=ses)
    before, after = res["evals"][0], res["evals"][-1]
    n = int(before["num_problems"])
    out = {"before": before["accuracy"], "after": after["accuracy"], "gain": after["accuracy"] - before["accuracy"],
           "margin": 2 * math.sqrt(2) * math.sqrt(0.25 / n), "n": n, "seconds": time.perf_counter() - t0,
           "history": res["history"]}
    if pairs is not None:
        lp1 = sequence_logprobs(res["model"], pairs, cfg.dpo.micro_batch_tokens, ses.device).double()
        g = (lp1[:, 0] - lp1[:, 1]) - (lp0[:, 0] - lp0[:, 1])  # per-pair gain of the log-prob margin
        out.update(pair_margin_before=float((lp0[:, 0] - lp0[:, 1]).mean()),
                   pair_margin_after=float((lp1[:, 0] - lp1[:, 1]).mean()),
                   pair_gain=float(g.mean()), pair_noise=3 * float(g.std()) / math.sqrt(len(g)),
                   pair_evals=res["pair_evals"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--runs", nargs="+", default=list(RUNS))
    ap.add_argument("--run-dir", default="/tmp/rlfuse_learning")
    args = ap.parse_args()
    print("| seed | SFT steps | algorithm | acc before | acc after | gain (margin 0.082) "
          "| DPO pair margin before -> after | gain (3 SE) | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    with one_thread():
        for seed in args.seeds:
            torch.manual_seed(seed)
            ws = warm_start(Path(args.run_dir) / f"seed{seed}", seed)
            for name in args.runs:
                r = run_algorithm(name, ws, Path(args.run_dir) / f"seed{seed}")
                pair = (f"{r['pair_margin_before']:.2f} -> {r['pair_margin_after']:.2f} | {r['pair_gain']:+.2f} "
                        f"({r['pair_noise']:.2f})") if "pair_gain" in r else " | "
                print(f"| {seed} | {ws.sft_steps} | {name} | {r['before']:.3f} | {r['after']:.3f} | {r['gain']:+.3f} "
                      f"| {pair} | {r['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
