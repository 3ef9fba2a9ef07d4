"""The `kinds2` phase of bench_multi_gpu.py (issue 39, "every trainer and rollout kind under
torchrun"): the kinds that had not run on GPUs, each on 1 GPU and on --kinds-gpus N, same
global batch and seed, bf16, engine.numerics exact, 3 steps, final save.

  dpo_precompute, dpo_live  `rlfuse dpo` on work/pairs.jsonl (128-letter prompts, 64-letter
          chosen / rejected), 8 pairs a step, dpo.reference precompute / live
  env     `rlfuse grpo` with rollout.env (work/env.py: Echo, three turns, letter observations)
  tools   `rlfuse grpo` with rollout.tools [calculator] (the random model's calls are mostly
          malformed: a tool error is an observation too)
  (env and tools: the character chat tokenizer's vocabulary, not the shape's)
  vision  `rlfuse grpo` on image rows (builtin:count_squares; the tiny Qwen3-VL of
          rlfuse.recipes.vision_demo, tower trained: its own FSDP2 group)
  api     benchmarks/multi_gpu_api_job.py: `GRPOTrainer` with the rows in memory,
          `trainer.generate` (greedy) before and after training; the texts compared too
The multi-turn kinds leave out of the comparison what is per rank by design (MULTI_TURN_SKIP).
The run phase's former `dpo_2gpu` job (DPO refused under torchrun) is replaced by these.

Jobs share a pool of --kinds-slots GPUs (default: every visible GPU; --small: N), each on
its own GPUs (CUDA_VISIBLE_DEVICES): the 1-GPU references first, side by side, then the
N-GPU runs as GPUs free up (two at once when N is half the pool). 12 jobs: on 4 GPUs
18 GPU-jobs at N = 2 (about 5 job-lengths of wall), 30 at N = 4 (about 8).

    OUT=out python3 benchmarks/bench_multi_gpu.py kinds2 --kinds-gpus 2
    OUT=/tmp/k2out python3 benchmarks/bench_multi_gpu.py kinds2 --small --kinds-gpus 2 --work /tmp/k2work
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from multi_gpu_jobs import (
    COMMON_SHAPE,
    SHAPES,
    SMALL,
    TINY,
    Jobs,
    metric_diff,
    metrics,
    print_equivalence,
    recipe,
    weight_diff,
)

from rlfuse.recipes.vision_demo import VLM

HERE = Path(__file__).resolve().parent
# by design not the one-process numbers (tests/test_distributed_kinds.py's TIMED): each rank's
# engine waits for its own episodes (idle fraction), caches only its own episodes' prefixes,
# runs its own environment threads; the trained-token fraction is a ratio of per-rank sums
MULTI_TURN_SKIP = ("rollout/engine_idle_frac", "rollout/continuation_cached_frac", "rollout/trained_frac",
                   "rollout/env_workers")


# per kind, a metric showing the kind did its thing (printed per step, 1 GPU / N GPUs)
EVIDENCE = {"dpo_precompute": "rewards/margin", "dpo_live": "rewards/margin", "env": "rollout/turns_mean",
            "tools": "rollout/tool_calls_per_episode", "vision": "vision/encodes", "api": "reward/mean"}


def kinds2_recipes(work: Path) -> dict[str, tuple[str, Path, tuple[str, ...]]]:
    """name -> (stage, recipe, metric prefixes not compared)."""
    common = dict(numerics="exact", save_final=True)
    grpo = dict(common, prompts=8, group=4, new=64)
    turns = dict(max_turn_tokens=8 if SMALL[0] else 32, max_total_tokens=512)
    # tokenizer char: the rows' letters, and for episodes the compact chat template (rlfuse.train.session);
    # the vocabulary the tokenizer's (not the shape's 151936): a random model then samples the tool-call
    # scaffolding tokens, so the calculator gets calls (mostly malformed: the observation says so)
    chat = {"tokenizer": "char", "random_init": {k: v for k, v in (TINY if SMALL[0] else SHAPES["0.6b"] | COMMON_SHAPE)
                                                 .items() if k != "vocab_size"}}
    return {
        **{f"dpo_{ref}": ("dpo", recipe(work, f"k2_dpo_{ref}", "dpo", prompts=8, dpo={"reference": ref}, **common), ())
           for ref in ("precompute", "live")},
        "env": ("grpo", recipe(work, "k2_env", "grpo", model=chat, grpo={"check_every": 1},
                               rollout={"env": f"{work}/env.py:Echo", **turns}, **grpo), MULTI_TURN_SKIP),
        "tools": ("grpo", recipe(work, "k2_tools", "grpo", model=chat, grpo={"check_every": 1},
                                 rollout={"tools": ["calculator"], "max_turns": 3, **turns}, **grpo), MULTI_TURN_SKIP),
        # 40-token prompts (16 image tokens) + 8 new: inside the tiny VLM's 64 positions
        "vision": ("grpo", recipe(work, "k2_vision", "grpo", **dict(grpo, new=8), grpo={"check_every": 1},
                                  model={"random_init": VLM, "tokenizer": "char", "train_vision": True,
                                         "processor": {"min_pixels": 1024, "max_pixels": 1024}},
                                  data={"train": "builtin:count_squares", "train_size": 256, "eval_size": 8,
                                        "max_prompt_len": 40}), ()),
        "api": ("grpo", recipe(work, "k2_api", "grpo", grpo={"check_every": 1}, **grpo), ()),
    }


def _argv(J: Jobs, work: Path, name: str, stage: str, cfg: Path, run_dir: Path, gpus: int) -> list[str]:
    if name == "api":
        return J.script_argv(HERE / "multi_gpu_api_job.py", gpus, str(cfg), "--run-dir", str(run_dir),
                             "--rows-file", str(work / "prompts.jsonl"), "--max-tokens", "8" if SMALL[0] else "32")
    return J.argv(stage, cfg, run_dir, gpus, "--overwrite")  # a rerun in the same --work replaces its folder


def run_pool(J: Jobs, jobs: list[tuple[str, list[str], int]], slots: int, timeout: float) -> None:
    """Run (name, argv, gpus) jobs on a pool of `slots` GPUs: whenever GPUs are free, start the
    first waiting jobs that fit (each on its own GPU indices); a job past `timeout` is stopped
    by `Jobs.wait`, which also records every result."""
    todo, running, free = list(jobs), [], list(range(slots))
    if any(g > slots for _, _, g in todo):
        raise SystemExit(f"kinds2: a job needs {max(g for _, _, g in todo)} GPUs, --kinds-slots is {slots}")
    while todo or running:
        for job in list(todo):
            if job[2] <= len(free):
                ids, free = free[:job[2]], free[job[2]:]
                running.append((J.start(job[0], job[1], gpu=",".join(map(str, ids)), timeout=timeout), ids))
                todo.remove(job)
        done = [(h, ids) for h, ids in running  # h: Jobs.start's (name, argv, process, log, t0, timeout)
                if h[2] is None or h[2].poll() is not None or time.perf_counter() > h[4] + h[5]]
        for h, ids in done:
            J.wait(h)
            running.remove((h, ids))
            free += ids
        if not done:
            time.sleep(0.5)


def _texts(run_dir: Path) -> dict:
    p = run_dir / "generated.json"
    return json.loads(p.read_text()) if p.exists() else {}


def phase_kinds2(out: Path, work: Path, args) -> dict:
    J = Jobs(work, out, "kinds2")
    n = args.kinds_gpus
    slots = args.kinds_slots or (n if SMALL[0] else _device_count())
    kinds = kinds2_recipes(work)
    jobs = [(f"{k}_{g}gpu", _argv(J, work, k, stage, cfg, work / f"k2_{k}{g}", g), g)
            for g in (1, n) for k, (stage, cfg, _) in kinds.items()]
    run_pool(J, jobs, slots, args.job_timeout)
    eq, extra = {}, {}
    for k, (stage, _, skip) in kinds.items():
        one, many = work / f"k2_{k}1", work / f"k2_{k}{n}"
        eq[k] = {**metric_diff(metrics(many, stage), metrics(one, stage), skip=skip),
                 "weights": weight_diff(many / "final", one / "final")}
        key = EVIDENCE[k]
        vals = [[r.get(key) for r in metrics(d, stage)] for d in (one, many)]
        extra[k] = f"{key} per step {vals[0]} / {vals[1]}"
    a, b = _texts(work / "k2_api1"), _texts(work / f"k2_api{n}")
    gen = {when: f"{sum(x == y for x, y in zip(a.get(when, []), b.get(when, [])))}/{len(a.get(when, []))} equal"
           for when in ("before", "after")}
    eq["api"]["generated"] = {**gen, "texts_1gpu": a, f"texts_{n}gpu": b}
    extra["api"] += f"; trainer.generate texts (greedy), 1 vs {n} GPUs: before training {gen['before']}, " \
                   f"after {gen['after']}"
    J.finish({"equivalence": eq, "gpus": n, "slots": slots})
    print_equivalence(J, eq, n, extra)
    return eq


def _device_count() -> int:
    import torch

    return max(torch.cuda.device_count(), 1)
