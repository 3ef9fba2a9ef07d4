"""FP8 KV quantization, the Triton half: `to_e4m3`, steps 2-4 of the contract in
`rlfuse.kernels.kv_quant.fp8` (the KV store kernels call it), and a standalone
quantize kernel (the op `quantize_kv` on the Triton backend, what the tests hold against
the reference)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def to_e4m3(x, inv):
    """fp32 x -> float8e4nv: x * inv (inv a power of two: exact), saturated to +-448, rounded
    to nearest-even e4m3. The rounding is bit arithmetic on fp32, so the final cast is
    exact: the GPU's cvt.rn.satfinite would round the same, but Triton 3.9's CPU
    interpreter does not (it rounds fp32 -> fp8 wrongly), and the tests run there.
    Normal range (|y| >= 2^-6): drop 20 of fp32's 23 mantissa bits, ties to even (a carry
    into the exponent is the correct result); subnormal range: (|y| + 2^14) - 2^14 rounds
    to a multiple of 2^-9 (fp32's step at 2^14), nearest-even, the e4m3 subnormal step."""
    y = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
    a = tl.abs(y)
    b = a.to(tl.uint32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    sub = (a + 16384.0) - 16384.0
    r = tl.where(a < 0.015625, sub, normal)
    sign = y.to(tl.uint32, bitcast=True) & 0x80000000
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit(do_not_specialize=['T'])  # varies per call: one compile
def _quantize_kernel(X, Q, INV, T, D, sxt, sxh, sqt, sqh, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    ok = (t < T)[:, None] & (d < D)[None, :]
    x = tl.load(X + t[:, None] * sxt + h * sxh + d[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(Q + t[:, None] * sqt + h * sqh + d[None, :], to_e4m3(x, tl.load(INV + h)), mask=ok)


def quantize_kv_triton(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    T, H, D = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty((T, H, D), dtype=torch.float8_e4m3fn, device=x.device)
    if T:
        block_t = 16
        _quantize_kernel[(triton.cdiv(T, block_t), H)](x, q, inv.float().contiguous(), T, D, x.stride(0),
                                                      x.stride(1), q.stride(0), q.stride(1),
                                                      HEAD_DIM=triton.next_power_of_2(D), BLOCK_T=block_t)
    return q
