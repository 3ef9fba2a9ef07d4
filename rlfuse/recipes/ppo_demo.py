"""PPO's learning check, the demo's way: nothing downloaded.

The demo's tiny Qwen3-architecture model and character tokenizer on built-in 2-digit
addition (rlfuse.recipes.demo): SFT warms the model up to partial accuracy, then PPO with
a critic (a copy of the warmed trunk, zero value head) trains it on its own samples
(exact-answer reward). Held-out greedy accuracy (problems disjoint from training) is
measured before and after PPO.
Run: python -c "from rlfuse.recipes.ppo_demo import run_ppo_demo; run_ppo_demo(seed=0)"
Test: python -m pytest -q tests/test_ppo_learning.py
"""

from __future__ import annotations

import time
from pathlib import Path

from rlfuse.recipes.demo import demo_config, sft_warm_up
from rlfuse.run.config import RunConfig, replace
from rlfuse.train import open_session, run_ppo

SFT_TARGET = 0.3
"""SFT stops once greedy accuracy on 200 training problems reaches this (checked every 25 steps)."""
EVAL_PROBLEMS = 300
PPO = {"steps": 20, "prompts_per_step": 64, "samples_per_prompt": 2, "max_new_tokens": 6, "temperature": 1.0,
       "mu": 2, "mini_batches": 1, "clip_low": 0.2, "clip_high": 0.2, "gamma": 1.0, "lam": 0.95,
       "critic_lr": 1e-3, "kl_coef": 0.01, "reward_norm": True, "whiten_advantages": True, "sample_every": 0}
"""PPO settings of the check (the model, data and policy optimizer are the demo's ci ones)."""


def ppo_demo_config(run_dir: str, seed: int = 0) -> RunConfig:
    base = demo_config("ci", run_dir, seed)
    return replace(base, **{"data.eval_size": EVAL_PROBLEMS, "logging.progress": False,
                            "logging.tensorboard": False, "checkpoint.save_final": False,
                            **{f"ppo.{k}": v for k, v in PPO.items()}, "ppo.seed": seed})


def run_ppo_demo(run_dir: str = "runs/ppo_demo", *, seed: int = 0, echo=print) -> dict:
    """SFT warm-up then PPO on one in-memory model; returns the accuracies and timings."""
    t0 = time.perf_counter()
    base = ppo_demo_config(run_dir, seed)
    sft_cfg = replace(base, **{"logging.run_dir": str(Path(run_dir) / "sft"), "optim.lr": 2e-3})
    ppo_cfg = replace(base, **{"logging.run_dir": str(Path(run_dir) / "ppo")})
    ses = open_session(sft_cfg, need_target=True)
    sft, _ = sft_warm_up(ses, sft_cfg, max_new_tokens=base.ppo.max_new_tokens, target=SFT_TARGET)
    t_sft = time.perf_counter() - t0
    ppo_ses = open_session(ppo_cfg, model=ses.model, tokenizer=ses.tokenizer, sampler=ses.sampler)
    res = run_ppo(ppo_cfg, session=ppo_ses)
    before, after = res["evals"][0], res["evals"][-1]
    out = {"seed": seed, "accuracy_start": before["accuracy"], "accuracy_ppo": after["accuracy"],
           "eval_problems": int(before["num_problems"]), "sft_steps": sft["steps"], "time_sft_s": t_sft,
           "time_total_s": time.perf_counter() - t0, "ppo_history": res["history"]}
    echo(f"seed {seed}: held-out accuracy ({out['eval_problems']} problems) after SFT ({sft['steps']} steps) "
         f"{out['accuracy_start']:.3f} -> after PPO ({ppo_cfg.ppo.steps} steps) {out['accuracy_ppo']:.3f} "
         f"({out['accuracy_ppo'] - out['accuracy_start']:+.3f}); SFT {t_sft:.0f} s, total {out['time_total_s']:.0f} s")
    return out

