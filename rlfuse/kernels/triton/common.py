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
    interpreter) does not call tl.dot: the interpreter runs it as numpy's matmul, whose
    result for a row depends on the row's place in the tile on some CPUs (OpenBLAS
    micro-kernels), which breaks the batch invariance the exact kernels are tested for; and
    it multiplies bf16 as raw uint16 (Triton 3.9). So the operands go up to fp32 and each
    element sums its fp32 products in k order by itself: the same products, fp32 sums.
    A tile whose (M, K, N) products exceed Triton's largest tensor (2^20 elements) keeps
    tl.dot on fp32 operands (close, not batch-invariant there)."""
    if PREC == "interp":
        if a.shape[0] * a.shape[1] * b.shape[1] <= 1048576:
            prod = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
            if acc is None:
                return prod
            return acc + prod
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
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
