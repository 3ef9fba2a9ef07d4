"""Rotary position embedding, NeoX half-split layout (Llama / Qwen in `transformers`).

For x (T, H, Dh) with halves x1 = x[..., :Dh/2], x2 = x[..., Dh/2:] and angles
a = positions[:, None] * inv_freq[None, :] computed in fp32:
    y1 = x1 cos a - x2 sin a,   y2 = x2 cos a + x1 sin a
Arithmetic in fp32, result cast to x.dtype. `inv_freq` (Dh/2,) fp32 already holds any
frequency scaling (Llama-3 "llama3" rope type): see `rope_inv_freq`.
Batch-invariant: each token uses only its own position.

Triton path: one program per block of BLOCK_T tokens and group of heads computes the
fp32 angles pos * inv_freq in-kernel (the same product as the reference: int position
-> fp32, times fp32 inv_freq) and their cos/sin once, then loops over its heads. The backward is
the same kernel rotating by -a:
    dx1 = dy1 cos a + dy2 sin a,   dx2 = dy2 cos a - dy1 sin a
Output and gradient are new contiguous (T, H, Dh) tensors in x.dtype; x may be any
(T, H, Dh) view with unit stride on the last dim (e.g. q_proj(x).view(T, H, Dh)).
Tests: `python -m pytest -q tests/test_kernel_layers.py -k rope`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rlfuse.kernels._triton_common import round_to
from rlfuse.kernels.backend import is_exact, resolve_backend
from rlfuse.kernels.invariant import pointwise


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) in fp32, with Llama-3 scaling if given.

    `scaling` is the HF `rope_parameters` / `rope_scaling` dict; supported rope types are
    "default" and "llama3" (others raise ValueError naming the type).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r} is not supported (expected 'default' or 'llama3')")
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
             exact: bool = False) -> torch.Tensor:
    # x (T, H, Dh), positions (T,), inv_freq (Dh/2,); exact: cos/sin with every element on
    # one CPU code path (see rlfuse.kernels.invariant), so a token's rotation ignores T
    ang = positions.float()[:, None] * inv_freq.float()[None, :]  # (T, Dh/2)
    cos, sin = (pointwise(torch.cos, ang), pointwise(torch.sin, ang)) if exact else (ang.cos(), ang.sin())
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, Dh/2)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


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
    if resolve_backend("rope", x) == "triton":  # elementwise: batch-invariant in both numerics
        if torch.is_grad_enabled() and x.requires_grad:
            return _Rope.apply(x, positions, inv_freq)
        return rope_triton(x, positions, inv_freq)
    return rope_ref(x, positions, inv_freq, exact=is_exact())
