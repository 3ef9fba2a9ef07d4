"""Sampler sweep (GPU, diagnostic): K1's per-chunk histogram (NB bins of width 1 / W_INV
nats), K2b's step (BLOCK_K2 elements, WARPS_K2 warps) K3's all-pairs limit (exh, TB) and
bisection (NP probes x BLOCK_C candidates a step, VS value-space sweeps) at
B = 256, V = 151936, on bench_sampling's Zipf logits, filtered settings only. For each
setting: ids == the sort-based reference, the
whole call under CUDA-graph replay (median, L2 flushed), and each kernel's time from the
profiler (eager calls).
    OUT=./out python benchmarks/kernels/probe_sampling.py
Writes $OUT/probe_sampling.json.
"""

import json
import os
from pathlib import Path

import torch
from _timing import graphed, kernel_times_us, median_seconds
from bench_sampling import params, zipf_logits
from rlfuse.kernels import sampling as S

OUT = Path(os.environ.get("OUT", "./out"))
B = 256
# module constants patched per variant; the first is the module's default
_D = dict(_NB=S._NB, _W_INV=S._W_INV, _BLOCK_K2=S._BLOCK_K2, _WARPS_K2=S._WARPS_K2, _TB=S._TB,
          _NP=S._NP, _BLOCK_C=S._BLOCK_C, _VS=S._VS, _WARPS_K3=S._WARPS_K3, exh=S._EXH)  # exh: sample_triton's keyword (its default is bound at import)
VARIANTS = [_D, {**_D, "_WARPS_K3": 4}, {**_D, "_WARPS_K3": 16}]
# (logits, Zipf exponent, dtype, top_k, top_p, temperature)
CASES = [("typical", 1.5, torch.float32, 50, 1.0, 1.0), ("typical", 1.5, torch.float32, 0, 0.9, 1.0),
         ("typical", 1.5, torch.float32, 50, 0.9, 1.0), ("typical", 1.5, torch.bfloat16, 0, 0.9, 1.0),
         ("typical", 1.5, torch.float32, 0, 0.9, 0.7), ("flat", 1.2, torch.float32, 0, 0.9, 1.0),
         ("flat", 1.2, torch.float32, 50, 1.0, 1.0)]


def kernel_us(fn) -> dict:
    """{sampler kernel: GPU us per call}."""
    return {name: round(us, 1) for name, us, _ in kernel_times_us(fn) if name.startswith("_") and "kernel" in name}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    res = dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get("RLFUSE_COMMIT", "?"), rows=[])
    refs = {}
    for dist, a, dtype, k, p, temp in CASES:
        logits = zipf_logits(B, a, dtype)
        prm = (params(B, k, p)[0] * temp, *params(B, k, p)[1:])
        refs[(dist, dtype, k, p, temp)] = (logits, prm, S.sample_ref(logits, *prm)[0])
    for var in VARIANTS:
        for name, value in var.items():
            if name.startswith("_"):
                setattr(S, name, value)
        kw = dict(exh=var["exh"])
        for (dist, dtype, k, p, temp), (logits, prm, ref_ids) in refs.items():
            ids, _, thr = S.sample_triton(logits, *prm, return_threshold=True, **kw)
            row = dict(**{n.strip("_"): v for n, v in var.items()}, dist=dist, dtype=str(dtype).split(".")[-1],
                       top_k=k, top_p=p, T=temp, ids_equal_ref=bool(torch.equal(ids, ref_ids)),
                       graph_ms=1e3 * median_seconds(graphed(lambda: S.sample_triton(logits, *prm, **kw)),  # noqa: B023
                                                     30, flush_l2=True),
                       kernels_us=kernel_us(lambda: S.sample_triton(logits, *prm, **kw)))  # noqa: B023
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    for name, value in _D.items():
        if name.startswith("_"):
            setattr(S, name, value)
    (OUT / "probe_sampling.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
