"""Streaming GRPO (`grpo.overlap: stream`) against sync on a heavy-tailed length workload.

The engine benchmark's Qwen3-0.6B shape (rlfuse.engine.benchmark.QWEN3_06B, 8K context),
random weights, bf16 (fp32 masters), gradient checkpointing; 8 prompts x 8 completions,
prompts of 128 random ids. Random weights never stop on their own, so each completion
stops at a length drawn in advance (`LengthsSampler`, EOS ignored): lognormal around 180
tokens (most stop at 100-300), and 1 in 16 runs to 4096 (seed 1: 4 of the 64, in groups 1,
2, 3 and 6, so half the groups finish early and train beside the tail, half at the end). Loss grpo (sequence mean: the
bitwise path), micro-batches of 16384 tokens. One trainer per mode on the same model,
engine and optimizer; per numerics: a sync warm-up step (graph capture, compilation),
then sync and stream steps alternated. Per step: step / generate / post-rollout train
time, the overlap fraction (training time spent while the engine decoded / all training
time), the training work's own time, peak memory, the KV pool and the memory beside it.
How much each side slows the other: stream's generate time against sync's (decode slowed
by the training kernels) and stream's training time against sync's.

    OUT=out python benchmarks/bench_stream.py              # GPU, fast and exact (~2 min on an H100)
    OUT=out python benchmarks/bench_stream.py --inline     # + stream mode without the thread / side stream
    python benchmarks/bench_stream.py --small              # CPU smoke test (tiny model, seconds)
Writes $OUT/bench_stream.json and $OUT/bench_stream.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from rlfuse.engine.benchmark import QWEN3_06B

SHAPE = QWEN3_06B | dict(max_position_embeddings=8192)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True)
REWARD = "def even(prompts, completions, completion_ids, **kw):\n" \
         "    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]\n"
KEYS = ("time/step", "time/generate", "time/score", "time/train", "stream/overlap_frac", "stream/train_s",
        "stream/grad_slots_max", "memory/peak_mb", "memory/kv_pool_mb", "memory/train_headroom_mb",
        "memory/grad_slots_peak_mb", "completion_len/mean", "completion_len/max", "tokens_per_s/rollout")


def heavy_tail(max_len: int, typical: int, long_every: int, seed: int = 0):
    """length(i, k): 1 in `long_every` completions runs to max_len, the rest lognormal
    around `typical` (sigma 0.5: most within typical / 1.8 .. typical * 1.8)."""
    def length(i: int, k: int) -> int:
        r = random.Random(seed * 1_000_003 + 1000 * i + k)
        if r.random() < 1 / long_every:
            return max_len
        return max(1, min(max_len, round(math.exp(r.gauss(math.log(typical), 0.5)))))
    return length


def run(out: Path, small: bool, numerics: str, steps: int, inline: bool = False) -> list[dict]:
    from rlfuse.data.prompts import Prompt, PromptStream
    from rlfuse.rollout import LengthsSampler, RewardSet
    from rlfuse.run.build import build_engine, build_model, char_tokenizer
    from rlfuse.run.config.run_config import load_config
    from rlfuse.train.grpo import GRPOStep
    from rlfuse.train.loop import make_optimizer

    dev = torch.device("cuda" if torch.cuda.is_available() and not small else "cpu")
    (out / "reward_even.py").write_text(REWARD)
    P, G, new, plen, typical, mbt = (8, 8, 4096, 128, 180, 16384) if not small else (4, 4, 64, 8, 6, 256)

    def cfg(overlap):
        return load_config({
            "model": {"random_init": SMALL if small else SHAPE, "device": dev.type, "gradient_checkpointing": not small,
                      "dtype": "bfloat16" if dev.type == "cuda" else "float32"},
            # the KV pool stays allocated while stream mode trains: leave room beside it
            "engine": ({"gpu_memory_fraction": 0.45} if dev.type == "cuda" else {"max_num_seqs": 64})
                      | {"numerics": numerics},
            "rewards": [{"name": f"{out}/reward_even.py:even"}],
            "optim": {"lr": 1e-6, "schedule": "constant"},
            "grpo": {"steps": 2 * steps + 1, "prompts_per_step": P, "group_size": G, "max_new_tokens": new,
                     "loss_type": "grpo", "micro_batch_tokens": mbt, "overlap": overlap},
            "logging": {"run_dir": str(out / f"stream_{numerics}"), "tensorboard": False, "progress": False},
        })
    c_sync, c_stream = cfg("sync"), cfg("stream")
    tok = char_tokenizer("abc")  # decodes text only; prompts are token ids
    model = build_model(c_sync.model, tok, dev, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [Prompt(torch.randint(0, SHAPE["vocab_size"] if not small else 500, (plen,), generator=gen).tolist(),
                      "", {}, f"p{i}") for i in range(P)]
    opt = make_optimizer(model, c_sync)  # before the engine: its KV plan counts the optimizer's memory
    sampler = LengthsSampler(build_engine(model, tok, c_sync.engine), tok, heavy_tail(new, typical, 16, seed=1))
    rewards = RewardSet(c_sync.rewards)
    modes = ("sync", "stream") + (("inline",) if inline else ())
    trainers = {mode: GRPOStep(c_sync if mode == "sync" else c_stream, model, sampler, rewards,
                                  PromptStream(prompts, seed=0, shuffle=False), opt) for mode in modes}
    if inline:  # stream mode with the training between engine steps on the engine's own stream
        trainers["inline"].streamer.threaded = False
    order = ["sync"] + list(modes) * steps  # the first: warm-up
    rows = []
    for step, mode in enumerate(order):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        m = trainers[mode].step(step)
        row = {"numerics": numerics, "mode": mode, "step": step, "warmup": step == 0, "wall_s": time.perf_counter() - t0,
               **{k: float(m[k]) for k in KEYS if k in m}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    sampler.llm.sleep()
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per numerics: mean over the timed steps of each mode, and stream's speed-up."""
    out = []
    for n in dict.fromkeys(r["numerics"] for r in rows):
        mean = {mode: {k: sum(r[k] for r in rs) / len(rs) for k in rs[0] if isinstance(rs[0][k], float)}
                for mode in ("sync", "stream", "inline")
                if (rs := [r for r in rows if r["numerics"] == n and r["mode"] == mode and not r["warmup"]])}
        s, t = mean["sync"], mean["stream"]
        out.append({"numerics": n, **mean, "speedup": s["time/step"] / t["time/step"],
                    "decode_slowdown": t["time/generate"] / s["time/generate"],
                    "train_slowdown": t["stream/train_s"] / max(s["time/train"], 1e-9)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model on CPU (smoke test)")
    ap.add_argument("--numerics", choices=("fast", "exact", "both"), default="both")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per mode (after one warm-up)")
    ap.add_argument("--inline", action="store_true", help="also stream mode with the training between engine "
                    "steps on one stream (no worker thread): what interleaving alone gives")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.small else "cpu"
    commit = os.environ.get("RLFUSE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = [r for n in (("fast", "exact") if args.numerics == "both" else (args.numerics,))
            for r in run(out, args.small, n, args.steps, args.inline)]
    result = {"gpu": gpu, "torch": torch.__version__, "commit": commit, "small": args.small, "steps": rows,
              "summary": summary(rows)}
    (out / "bench_stream.json").write_text(json.dumps(result, indent=2))
    shape = "tiny (smoke)" if args.small else "Qwen3-0.6B-shaped random, bf16, 8 prompts x 8, 128-token prompts, " \
                                              "lengths lognormal ~180, 1 in 16 at 4096"
    lines = [f"### Streaming GRPO: {shape}", f"GPU {gpu}, torch {torch.__version__}, commit {commit}, command "
             f"`python benchmarks/bench_stream.py{' --small' if args.small else ''}`", "",
             "| numerics | mode | step s | generate s | train after rollout s | training work s | overlap | "
             "peak MiB | KV pool MiB | grad slots MiB | speed-up |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["summary"]:
        for mode in (m for m in ("sync", "stream", "inline") if m in s):
            r = s[mode]
            lines.append(f"| {s['numerics']} | {mode} | {r['time/step']:.2f} | {r['time/generate']:.2f} | "
                         f"{r['time/train']:.2f} | {r.get('stream/train_s', r['time/train']):.2f} | "
                         f"{r.get('stream/overlap_frac', 0.0):.2f} | {r['memory/peak_mb']:.0f} | "
                         f"{r.get('memory/kv_pool_mb', float('nan')):.0f} | {r.get('memory/grad_slots_peak_mb', 0.0):.0f} | "
                         f"{s['sync']['time/step'] / r['time/step']:.2f}x |")
    lines += [""] + [f"{s['numerics']}: decode {s['decode_slowdown']:.2f}x sync's generate time under the training "
                     f"kernels; training work {s['train_slowdown']:.2f}x sync's train time" for s in result["summary"]]
    md = "\n".join(lines) + "\n"
    (out / "bench_stream.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
