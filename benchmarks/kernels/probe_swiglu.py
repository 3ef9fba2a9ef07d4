"""SwiGLU tile sweep (GPU, diagnostic): the forward and backward kernels at Qwen3-0.6B's
MLP width over BLOCK x num_warps, next to torch.compile of the reference in the same run,
and whether compile's output is bitwise eager's (ours is, by construction).
    OUT=./out python benchmarks/kernels/probe_swiglu.py
Writes $OUT/probe_swiglu.json.
"""

import json
import os
from pathlib import Path

import torch
import triton

from _timing import median_seconds
from rlfuse.kernels import swiglu as S

OUT = Path(os.environ.get("OUT", "./out"))
T, F = 16384, 3072
REPS = 40


def t_us(fn):
    return 1e6 * median_seconds(fn, REPS, flush_l2=True)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    g = torch.randn(T, F, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(T, F, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, F, device="cuda", dtype=torch.bfloat16)
    n = g.numel()
    y, dg, du = torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)
    comp = torch.compile(S.swiglu_ref, dynamic=False)
    eager = S.swiglu_ref(g, u)
    res = dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get("RLFUSE_COMMIT", "?"),
               compile_fwd_us=t_us(lambda: comp(g, u)), eager_fwd_us=t_us(lambda: S.swiglu_ref(g, u)),
               compile_bitwise_eager=bool(torch.equal(comp(g, u), eager)),
               ours_bitwise_eager=bool(torch.equal(S.swiglu_fwd_triton(g, u), eager)), rows=[])
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            if block // (32 * warps) < 1:
                continue
            grid = (triton.cdiv(n, block),)
            f = t_us(lambda: S._swiglu_fwd_kernel[grid](g, u, y, n, BLOCK=block, num_warps=warps))
            b = t_us(lambda: S._swiglu_bwd_kernel[grid](dy, g, u, dg, du, n, BLOCK=block, num_warps=warps))
            res["rows"].append(dict(block=block, warps=warps, fwd_us=f, bwd_us=b))
            print(f"BLOCK={block:5d} warps={warps:2d}  fwd {f:7.1f} us  bwd {b:7.1f} us", flush=True)
    (OUT / "probe_swiglu.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
