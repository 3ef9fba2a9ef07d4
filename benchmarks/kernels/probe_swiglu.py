"""SwiGLU tile sweep (GPU, diagnostic): the forward and backward kernels at Qwen3-0.6B's
MLP width over BLOCK x num_warps, next to torch.compile of the reference in the same run,
and whether compile's output is bitwise eager's (ours is, by construction). `--math` instead
times the kernels' math variants at a few tiles: IEEE divisions (the shipped kernels) vs
Triton's default fp32 division (div.full, ~2 ulp) vs the MUFU reciprocal, with how many
outputs differ from eager's and the largest error against float64.
    OUT=./out python benchmarks/kernels/probe_swiglu.py [--math]
Writes $OUT/probe_swiglu.json.
"""

import json
import os
import sys
from pathlib import Path

import torch
import triton

from _timing import median_seconds
import triton.language as tl

from rlfuse.kernels import swiglu as S
from rlfuse.kernels._triton_common import round_to

OUT = Path(os.environ.get("OUT", "./out"))
T, F = 16384, 3072
REPS = 40


def t_us(fn):
    return 1e6 * median_seconds(fn, REPS, flush_l2=True)


@triton.jit
def _recip(x, MATH: tl.constexpr):  # 1 / x: 0 IEEE, 1 Triton's default division, 2 MUFU approx
    if MATH == 0:
        r = tl.math.div_rn(1.0, x)
    elif MATH == 1:
        r = 1.0 / x
    else:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    return r


@triton.jit
def _fwd_var(G_ptr, U_ptr, Y_ptr, N, BLOCK: tl.constexpr, MATH: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(G_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + offs, mask=mask, other=0.0)
    DT: tl.constexpr = U_ptr.dtype.element_ty
    if MATH == 0:
        s = round_to(tl.math.div_rn(g, 1.0 + tl.exp(-g)), DT)
    else:
        s = round_to(g * _recip(1.0 + tl.exp(-g), MATH), DT)
    tl.store(Y_ptr + offs, round_to(s * u.to(tl.float32), DT).to(DT), mask=mask)


@triton.jit
def _bwd_var(DY_ptr, G_ptr, U_ptr, DG_ptr, DU_ptr, N, BLOCK: tl.constexpr, MATH: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dy = tl.load(DY_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    DT: tl.constexpr = U_ptr.dtype.element_ty
    sig = _recip(1.0 + tl.exp(-g), MATH)
    s = round_to(g * sig, DT)
    du = round_to(dy * s, DT)
    t = round_to(dy * u, DT)
    dg = round_to(t * (sig * (1.0 + g * (1.0 - sig))), DT)
    tl.store(DU_ptr + offs, du.to(DT), mask=mask)
    tl.store(DG_ptr + offs, dg.to(DT), mask=mask)


def _inputs():
    """(gate, up, dy, numel, y, dgate, dup) at T x F bf16; makes $OUT."""
    OUT.mkdir(parents=True, exist_ok=True)
    g, u, dy = (torch.randn(T, F, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return g, u, dy, g.numel(), torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)


def math_variants():
    g, u, dy, n, y, dg, du = _inputs()
    eager = S.swiglu_ref(g, u)
    gold = (torch.nn.functional.silu(g.double()) * u.double())
    comp = torch.compile(S.swiglu_ref, dynamic=False)
    res = dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get("RLFUSE_COMMIT", "?"),
               compile_fwd_us=t_us(lambda: comp(g, u)), rows=[])
    gd, ud = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    res["compile_fwdbwd_us"] = t_us(lambda: torch.autograd.grad(comp(gd, ud), (gd, ud), dy))
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
    for math in (0, 1, 2):
        for block, warps in ((1024, 8), (1024, 4), (2048, 4), (2048, 8)):
            grid = (triton.cdiv(n, block),)
            f = t_us(lambda: _fwd_var[grid](g, u, y, n, BLOCK=block, MATH=math, num_warps=warps))
            b = t_us(lambda: _bwd_var[grid](dy, g, u, dg, du, n, BLOCK=block, MATH=math, num_warps=warps))
            _fwd_var[grid](g, u, y, n, BLOCK=block, MATH=math, num_warps=warps)
            row = dict(math=["ieee", "div.full", "rcp.approx"][math], block=block, warps=warps,
                       fwd_us=f, bwd_us=b, fwd_differs_from_eager=int((y != eager).sum()),
                       fwd_max_abs_err_vs_f64=float((y.double() - gold).abs().max()),
                       eager_max_abs_err_vs_f64=float((eager.double() - gold).abs().max()))
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    (OUT / "probe_swiglu_math.json").write_text(json.dumps(res, indent=1))


def main():
    if "--math" in sys.argv:
        return math_variants()
    g, u, dy, n, y, dg, du = _inputs()
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
            f = t_us(lambda: S._swiglu_fwd_kernel[grid](g, u, y, n, BLOCK=block, EVEN=True, num_warps=warps))
            b = t_us(lambda: S._swiglu_bwd_kernel[grid](dy, g, u, dg, du, n, BLOCK=block, EVEN=True, num_warps=warps))
            res["rows"].append(dict(block=block, warps=warps, fwd_us=f, bwd_us=b))
            print(f"BLOCK={block:5d} warps={warps:2d}  fwd {f:7.1f} us  bwd {b:7.1f} us", flush=True)
    (OUT / "probe_swiglu.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
