"""RMSNorm tile sweep (GPU, diagnostic): forward and backward at Qwen3-0.6B's two widths
(D = 1024 hidden norms with 4096 and T rows, D = 128 per-head q norm with 4 T and 16 T rows), over rows per
tile x warps (and programs per SM for the backward), next to torch.compile of the
reference, all under CUDA-graph replay (no host time). `--profile` instead lists the
kernels of one forward + backward (ours through the public op, and torch.compile's) with
their GPU times from the profiler, at the small row counts where compile is ahead.
    OUT=./out python benchmarks/kernels/probe_rmsnorm.py [--profile]
Writes $OUT/probe_rmsnorm.json (or probe_rmsnorm_profile.json).
"""

import json
import os
import sys
from pathlib import Path

import torch
import triton

from _timing import graphed, kernel_times_us, median_seconds
from rlfuse.kernels import rmsnorm as R
from rlfuse.kernels import use_backend

OUT = Path(os.environ.get("OUT", "./out"))
T = 16384


def graph_us(fn, reps=40):
    return 1e6 * median_seconds(graphed(fn), reps, flush_l2=True)


def profile_main():
    OUT.mkdir(parents=True, exist_ok=True)
    res = dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get("RLFUSE_COMMIT", "?"), rows=[])
    comp = torch.compile(R.rmsnorm_ref, dynamic=False)

    def ours(x, w):
        with use_backend("triton"):
            return R.rmsnorm(x, w, 1e-6)

    for D, N in ((1024, 4096), (1024, 16384), (128, 65536), (128, 262144)):
        x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        for name, fn in (("triton", ours), ("compile", lambda x, w: comp(x, w, 1e-6))):
            ks = kernel_times_us(lambda: torch.autograd.grad(fn(x, w), (x, w), dy))  # noqa: B023
            row = dict(D=D, N=N, impl=name, total_us=round(sum(k[1] for k in ks), 2), kernels=ks)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    # the dw partial sum alone: (P, BLOCK_D) fp32 partials -> (D,) bf16, P = 8 an SM
    P = 8 * torch.cuda.get_device_properties(0).multi_processor_count
    for D in (1024, 128):
        part = torch.randn(P, D, device="cuda")
        out = torch.empty(D, device="cuda", dtype=torch.bfloat16)
        row = dict(P=P, D=D, torch_sum_cast_us=graph_us(lambda: part.sum(0).to(torch.bfloat16)))  # noqa: B023
        for cols in (8, 16, 32):
            for block_p in (128, 512, 1024):
                for warps in (4, 8):
                    row[f"c{cols}_p{block_p}_w{warps}"] = graph_us(
                        lambda: R._dw_sum_kernel[(triton.cdiv(D, cols),)](  # noqa: B023
                            part, out, P, D, BLOCK_D=D, COLS=cols, BLOCK_P=block_p, num_warps=warps))  # noqa: B023
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    (OUT / "probe_rmsnorm_profile.json").write_text(json.dumps(res, indent=1))


def main():
    if "--profile" in sys.argv:
        return profile_main()
    OUT.mkdir(parents=True, exist_ok=True)
    res = dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get("RLFUSE_COMMIT", "?"), rows=[])
    tile0, parts0 = R._tile, R._num_partials
    for D, N in ((1024, 4096), (1024, T), (128, 4 * T), (128, 16 * T)):
        x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(D, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        comp = torch.compile(R.rmsnorm_ref, dynamic=False)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        res["rows"].append(dict(D=D, N=N, impl="compile", fwd_us=graph_us(lambda: comp(x, w, 1e-6)),
                                fwdbwd_us=graph_us(lambda: torch.autograd.grad(comp(xg, wg, 1e-6), (xg, wg), dy))))
        print(res["rows"][-1], flush=True)
        _, r = R.rmsnorm_fwd_triton(x, w, 1e-6)
        bd = triton.next_power_of_2(D)
        for rows in ((1, 2, 4, 8) if D > 128 else (4, 8, 16, 32)):
            for warps in (1, 2, 4, 8):
                if rows * bd > 16384 or rows * bd < 32 * warps:
                    continue
                R._tile = lambda D_, backward=False, rows=rows, warps=warps: (bd, rows, warps)
                row = dict(D=D, N=N, rows=rows, warps=warps)
                try:
                    row["fwd_us"] = graph_us(lambda: R.rmsnorm_fwd_triton(x, w, 1e-6, store_r=False))
                    for per_sm in (4, 8):
                        R._num_partials = lambda N_, rows_, dev, k=per_sm: max(1, min(triton.cdiv(N_, rows_), k * 132))
                        row[f"bwd_us_{per_sm}sm"] = graph_us(lambda: R.rmsnorm_bwd_triton(dy, x, w, r))
                except Exception as e:  # shared memory / registers: report and go on
                    row["error"] = repr(e)[:120]
                finally:
                    R._num_partials = parts0
                res["rows"].append(row)
                print(row, flush=True)
        R._tile = tile0
        del x, dy
        torch.cuda.empty_cache()
    (OUT / "probe_rmsnorm.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
