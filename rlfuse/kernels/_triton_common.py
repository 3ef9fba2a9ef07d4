"""Small Triton helpers shared by several kernels (one op per file keeps its own math)."""

import triton
import triton.language as tl


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
