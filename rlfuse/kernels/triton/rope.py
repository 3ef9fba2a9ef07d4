"""Rotary position embedding, the Triton kernel (forward and backward are one kernel;
the math and the layout are in `rlfuse.kernels.rope`'s docstring)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.triton.common import round_to


@triton.jit(do_not_specialize=['T', 'HPP'])  # vary per step: one compile
def _rope_kernel(X_ptr, Y_ptr, P_ptr, F_ptr, T, H, HPP, stride_xt, stride_xh, stride_yt, stride_yh,
                 HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
                 BACKWARD: tl.constexpr):
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    fr = tl.arange(0, BLOCK_F)
    tmask = toks < T
    mask = tmask[:, None] & (fr[None, :] < HALF)
    # 1. angles in fp32, exactly as the reference: float(pos) * inv_freq
    pos = tl.load(P_ptr + toks, mask=tmask, other=0).to(tl.float32)
    inv = tl.load(F_ptr + fr, mask=fr < HALF, other=0.0)
    ang = pos[:, None] * inv[None, :]  # (BLOCK_T, BLOCK_F)
    cos = tl.cos(ang)
    sin = tl.sin(ang)
    if BACKWARD:
        sin = -sin
    DT: tl.constexpr = Y_ptr.dtype.element_ty
    xo = toks[:, None] * stride_xt + fr[None, :]
    yo = toks[:, None] * stride_yt + fr[None, :]
    # 2. heads [h0, h0 + HPP) of these tokens with the same cos/sin
    h0 = tl.program_id(1) * HPP
    for h in range(h0, tl.minimum(h0 + HPP, H)):
        x1 = tl.load(X_ptr + xo + h * stride_xh, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X_ptr + xo + h * stride_xh + HALF, mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        tl.store(Y_ptr + yo + h * stride_yh, round_to(y1, DT).to(DT), mask=mask)
        tl.store(Y_ptr + yo + h * stride_yh + HALF, round_to(y2, DT).to(DT), mask=mask)


# 16 tokens a program: with HALF = 64 a (16, 64) tile per half and head, and the cos/sin
# (the costly part, libdevice sin/cos) computed once per token for HPP heads. HPP = all
# heads when there are enough token blocks to fill the GPU (training); fewer when not, so
# that a decode step's few tokens still spread over the SMs. Every element is computed the
# same way whatever HPP: batch invariance holds.
_BLOCK_T = 16        # tokens a program


_MIN_PROGRAMS = 512  # programs to aim for (~4 per SM on an H100); a guess, not timed on its own


def rope_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                backward: bool = False) -> torch.Tensor:
    if x.dim() != 3 or x.shape[-1] % 2 or inv_freq.numel() * 2 != x.shape[-1]:
        raise ValueError(f"rope: x must be (T, H, Dh) with Dh = 2 * len(inv_freq), got "
                         f"{tuple(x.shape)} and inv_freq {tuple(inv_freq.shape)}")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"rope: positions must be ({x.shape[0]},), got {tuple(positions.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, H, Dh = x.shape
    y = torch.empty((T, H, Dh), dtype=x.dtype, device=x.device)
    if T and H:
        half = Dh // 2
        nt = triton.cdiv(T, _BLOCK_T)
        hpp = triton.cdiv(H, min(H, triton.cdiv(_MIN_PROGRAMS, nt)))
        _rope_kernel[(nt, triton.cdiv(H, hpp))](
            x, y, positions.contiguous(), inv_freq.float().contiguous(), T, H, hpp,
            x.stride(0), x.stride(1), y.stride(0), y.stride(1),
            HALF=half, BLOCK_T=_BLOCK_T, BLOCK_F=triton.next_power_of_2(half),
            BACKWARD=backward, num_warps=4)
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, inv_freq):
        ctx.save_for_backward(positions, inv_freq)
        return rope_triton(x, positions, inv_freq)

    @staticmethod
    def backward(ctx, dy):
        positions, inv_freq = ctx.saved_tensors
        return rope_triton(dy, positions, inv_freq, backward=True), None, None


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The op on the Triton backend (autograd where a gradient is needed)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rope.apply(x, positions, inv_freq)
    return rope_triton(x, positions, inv_freq)
