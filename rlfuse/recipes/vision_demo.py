"""`rlfuse demo --vision`: a tiny vision-language model learns to count on its own samples.

A tiny Qwen3-VL (2 text layers of width 128, a 2-block vision tower of width 64 with
8-pixel patches) and a character tokenizer with the image markers are built in memory for
the built-in image task count_squares ("how many red squares?" on a 32 x 32 image of
4 x 4 cells: each cell one patch, 4 image tokens after the 2 x 2 merge). SFT warms the
model up to partial accuracy (sampled answers beat guessing the most common count), GRPO then
trains it on its own samples (exact-count reward); held-out accuracy (layouts disjoint from
training), greedy and sampled at the rollout temperature, before and after GRPO is printed.
The vision tower trains too (model.train_vision): from random weights it has to learn to
see the squares. `--numerics exact` makes the rollout log-probs of the image prompts equal
the trainer's bitwise (mismatch/max_abs 0 at every step; slower on the CPU: the tower
then encodes image by image).

Sizes: cpu (the default without CUDA), ci (a shortened cpu run for the tests).
Run: rlfuse demo --vision [--size cpu|ci] [--run-dir runs/demo_vision]
Test: python -m pytest -q tests/test_vision_demo.py
"""

from __future__ import annotations

import time
from pathlib import Path

from rlfuse.recipes.demo import grpo_after_warm_up, sft_warm_up
from rlfuse.run.config import RunConfig, load_config, replace
from rlfuse.train import open_session

VLM = dict(model_type="qwen3_vl", hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=8,
           num_key_value_heads=4, head_dim=16, max_position_embeddings=64, rope_theta=10000.0,
           tie_word_embeddings=True, mrope_section=[2, 3, 3],
           vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=8,
                       temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=128, num_position_embeddings=16,
                       deepstack_visual_indexes=[0]))
"""The tiny VLM (model.random_init): the vision token ids come from the character tokenizer."""
# max SFT steps, SFT batch, GRPO steps, prompts per step, group size, held-out images, training images
_SCHEDULE = {"ci": (300, 32, 60, 16, 8, 200, 3000), "cpu": (600, 32, 100, 16, 8, 300, 3000)}
SIZES = tuple(_SCHEDULE)
SFT_LR = 5e-4
"""The warm-up's constant learning rate. At 2e-3 greedy training accuracy read 0.92, 0.55, 0.59,
0.19, 1.0 at steps 65-85 (seed 1), so where SFT stopped was a draw."""
SAMPLED_TARGET = 0.05
SFT_CHECK_EVERY = 5
"""SFT stops once completions sampled at grpo.temperature on 200 training images are right this
much more often than guessing the most common count (`warm_up_target`: ~0.30), checked every
SFT_CHECK_EVERY steps. Sampled accuracy climbs nearly steadily at SFT_LR; greedy accuracy is a
knife edge here (the count's distribution is still flat and greedy reads its argmax: 0.68, 0.29,
0.68 at steps 40-50 of seed 1; 1.0 already at sampled 0.49, seed 2), so a greedy target stopped
at a random point or after the count was learnt."""
GRPO_LR = 5e-4
"""GRPO's peak learning rate, decayed to 0 (cosine) so the last steps settle: at 1e-4, 12 steps
barely moved the sampled reward; at 1e-3 (constant, 60 steps) greedy accuracy collapsed to
0.26-0.53 over seeds 0-2; at 5e-4, 40 steps left seed 0 at greedy 0.73, 60 steps reach 0.61-1.0
(docs/vision.md, "The demo")."""
SAMPLED_EVAL = 4
"""Held-out samples per image for the sampled accuracy (what GRPO maximizes), printed beside the greedy one."""


def warm_up_target(rows) -> tuple[float, float]:
    """(guess, target): guess = the share of training rows whose answer is the most common one
    (floored to the 200 dev images' resolution); target = guess + SAMPLED_TARGET."""
    answers = [r["answer"] for _, r in rows]
    guess = int(200 * max(answers.count(a) for a in set(answers)) / len(answers)) / 200
    return guess, round(guess + SAMPLED_TARGET, 4)


