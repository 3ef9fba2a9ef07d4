"""The MoE combine's forward, the Triton kernel (the math is in
`rlfuse.kernels.moe.combine`'s docstring): out[t] = rnd(sum_j w[t, j] ys[slot_pos[t, j]])."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.triton_common import round_to

_BLOCK_N = 256  # columns a program; a small elementwise pass, not tuned


@triton.jit(do_not_specialize=['T'])  # token counts vary per step: one compile
def _combine_kernel(YS, W, POS, OUT, T, N, sys, sout, TOPK: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for j in tl.static_range(TOPK):  # the slots in order, left to right
        row = tl.load(POS + t * TOPK + j)
        w = tl.load(W + t * TOPK + j)
        y = tl.load(YS + row * sys + cols, mask=ok, other=0.0).to(tl.float32)
        acc += w * y
    DT = OUT.dtype.element_ty
    tl.store(OUT + t * sout + cols, round_to(acc, DT).to(DT), mask=ok)


def combine_fwd(ys: torch.Tensor, weights: torch.Tensor, slot_pos: torch.Tensor) -> torch.Tensor:
    T, k = slot_pos.shape
    N = ys.shape[1]
    ys = ys if ys.stride(-1) == 1 else ys.contiguous()
    out = torch.empty((T, N), dtype=ys.dtype, device=ys.device)
    if T:
        _combine_kernel[(T, triton.cdiv(N, _BLOCK_N))](ys, weights.contiguous(), slot_pos.contiguous(), out, T, N,
                                                       ys.stride(0), out.stride(0), TOPK=k, BLOCK_N=_BLOCK_N,
                                                       num_warps=4)
    return out
