"""Where the fused log-prob's forward+backward time goes, and which tiles help (GPU,
diagnostic). At N = 16384 rows (G = 32 x 512), bf16, Qwen3-0.6B and Llama-3-8B LM-head
dims, times each stage alone -- forward (fold = group path), the backward's dz kernel,
dH = dz @ W (cuBLAS), the dW accumulation (cuBLAS) -- over a few tile shapes each, next to cuBLAS doing
the same logits GEMM (fp32 out) as the matmul ceiling for these shapes.
    OUT=./out python benchmarks/kernels/probe_logprob.py
Writes $OUT/probe_logprob.json.
"""

import json
import os
from pathlib import Path

import torch

from _timing import median_seconds
from rlfuse.kernels import logprob as lp
from rlfuse.kernels.logprob import Tiles

OUT = Path(os.environ.get("OUT", "./out"))
N = 16384
SHAPES = [(1024, 151936), (4096, 128256)]
FWD = [Tiles(block_n=128, block_v=256, num_warps=8), Tiles(block_n=128, block_v=256, num_warps=8, num_stages=4),
       Tiles(block_n=128, block_v=256, block_d=32, num_warps=8, num_stages=5),
       Tiles(block_n=256, block_v=128, num_warps=8, num_stages=4), Tiles(block_n=128, block_v=128, num_warps=4)]
DZ = [Tiles(block_n=128, block_v=256, num_warps=8), Tiles(block_n=128, block_v=256, num_warps=8, num_stages=4),
      Tiles(block_n=128, block_v=256, block_d=32, num_warps=8, num_stages=5),
      Tiles(block_n=256, block_v=128, num_warps=8, num_stages=4)]


def tf(flop, s):
    return flop / s / 1e12


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    res = dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get("RLFUSE_COMMIT", "?"), rows=[])
    a = torch.zeros(4, 8, dtype=torch.bfloat16, device="cuda")
    c = torch.zeros(4, 4, dtype=torch.float32, device="cuda")
    try:
        torch.addmm(c, a, a.t(), out_dtype=torch.float32)
        res["addmm_out_dtype"] = True
    except Exception as e:
        res["addmm_out_dtype"] = repr(e)[:200]
    print("addmm out_dtype:", res["addmm_out_dtype"], flush=True)

    def row(**kw):
        res["rows"].append(kw)
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()), flush=True)

    for D, V in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(N, D, device="cuda", generator=g).bfloat16()
        w = (torch.randn(V, D, device="cuda", generator=g) * D ** -0.5).bfloat16()
        y = torch.randint(0, V, (N,), device="cuda", generator=g)
        flop = 2 * N * V * D
        inv_t = torch.tensor(1.0)
        s = median_seconds(lambda: torch.mm(h, w.t(), out_dtype=torch.float32), 5)
        row(D=D, stage="cublas logits fp32-out", ms=s * 1e3, TFLOPs=tf(flop, s))
        s = median_seconds(lambda: torch.mm(h, w.t()), 5)
        row(D=D, stage="cublas logits bf16-out", ms=s * 1e3, TFLOPs=tf(flop, s))
        for t in FWD:
            try:
                s = median_seconds(lambda: lp.token_logprobs_fwd_triton(h, w, y, inv_t, tiles=t), 5)
                row(D=D, stage="fwd", tiles=str(t), ms=s * 1e3, TFLOPs=tf(flop, s))
            except Exception as e:
                row(D=D, stage="fwd", tiles=str(t), error=repr(e)[:150])
        _, _, lse = lp.token_logprobs_fwd_triton(h, w, y, inv_t)
        glp = torch.randn(N, device="cuda")
        dz = torch.empty(N, V, dtype=torch.bfloat16, device="cuda")
        for t in DZ:
            def go():
                lp._dz_kernel[(triton_cdiv(N, t.block_n) * triton_cdiv(V, t.block_v),)](
                    h, w, y, None, lse, None, glp, None, dz, 0, N, V, D, 1.0,
                    h.stride(0), h.stride(1), w.stride(0), w.stride(1), dz.stride(0),
                    PER_ROW_T=False, HAS_GLP=True, HAS_GENT=False,
                    BLOCK_N=t.block_n, BLOCK_V=t.block_v, BLOCK_D=t.block_d, EVEN_D=D % t.block_d == 0,
                    GROUP_R=8, DOT_PREC="tf32", num_warps=t.num_warps, num_stages=t.num_stages)
            try:
                s = median_seconds(go, 5)
                row(D=D, stage="dz", tiles=str(t), ms=s * 1e3, TFLOPs=tf(flop, s))
            except Exception as e:
                row(D=D, stage="dz", tiles=str(t), error=repr(e)[:150])
        dh = torch.empty(N, D, dtype=torch.bfloat16, device="cuda")
        s = median_seconds(lambda: torch.mm(dz, w, out=dh), 5)
        row(D=D, stage="dH cublas", ms=s * 1e3, TFLOPs=tf(flop, s))
        s = median_seconds(lambda: torch.mm(dz.t(), h, out_dtype=torch.float32), 5)
        row(D=D, stage="dW cublas fp32-out (no accumulate)", ms=s * 1e3, TFLOPs=tf(flop, s))
        dw = torch.zeros(V, D, dtype=torch.float32, device="cuda")
        s = median_seconds(lambda: lp._accumulate_dw(dw, dz, h, first=False), 5)
        row(D=D, stage="dW accumulate (cuBLAS addmm fp32 out)", ms=s * 1e3, TFLOPs=tf(flop, s))
        del h, w, dz, dw, dh
        torch.cuda.empty_cache()
    (OUT / "probe_logprob.json").write_text(json.dumps(res, indent=1))


def triton_cdiv(a, b):
    return -(-a // b)


if __name__ == "__main__":
    main()
