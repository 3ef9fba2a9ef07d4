"""Small Triton helpers shared by several kernels (one op per file keeps its own math)."""

import sys

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


@triton.jit
def round_to(x, DT: tl.constexpr):
    """fp32 x rounded to nearest-even in DT, returned as fp32. bf16 by bit arithmetic:
    Triton's interpreter truncates fp32 -> bf16 casts (the GPU rounds), so the explicit
    rounding gives both the same bits; a later cast to DT is then exact."""
    if DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        return (b & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)


def compiled_variants() -> dict[str, int]:
    """{kernel name: compiled specializations so far} over the loaded
    rlfuse.kernels.triton modules (see `backend.triton_compiles`). Reads Triton's
    per-device kernel cache (first element of each `device_caches` entry in Triton 3.x)."""
    out = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("rlfuse.kernels.triton.") or mod is None:
            continue
        for name, fn in vars(mod).items():
            if isinstance(fn, JITFunction) and getattr(fn, "device_caches", None):
                n = sum(len(c[0]) for c in fn.device_caches.values() if c and isinstance(c[0], dict))
                if n:
                    out[f"{mod_name.rsplit('.', 1)[1]}.{name}"] = n
    return out


@triton.jit
def dot(a, b, acc, PREC: tl.constexpr):
    """acc + a @ b (acc None: a @ b), PREC from `dot_precision`. "interp" (Triton's CPU
    interpreter, where `tl.dot` is numpy's matmul): the operands go up to fp64 (the
    interpreter multiplies bf16 as raw uint16, Triton 3.9), the fp32 x fp32 products are
    exact there and the sums carry 29 more bits than fp32, and the result is rounded to
    fp32. The BLAS under numpy may pick its kernel, and so the sum order, by the tile's
    shape and a row's place in it (seen with OpenBLAS on an AMD EPYC): in fp32 that broke
    the bitwise batch invariance and tile agreement the exact-mode tests check; in fp64 a
    different order changes the fp32 result only when the exact sum lies within ~2^-40 of
    an fp32 rounding boundary."""
    if PREC == "interp":
        out = tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee").to(tl.float32)
        return out if acc is None else acc + out
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


def dot_precision(x: torch.Tensor) -> str:
    """The `dot` PREC for operands like x: "ieee" for fp32 (exact fp32 products, the test
    dtype), "tf32" otherwise (ignored by 16-bit inputs), "interp" off the GPU."""
    if x.device.type != "cuda":
        return "interp"
    return "ieee" if x.dtype == torch.float32 else "tf32"


@triton.jit
def swizzle(pid, R, C, GROUP_R: tl.constexpr):
    """pid -> (r, c) over an R x C tile grid, GROUP_R tile rows at a time, row fastest:
    programs running together share column tiles (same c; the weight in a GEMM) and row
    blocks (same r) in L2."""
    per_group = GROUP_R * C
    first = (pid // per_group) * GROUP_R
    size = tl.minimum(R - first, GROUP_R)
    return first + (pid % per_group) % size, (pid % per_group) // size
