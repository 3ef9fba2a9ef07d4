"""Sampling latency: the Triton sampler vs the sort-based PyTorch reference.

Batch 32/64/128/256 x V = 151936 (Qwen vocabulary), fp32 and bf16 logits, four filter
settings (T = 1): none, top-p 0.9, top-k 50, top-k 50 + top-p 0.9. Logits are Zipf-like,
logit = -a log(rank) over a random permutation of the vocabulary (seed 0):
    a = 1.5: entropy 3.2 nats, top-p 0.9 keeps ~57 tokens    ("typical" next token)
    a = 1.2: entropy 5.6 nats, top-p 0.9 keeps ~3600 tokens  ("flat": the bisection path)
Each call is timed alone with CUDA events after an L2 flush (median of --reps), eagerly
and as a CUDA-graph replay (no launch overhead: the GPU time). The bound is one read
of the logits at the device-copy bandwidth measured in the same run,
bound = B V bytes / (copy GB/s), copy GB/s = (read + write bytes) / time of a 1 GiB copy.
Target: < 0.3 ms at batch 256.

Run on the GPU box:  OUT=./out python benchmarks/kernels/bench_sampling.py [--quick]
Writes $OUT/bench_sampling.json and $OUT/bench_sampling.md (a table for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import torch
from _timing import graphed, median_seconds  # benchmarks/kernels/_timing.py (the script's directory)

from rlfuse.engine.benchmark import copy_bandwidth
from rlfuse.kernels.sampling.draw import sample_ref
from rlfuse.kernels.sampling.triton_draw import sample_triton

V = 151936
SETTINGS = {"none": (0, 1.0), "top-p 0.9": (0, 0.9), "top-k 50": (50, 1.0), "top-k 50 + top-p 0.9": (50, 0.9)}
def bench(fn, reps: int) -> float:
    """Median seconds of one call, L2 flushed before each (a 256 MiB write)."""
    return median_seconds(fn, reps, flush_l2=True)


def zipf_logits(B: int, a: float, dtype) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    rank = torch.rand(B, V, device="cuda", generator=g).argsort(dim=1).argsort(dim=1) + 1
    return (-a * rank.float().log()).to(dtype)


def params(B: int, k: int, p: float):
    dev = "cuda"
    return (torch.ones(B, device=dev), torch.full((B,), k, device=dev, dtype=torch.int64),
            torch.full((B,), p, device=dev), torch.zeros(B, device=dev),
            torch.arange(B, device=dev, dtype=torch.int64) + 1234, torch.full((B,), 77, device=dev, dtype=torch.int64))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="batch 256 only, fewer reps")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    reps = 10 if args.quick else args.reps
    batches = [256] if args.quick else [32, 64, 128, 256]
    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth(torch.device("cuda"), 1 << 30) / 1e9
    print(f"{gpu}: device copy {bw:.0f} GB/s", flush=True)
    rows = []
    for a, dist in ((1.5, "typical"), (1.2, "flat")):
        for dtype in (torch.float32, torch.bfloat16):
            for B in batches:
                logits = zipf_logits(B, a, dtype)
                bound = logits.numel() * logits.element_size() / (bw * 1e9)
                for name, (k, p) in SETTINGS.items():
                    prm = params(B, k, p)
                    ids, _, thr = sample_triton(logits, *prm, return_threshold=True)
                    kept = (logits.float() >= thr[:, None]).sum(1).float().median().item()
                    ours = bench(lambda: sample_triton(logits, *prm), reps)  # noqa: B023
                    ours_graph = bench(graphed(lambda: sample_triton(logits, *prm)), reps)  # noqa: B023
                    ref = bench(lambda: sample_ref(logits, *prm), max(3, reps // 3))  # noqa: B023
                    r = dict(dist=dist, dtype=str(dtype).split(".")[-1], B=B, setting=name,
                             kept_median=kept if name != "none" else V, ours_ms=ours * 1e3,
                             ours_graph_ms=ours_graph * 1e3, ref_ms=ref * 1e3, bound_ms=bound * 1e3,
                             ids_equal_ref=bool(torch.equal(ids, sample_ref(logits, *prm)[0])))
                    rows.append(r)
                    print(f"{dist:8s} {r['dtype']:9s} B={B:<4d} {name:22s} kept~{r['kept_median']:>8.0f}  "
                          f"ours {r['ours_ms']:7.3f} ms (graph {r['ours_graph_ms']:7.3f})  ref {r['ref_ms']:8.3f} ms  "
                          f"bound {r['bound_ms']:6.3f} ms  ids==ref {r['ids_equal_ref']}", flush=True)
                logits = None  # freed before the next batch size (not `del`: the timed lambdas above close over the name)
                torch.cuda.empty_cache()
    commit = os.environ.get("RLFUSE_COMMIT") or subprocess.run(  # run_gpu.sh sets it
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = dict(gpu=gpu, torch=torch.__version__, commit=commit, copy_GBps=bw, V=V,
                command="python benchmarks/kernels/bench_sampling.py" + (" --quick" if args.quick else ""))
    (out / "bench_sampling.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    md = [f"### Sampling, V={V}, T=1 ({gpu}, torch {torch.__version__}, commit {commit})", "",
          f"`{meta['command']}`; device copy {bw:.0f} GB/s; bound = one read of the logits.", "",
          "| logits | dtype | B | filter | kept (median) | ours ms | ours graph ms | sort ref ms | bound ms | ids = ref |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['dist']} | {r['dtype']} | {r['B']} | {r['setting']} | {r['kept_median']:.0f} | {r['ours_ms']:.3f} | "
           f"{r['ours_graph_ms']:.3f} | {r['ref_ms']:.3f} | {r['bound_ms']:.3f} | {r['ids_equal_ref']} |" for r in rows]
    (out / "bench_sampling.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    worst = max((r["ours_graph_ms"] for r in rows if r["B"] == 256 and r["dist"] == "typical"), default=0)
    print(f"batch 256 (typical logits), worst setting: {worst:.3f} ms graph replay (target < 0.3 ms)")


if __name__ == "__main__":
    main()
