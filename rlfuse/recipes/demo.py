"""The embedded default (`rlfuse demo`): nothing downloaded.

A tiny Qwen3-architecture model and a character-level tokenizer are built in memory for
the built-in arithmetic task; SFT warms the model up to partial accuracy; GRPO then
trains it on its own samples (exact-answer reward); held-out accuracy (greedy, problems
disjoint from training) is measured before and after GRPO and printed.

Sizes (`size`):
  cpu  the default on a machine without CUDA (~5 min on 2 cores)
  ci   a shortened cpu run for the CI test (< 2 min)
  gpu  the default with CUDA: a larger model and batch
`hybrid=True` (`rlfuse demo --hybrid`): the model is a tiny Qwen3.5-style hybrid (a Gated
DeltaNet layer and a gated full-attention layer) instead.
Run: rlfuse demo [--size cpu|ci|gpu] [--run-dir runs/demo]
Test: python -m pytest -q tests/test_demo.py
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from rlfuse.data import build_prompts
from rlfuse.rollout import evaluate
from rlfuse.run import RunLog
from rlfuse.run.config import RunConfig, load_config, replace
from rlfuse.train import open_session, run_grpo, run_sft

log = logging.getLogger(__name__)

_MODEL = {
    # 8 narrow heads: over seeds 0, 2, 3 SFT reached 40% in 200-275 steps, vs 275-900 with 4 heads of 32
    "cpu": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=4, head_dim=16, max_position_embeddings=64, rope_theta=10000.0),
    # head_dim 64: the size the Triton attention kernels are tuned for
    "gpu": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=64, rope_theta=10000.0),
}
MOE_MODEL = {
    **_MODEL["cpu"], "model_type": "qwen3_moe",
    # 4 experts, top-2, each half the dense MLP's width: the active MLP width equals the dense demo's
    "moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 192, "norm_topk_prob": True},
}
"""`rlfuse demo --moe`: the cpu model with a Qwen3-MoE block in every layer (model.random_init)."""
# `hybrid`: the cpu shape as a Qwen3.5-style hybrid, one Gated DeltaNet layer then one gated
# full attention (value heads = 2 x key heads, half of each attention head rotated)
_HYBRID = dict(_MODEL["cpu"], model_type="qwen3_5_text", layer_types=["linear_attention", "full_attention"],
               partial_rotary_factor=0.5, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=4, linear_num_value_heads=8)
# max SFT steps, SFT batch, GRPO steps, prompts per step, group size, held-out problems
_SCHEDULE = {
    "ci": (1500, 64, 30, 32, 8, 300),
    "cpu": (1500, 64, 100, 32, 8, 500),
    "gpu": (3000, 128, 100, 64, 16, 1000),
}
SIZES = tuple(_SCHEDULE)
SFT_TARGET = 0.4
"""SFT stops once greedy accuracy on 200 training problems reaches this (checked every 25 steps)."""


def demo_config(size: str = "cpu", run_dir: str = "runs/demo", seed: int = 0, hybrid: bool = False) -> RunConfig:
    """The GRPO-stage config; the SFT stage differs in optim (see run_demo). hybrid: the
    model is the Qwen3.5-style hybrid `_HYBRID` (any size)."""
    if size not in _SCHEDULE:
        raise ValueError(f"demo size must be one of {SIZES}, got {size!r}")
    sft_steps, sft_batch, grpo_steps, pps, group, n_eval = _SCHEDULE[size]
    return load_config({
        "seed": seed,
        "model": {"random_init": _HYBRID if hybrid else _MODEL["gpu" if size == "gpu" else "cpu"], "tokenizer": "char",
                  "dtype": "bfloat16" if size == "gpu" else "float32", "device": "auto"},
        "engine": {},
        # 2-digit operands written zero-padded: 10,000 problems, 500 held out
        "data": {"train": "builtin:arithmetic", "task": {"digits": 2, "ops": "+", "pad": True},
                 "train_size": 8000, "eval_size": n_eval, "max_prompt_len": 16, "seed": seed},
        "rewards": [{"name": "arithmetic"}],
        "optim": {"lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.0, "warmup_steps": 10,
                  "schedule": "constant", "max_grad_norm": 1.0},
        "sft": {"steps": sft_steps, "batch_size": sft_batch, "micro_batch_tokens": 4096, "max_seq_len": 32},
        "grpo": {"steps": grpo_steps, "prompts_per_step": pps, "group_size": group, "max_new_tokens": 6,
                 "temperature": 1.0, "loss_type": "grpo", "clip_low": 0.2, "clip_high": 0.28, "mu": 1,
                 "micro_batch_tokens": 8192, "sample_every": 10, "seed": seed},
        "logging": {"run_dir": run_dir, "tensorboard": True, "progress": True},
        "checkpoint": {"every": 0, "keep_last": 1, "save_final": True},
    })


def sft_warm_up(ses, sft_cfg: RunConfig, *, max_new_tokens: int, target: float = SFT_TARGET, every: int = 25,
                temperature: float = 0.0):
    """SFT on the session's model until accuracy on 200 training problems (greedy, or sampled at
    `temperature` with a fixed seed) reaches `target` (checked every `every` steps) or sft.steps
    run out: (run_sft's result, [(step, accuracy)])."""
    rewards = ses.rewards()
    dev = build_prompts(ses.train_rows[:200], ses.tokenizer, sft_cfg.data, "dev", vision=ses.vision)
    dev_acc = []

    def warm_enough(step):
        if step % every:
            return False
        acc = evaluate(ses.sampler, dev, rewards, max_new_tokens=max_new_tokens, temperature=temperature)["accuracy"]
        ses.sampler.sleep()
        dev_acc.append((step, acc))
        return acc >= target

    return run_sft(sft_cfg, session=ses, stop_when=warm_enough), dev_acc


def run_demo(size: str = "cpu", run_dir: str = "runs/demo", *, seed: int = 0, sampler_factory=None,
             overrides: dict | None = None, echo=print, hybrid: bool = False) -> dict:
    """SFT warm-up then GRPO on one in-memory model; returns accuracies and timings.
    `sampler_factory(model, tokenizer)` replaces the engine (tests)."""
    t0 = time.perf_counter()
    base = demo_config(size, run_dir, seed, hybrid)
    if overrides:
        base = replace(base, **overrides)
    # SFT: a high constant LR (the model starts from random weights); GRPO: base optim
    sft_cfg = replace(base, **{"logging.run_dir": str(Path(run_dir) / "sft"), "optim.lr": 2e-3})
    grpo_cfg = replace(base, **{"logging.run_dir": str(Path(run_dir) / "grpo")})
    ses = open_session(sft_cfg, need_target=True)
    model, tok = ses.model, ses.tokenizer
    ses._sampler = sampler_factory(model, tok) if sampler_factory else None
    kind = "Qwen3.5-style hybrid" if hybrid else "Qwen3-MoE" if model.config.moe is not None else "Qwen3"
    echo(f"rlfuse demo ({size}): tiny {kind} model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
         f"{model.config.num_hidden_layers} layers) on {ses.device}, 2-digit addition, run folder {run_dir}")
    t_sft = time.perf_counter()
    sft, dev_acc = sft_warm_up(ses, sft_cfg, max_new_tokens=base.grpo.max_new_tokens)
    t_sft = time.perf_counter() - t_sft
    # the warm-up's accuracy checks into the SFT run's metrics, so that the report plots them
    # (initial = the last step: a RunLog continuing the run keeps every row up to it)
    dev_log = RunLog(sft_cfg.logging.run_dir, tensorboard=False, progress=False, initial=sft["steps"])
    for step, acc in dev_acc:
        dev_log.log(step, {"dev/accuracy": acc}, stage="sft")
    dev_log.close()
    echo(f"SFT warm-up: {sft['steps']} steps in {t_sft:.0f} s, training-problem accuracy "
         f"{dev_acc[-1][1] if dev_acc else float('nan'):.3f} (stops at {SFT_TARGET})")
    return grpo_after_warm_up(grpo_cfg, ses, sft, dev_acc, t_sft=t_sft, t0=t0, echo=echo)


def grpo_after_warm_up(grpo_cfg: RunConfig, ses, sft: dict, dev_acc: list, *, t_sft: float, t0: float, echo=print,
                       items: str = "problems", sampled_eval: int = 0) -> dict:
    """GRPO on the warmed-up model of `ses` (same tensors, same engine); returns the demo's
    accuracies (the first and last held-out evaluation), timings and histories, and echoes
    the summary line (`items`: what the held-out set holds). `sampled_eval` > 0: the held-out
    accuracy is also measured before and after GRPO at grpo.temperature, that many samples
    per problem (`accuracy_sampled_sft`, `accuracy_sampled_grpo`): the expected reward GRPO
    maximizes, where greedy accuracy is a knife edge (docs/vision.md, "The demo")."""
    grpo_ses = open_session(grpo_cfg, model=ses.model, tokenizer=ses.tokenizer, sampler=ses.sampler)

    def sampled_accuracy():
        acc = evaluate(grpo_ses.sampler, grpo_ses.eval_prompts(), grpo_ses.rewards(),
                       max_new_tokens=grpo_cfg.grpo.max_new_tokens, temperature=grpo_cfg.grpo.temperature,
                       samples=sampled_eval)["accuracy"]
        grpo_ses.sampler.sleep()
        return acc

    sampled_before = sampled_accuracy() if sampled_eval else None
    t_grpo = time.perf_counter()
    res = run_grpo(grpo_cfg, session=grpo_ses)
    t_grpo = time.perf_counter() - t_grpo
    sampled_after = sampled_accuracy() if sampled_eval else None
    before, after = res["evals"][0], res["evals"][-1]
    out = {"accuracy_sft": before["accuracy"], "accuracy_grpo": after["accuracy"],
           "eval_problems": int(before["num_problems"]), "sft_steps": sft["steps"], "grpo_steps": grpo_cfg.grpo.steps,
           "time_sft_s": t_sft, "time_grpo_s": t_grpo, "time_total_s": time.perf_counter() - t0,
           "grpo_history": res["history"], "sft_dev_accuracy": dev_acc}
    if sampled_eval:
        out.update(accuracy_sampled_sft=sampled_before, accuracy_sampled_grpo=sampled_after,
                   sampled_eval=sampled_eval)
        echo(f"held-out accuracy ({out['eval_problems']} {items}, {sampled_eval} samples each at temperature "
             f"{grpo_cfg.grpo.temperature:g}): after SFT {sampled_before:.3f} -> after GRPO "
             f"{out['accuracy_sampled_grpo']:.3f} ({out['accuracy_sampled_grpo'] - sampled_before:+.3f})")
    echo(f"held-out accuracy ({out['eval_problems']} {items}, greedy): after SFT {out['accuracy_sft']:.3f} -> "
         f"after GRPO {out['accuracy_grpo']:.3f} ({out['accuracy_grpo'] - out['accuracy_sft']:+.3f}); "
         f"GRPO {grpo_cfg.grpo.steps} steps in {t_grpo:.0f} s; total {out['time_total_s']:.0f} s")
    return out

