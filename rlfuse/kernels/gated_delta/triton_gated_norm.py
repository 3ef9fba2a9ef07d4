"""Gated RMSNorm, the Triton half: the forward kernel, its launcher and the autograd
Function (contract and cast order: `rlfuse.kernels.gated_delta.gated_norm`).

Forward: tiles of ROWS x BLOCK_D (both from D only), each row reduced by the RMSNorm
kernels' `mean_square`, the casts of HF's order done by explicit rounding (`round_to`, so
the CPU interpreter rounds like the GPU). Backward: NOT a Triton kernel; the Function
recomputes the PyTorch reference under autograd (fast numerics) and differentiates it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.gated_delta.gated_norm import gated_rmsnorm_ref
from rlfuse.kernels.triton.common import round_to
from rlfuse.kernels.triton.rmsnorm import mean_square

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit(do_not_specialize=["N"])
def _gated_norm_fwd_kernel(X, Z, W, Y, N, D, sx, sz, sy, eps, PT: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    XT: tl.constexpr = X.dtype.element_ty
    x = tl.load(X + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Z + rows[:, None] * sz + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(mean_square(x, D) + eps)
    # n.to(x.dtype), then weight * n in torch's promoted dtype PT, then * silu(z) in fp32
    p = round_to(w[None, :] * round_to(x * r[:, None], XT), PT)
    y = p * (z * tl.sigmoid(z))
    tl.store(Y + rows[:, None] * sy + cols[None, :], round_to(y, XT).to(XT), mask=mask)


def gated_norm_fwd(x, z, weight, eps: float):
    D = x.shape[-1]
    x2, z2 = x.reshape(-1, D), z.reshape(-1, D)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    z2 = z2 if z2.stride(-1) == 1 else z2.contiguous()
    N = x2.shape[0]
    y = torch.empty((N, D), dtype=x.dtype, device=x.device)
    if N:
        BLOCK_D = triton.next_power_of_2(D)
        ROWS = max(1, min(16, 4096 // BLOCK_D))  # from D only: a row's reduction never depends on N
        _gated_norm_fwd_kernel[(triton.cdiv(N, ROWS),)](
            x2, z2, weight, y, N, D, x2.stride(0), z2.stride(0), y.stride(0), eps,
            PT=_TL[torch.promote_types(weight.dtype, x.dtype)], ROWS=ROWS, BLOCK_D=BLOCK_D)
    return y.view(x.shape)


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, weight, eps):
        ctx.save_for_backward(x, z, weight)
        ctx.eps = eps
        return gated_norm_fwd(x, z, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        # recompute the reference under autograd and differentiate it (module docstring)
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            y = gated_rmsnorm_ref(*leaves, ctx.eps, exact=False)
            need = [t for t in leaves if t.requires_grad]
            got = iter(torch.autograd.grad(y, need, dy) if need else ())
        return (*[next(got) if t.requires_grad else None for t in leaves], None)


def gated_rmsnorm(x, z, weight, eps: float):
    """The Triton path of `rlfuse.kernels.gated_delta.gated_norm.gated_rmsnorm`."""
    return _GatedRMSNorm.apply(x, z, weight, eps)