def vision_demo_config(size: str = "cpu", run_dir: str = "runs/demo_vision", seed: int = 0) -> RunConfig:
    if size not in _SCHEDULE:
        raise ValueError(f"vision demo size must be one of {SIZES}, got {size!r}")
    sft_steps, sft_batch, grpo_steps, pps, group, n_eval, n_train = _SCHEDULE[size]
    return load_config({
        "seed": seed,
        "model": {"random_init": VLM, "tokenizer": "char", "dtype": "float32", "device": "cpu",
                  "train_vision": True, "processor": {"min_pixels": 1024, "max_pixels": 1024}},
        "engine": {"numerics": "fast"},
        "data": {"train": "builtin:count_squares", "task": {"max_count": 4, "distractors": 2},
                 "train_size": n_train, "eval_size": n_eval, "max_prompt_len": 40, "seed": seed},
        "rewards": [{"name": "arithmetic"}],  # the exact integer answer
        "optim": {"lr": GRPO_LR, "betas": [0.9, 0.99], "weight_decay": 0.0, "warmup_steps": 5,
                  "schedule": "cosine", "max_grad_norm": 1.0},
        "sft": {"steps": sft_steps, "batch_size": sft_batch, "micro_batch_tokens": 4096, "max_seq_len": 48},
        "grpo": {"steps": grpo_steps, "prompts_per_step": pps, "group_size": group, "max_new_tokens": 3,
                 "temperature": 1.0, "loss_type": "grpo", "clip_low": 0.2, "clip_high": 0.28, "mu": 1,
                 "micro_batch_tokens": 8192, "sample_every": 10, "seed": seed},
        "logging": {"run_dir": run_dir, "tensorboard": False, "progress": False},
        "checkpoint": {"every": 0, "keep_last": 1, "save_final": False},
    })


def run_vision_demo(size: str = "cpu", run_dir: str = "runs/demo_vision", *, seed: int = 0, echo=print,
                    overrides: dict | None = None) -> dict:
    """SFT warm-up then GRPO on one in-memory tiny VLM; returns accuracies, timings and the
    GRPO history (vision/encodes per step among its metrics)."""
    t0 = time.perf_counter()
    base = vision_demo_config(size, run_dir, seed)
    if overrides:
        base = replace(base, **overrides)
    sft_cfg = replace(base, **{"logging.run_dir": str(Path(run_dir) / "sft"), "optim.lr": SFT_LR,
                                 "optim.schedule": "constant"})
    grpo_cfg = replace(base, **{"logging.run_dir": str(Path(run_dir) / "grpo")})
    ses = open_session(sft_cfg, need_target=True)
    model = ses.model
    echo(f"rlfuse demo --vision ({size}): tiny Qwen3-VL ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
         f"params, vision tower {sum(p.numel() for p in model.visual.parameters()) / 1e6:.2f}M) on {ses.device}, "
         f"count the red squares, run folder {run_dir}")
    guess, target = warm_up_target(ses.train_rows)
    t_sft = time.perf_counter()
    sft, dev_acc = sft_warm_up(ses, sft_cfg, max_new_tokens=base.grpo.max_new_tokens, target=target,
                               every=SFT_CHECK_EVERY, temperature=base.grpo.temperature)
    t_sft = time.perf_counter() - t_sft
    echo(f"SFT warm-up: {sft['steps']} steps in {t_sft:.0f} s, training-image accuracy sampled at temperature "
         f"{base.grpo.temperature:g} {dev_acc[-1][1] if dev_acc else float('nan'):.3f} (stops at {target:g}: "
         f"guessing the most common count scores {guess:g})")
    return grpo_after_warm_up(grpo_cfg, ses, sft, dev_acc, t_sft=t_sft, t0=t0, echo=echo, items="images",
                              sampled_eval=SAMPLED_EVAL)
