"""GRPO step on a Qwen3-0.6B-shaped random model (GPU), and optionally the demo on the GPU.

Step benchmark: hidden 1024, 28 layers, 16 q / 8 kv heads, head_dim 128, vocab 151936,
tied, bf16 params (fp32 masters in the optimizer); 8 prompts x 8 completions, prompts of
128 random ids, up to 1024 new tokens (a random model almost never emits EOS, so ~1024),
temperature 1. Reward: share of even token ids (any reward with variance works here).
Three GRPO steps; the first is a warm-up (CUDA graph capture, Triton compilation) and is
reported separately. Per step: time split generate / score / train, rollout and training
tokens/s, peak memory, rollout-vs-trainer log-prob mismatch.

    OUT=out python benchmarks/bench_grpo_step.py            # step benchmark
    OUT=out python benchmarks/bench_grpo_step.py --demo     # + `rlfuse demo --size gpu`
    OUT=out python benchmarks/bench_grpo_step.py --numerics both --fuse both   # fused projections off / on
    python benchmarks/bench_grpo_step.py --small            # CPU smoke test (tiny model)
Writes $OUT/bench_grpo_step.json and $OUT/bench_grpo_step.md (a table for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REWARD = "def even(prompts, completions, completion_ids, **kw):\n" \
         "    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]\n"

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                 rope_theta=1e6, tie_word_embeddings=True)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True)


def step_bench(out: Path, small: bool, numerics: str = "fast", fuse: bool = True, warm: bool = False) -> list[dict]:
    from rlfuse.data.prompts import Prompt, PromptStream
    from rlfuse.rollout.rewards import RewardSet
    from rlfuse.rollout.sampler import EngineSampler
    from rlfuse.run.build import build_engine, build_model, char_tokenizer
    from rlfuse.run.config.run_config import load_config
    from rlfuse.train.grpo import GRPOTrainer
    from rlfuse.train.sft import make_optimizer

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    (out / "reward_even.py").write_text(REWARD)
    P, G, new, plen = (8, 8, 1024, 128) if not small else (2, 4, 16, 16)
    cfg = load_config({
        "model": {"random_init": SMALL if small else QWEN3_06B, "dtype": "bfloat16" if dev.type == "cuda" else "float32",
                  "gradient_checkpointing": True},
        "engine": ({"gpu_memory_fraction": 0.85} if dev.type == "cuda" else {"max_num_seqs": 16}) | {"numerics": numerics, "fuse_projections": fuse},
        "rewards": [{"name": f"{out}/reward_even.py:even"}],
        "optim": {"lr": 1e-6, "schedule": "constant"},
        "grpo": {"steps": 3, "prompts_per_step": P, "group_size": G, "max_new_tokens": new, "temperature": 1.0,
                 "loss_type": "dapo", "micro_batch_tokens": 16384 if not small else 256, "warm_kernels": warm},
        "logging": {"run_dir": str(out / "grpo_step"), "tensorboard": False, "progress": False},
    })
    tok = char_tokenizer("abc")  # only for decoding text; prompts are token ids
    model = build_model(cfg.model, tok, dev, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    prompts = [Prompt(torch.randint(0, 10000 if not small else 500, (plen,), generator=gen).tolist(), "", {}, f"p{i}")
               for i in range(64)]
    opt = make_optimizer(model, cfg)
    sampler = EngineSampler(build_engine(model, tok, cfg.engine), tok)
    tr = GRPOTrainer(cfg, model, sampler, RewardSet(cfg.rewards), PromptStream(prompts, seed=0), opt)
    rows = []
    for step in range(3):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        m = tr.step(step)
        wall = time.perf_counter() - t0
        row = {"numerics": numerics, "fused": fuse, "step": step, "warmup": step == 0, "wall_s": wall, "params_M": n_params / 1e6,
               **{k: float(v) for k, v in m.items() if k.startswith(("time/", "tokens_per_s/", "memory/", "mismatch/",
                                                                        "completion_len/", "loss", "grad_norm",
                                                                        "compile/"))}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    sampler.llm.sleep()
    del tr, sampler, opt, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def demo_bench(out: Path) -> dict:
    run_dir = out / "demo"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sys; from rlfuse.cli import main; sys.exit(main())",
                    "demo", "--size", "gpu", "--run-dir", str(run_dir)], check=True)
    res = json.loads((run_dir / "demo.json").read_text())
    res["wall_s"] = time.perf_counter() - t0
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", action="store_true", help="also run `rlfuse demo --size gpu`")
    ap.add_argument("--small", action="store_true", help="tiny model, CPU-sized (smoke test)")
    ap.add_argument("--numerics", choices=("fast", "exact", "both"), default="fast",
                    help="engine.numerics of the step; both: fast then exact in one process (side by side)")
    ap.add_argument("--fuse", choices=("on", "off", "both"), default="on",
                    help="engine.fuse_projections (q/k/v and gate/up as one GEMM each); both: off then on")
    ap.add_argument("--warm-kernels", action="store_true",
                    help="grpo.warm_kernels true: compile the update's kernels in worker processes during the "
                         "first rollout (an A/B of the first step's time: run each in a fresh process on a cold "
                         "TRITON_CACHE_DIR)")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    commit = os.environ.get("RLFUSE_COMMIT") or subprocess.run(  # run_gpu.sh sets it
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"gpu": gpu, "torch": torch.__version__, "commit": commit, "small": args.small,
              "steps": [r for n in (("fast", "exact") if args.numerics == "both" else (args.numerics,))
                        for f in ((False, True) if args.fuse == "both" else (args.fuse == "on",))
                        for r in step_bench(out, args.small, n, f, warm=args.warm_kernels)]}
    (out / "bench_grpo_step.json").write_text(json.dumps(result, indent=2))  # kept if the demo fails
    if args.demo:
        try:
            result["demo"] = demo_bench(out)
        except (subprocess.CalledProcessError, OSError, ValueError) as e:
            result["demo_error"] = repr(e)
            print(f"demo failed: {e!r}", file=sys.stderr)
            args.demo = False
        (out / "bench_grpo_step.json").write_text(json.dumps(result, indent=2))
    shape = "tiny (smoke)" if args.small else "Qwen3-0.6B-shaped random, bf16, 8 prompts x 8, 128-token prompts, <=1024 new"
    lines = [f"### GRPO step: {shape}", f"GPU {gpu}, torch {torch.__version__}, commit {commit}, "
             f"command `python benchmarks/bench_grpo_step.py{' --demo' if args.demo else ''} --numerics {args.numerics} "
             f"--fuse {args.fuse}`", "",
             "| numerics | fused | step | generate s | score s | train s | step s | rollout tok/s | train tok/s | peak MiB | "
             "mean new tokens | max abs dlogp |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["steps"]:
        lines.append(f"| {r['numerics']} | {'yes' if r['fused'] else 'no'} | {r['step']}{' (warm-up)' if r['warmup'] else ''} | {r['time/generate']:.2f} | "
                     f"{r['time/score']:.2f} | {r['time/train']:.2f} | {r['time/step']:.2f} | "
                     f"{r['tokens_per_s/rollout']:.0f} | {r['tokens_per_s/train']:.0f} | {r['memory/peak_mb']:.0f} | "
                     f"{r['completion_len/mean']:.0f} | {r['mismatch/max_abs']:.2e} |")
    if args.demo:
        d = result["demo"]
        lines += ["", f"Demo (`rlfuse demo --size gpu`): held-out accuracy after SFT {d['accuracy_sft']:.3f} -> "
                      f"after GRPO {d['accuracy_grpo']:.3f} on {d['eval_problems']} problems; SFT {d['sft_steps']} "
                      f"steps {d['time_sft_s']:.0f} s, GRPO {d['grpo_steps']} steps {d['time_grpo_s']:.0f} s, "
                      f"total {d['time_total_s']:.0f} s"]
    md = "\n".join(lines) + "\n"
    (out / "bench_grpo_step.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
