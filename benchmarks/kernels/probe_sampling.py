"""Sampler histogram sweep (GPU, diagnostic): K1's per-chunk histogram (NB bins of width
1 / W_INV nats, BLOCK_H elements a step) at B = 256, V = 151936, on bench_sampling's Zipf
logits, filtered settings only. For each setting: ids == the sort-based reference, the
whole call under CUDA-graph replay (median, L2 flushed), and each kernel's time from the
profiler (eager calls).
    OUT=./out python benchmarks/kernels/probe_sampling.py
Writes $OUT/probe_sampling.json.
"""

import json
import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from _timing import graphed, median_seconds
from bench_sampling import params, zipf_logits
from rlfuse.kernels import sampling as S

OUT = Path(os.environ.get("OUT", "./out"))
B = 256
# (NB, W_INV, BLOCK_H); the first is the setting timed at commit 17fac60
VARIANTS = [(256, 8.0, 8192), (128, 4.0, 8192), (64, 2.0, 8192), (64, 2.0, 4096), (64, 2.0, 16384),
            (64, 4.0, 8192), (32, 1.0, 8192), (32, 2.0, 8192)]
CASES = [("typical", 1.5, torch.float32, 50, 1.0), ("typical", 1.5, torch.float32, 0, 0.9),
         ("typical", 1.5, torch.float32, 50, 0.9), ("typical", 1.5, torch.bfloat16, 0, 0.9),
         ("flat", 1.2, torch.float32, 0, 0.9), ("flat", 1.2, torch.float32, 50, 1.0)]


def kernel_us(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        name = ev.key
        if name.startswith("_") and "kernel" in name:
            dev = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            out[name] = round(dev / reps, 1)
    return out


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    res = dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get("RLFUSE_COMMIT", "?"), rows=[])
    saved = (S._NB, S._W_INV, S._BLOCK_H)
    refs = {}
    for dist, a, dtype, k, p in CASES:
        logits = zipf_logits(B, a, dtype)
        prm = params(B, k, p)
        refs[(dist, dtype, k, p)] = (logits, prm, S.sample_ref(logits, *prm)[0])
    for nb, w_inv, block_h in VARIANTS:
        S._NB, S._W_INV, S._BLOCK_H = nb, w_inv, block_h
        for (dist, dtype, k, p), (logits, prm, ref_ids) in refs.items():
            ids, _, thr = S.sample_triton(logits, *prm, return_threshold=True)
            row = dict(NB=nb, W_INV=w_inv, BLOCK_H=block_h, dist=dist, dtype=str(dtype).split(".")[-1],
                       top_k=k, top_p=p, ids_equal_ref=bool(torch.equal(ids, ref_ids)),
                       graph_ms=1e3 * median_seconds(graphed(lambda: S.sample_triton(logits, *prm)),  # noqa: B023
                                                     30, flush_l2=True),
                       kernels_us=kernel_us(lambda: S.sample_triton(logits, *prm)))  # noqa: B023
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    S._NB, S._W_INV, S._BLOCK_H = saved
    (OUT / "probe_sampling.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
