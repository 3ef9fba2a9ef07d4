"""Gated RMSNorm, the Triton half: the forward kernel, its launcher and the autograd
Function (contract and cast order: `rlfuse.kernels.gated_delta.gated_norm`).

Forward: tiles of ROWS x BLOCK_D (both from D only), each row reduced by the RMSNorm
kernels' `mean_square`, the casts of HF's order done by explicit rounding (`round_to`, so
the CPU interpreter rounds like the GPU). Backward: one kernel for dx and dz, with
per-program dw partial sums that torch adds in order (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.norm.triton_rms import mean_square
from rlfuse.kernels.triton_common import round_to

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit(do_not_specialize=["N"])
def _gated_norm_fwd_kernel(X, Z, W, Y, N, D, sx, HZ, sz, szh, sy, eps, PT: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """Row r of z at (r // HZ) sz + (r % HZ) szh: a (T, H, D) z read by its own strides (HZ = H)
    or a (N, D) one (HZ = 1)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    XT: tl.constexpr = X.dtype.element_ty
    x = tl.load(X + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Z + ((rows // HZ) * sz + (rows % HZ) * szh)[:, None] + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(mean_square(x, D) + eps)
    # n.to(x.dtype), then weight * n in torch's promoted dtype PT, then * silu(z) in fp32
    p = round_to(w[None, :] * round_to(x * r[:, None], XT), PT)
    y = p * (z * tl.sigmoid(z))
    tl.store(Y + rows[:, None] * sy + cols[None, :], round_to(y, XT).to(XT), mask=mask)


@triton.jit(do_not_specialize=["N"])
def _gated_norm_bwd_kernel(X, Z, W, DY, DX, DZ, DWP, N, D, sx, sz, sdy, eps, PT: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK_D: tl.constexpr, STEPS: tl.constexpr):
    """With n = x r (r = rsqrt(mean(x^2) + eps)), s = silu(z), p = w n (rounded as forward):
    dz = dy p silu'(z), dn = dy s w, dx = r (dn - n mean(dn n)); this program's partial sum
    of dw = sum_rows dy s rnd(n) over its ROWS * STEPS rows. The casts are straight-through."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    XT: tl.constexpr = X.dtype.element_ty
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for st in range(STEPS):
        rows = (pid * STEPS + st).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        mask = (rows < N)[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        z = tl.load(Z + rows[:, None] * sz + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * sdy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(mean_square(x, D) + eps)
        n = x * r[:, None]
        nr = round_to(n, XT)
        p = round_to(w[None, :] * nr, PT)
        sg = tl.sigmoid(z)
        s = z * sg
        dz = dy * p * sg * (1.0 + z * (1.0 - sg))
        dn = dy * s * w[None, :]
        dx = r[:, None] * (dn - n * (tl.sum(dn * n, 1) / D)[:, None])
        dw += tl.sum(dy * s * nr, 0)
        tl.store(DX + rows[:, None] * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DZ + rows[:, None] * D + cols[None, :], dz.to(DZ.dtype.element_ty), mask=mask)
    tl.store(DWP + pid * D + cols, dw, mask=cmask)


def _tile(D: int):
    BLOCK_D = triton.next_power_of_2(D)
    return BLOCK_D, max(1, min(16, 4096 // BLOCK_D))  # from D only: a row's reduction never depends on N


BWD_STEPS = 16  # row tiles per backward program: dw partials of up to 256 rows


def gated_norm_fwd(x, z, weight, eps: float):
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if z.dim() == 3 and z.stride(-1) == 1:  # (T, H, D) by its strides: e.g. the fused in_proj's z slice, no copy
        z2, hz, sz, szh = z, z.shape[1], z.stride(0), z.stride(1)
    else:
        z2 = z.reshape(-1, D)
        z2 = z2 if z2.stride(-1) == 1 else z2.contiguous()
        hz, sz, szh = 1, z2.stride(0), 0
    N = x2.shape[0]
    y = torch.empty((N, D), dtype=x.dtype, device=x.device)
    if N:
        BLOCK_D, ROWS = _tile(D)
        _gated_norm_fwd_kernel[(triton.cdiv(N, ROWS),)](
            x2, z2, weight, y, N, D, x2.stride(0), hz, sz, szh, y.stride(0), eps,
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
        x, z, weight = ctx.saved_tensors
        D = x.shape[-1]
        x2, z2, dy2 = (t.reshape(-1, D) for t in (x, z, dy))
        x2, z2, dy2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x2, z2, dy2))
        N = x2.shape[0]
        BLOCK_D, ROWS = _tile(D)
        nprog = max(1, triton.cdiv(N, ROWS * BWD_STEPS))
        dx = torch.empty((N, D), dtype=x.dtype, device=x.device)
        dz = torch.empty((N, D), dtype=z.dtype, device=x.device)
        dwp = torch.zeros(nprog, D, dtype=torch.float32, device=x.device)
        if N:
            _gated_norm_bwd_kernel[(nprog,)](
                x2, z2, weight, dy2, dx, dz, dwp, N, D, x2.stride(0), z2.stride(0), dy2.stride(0), ctx.eps,
                PT=_TL[torch.promote_types(weight.dtype, x.dtype)], ROWS=ROWS, BLOCK_D=BLOCK_D, STEPS=BWD_STEPS)
        return dx.view(x.shape), dz.view(z.shape), dwp.sum(0).to(weight.dtype), None


def gated_rmsnorm(x, z, weight, eps: float):
    """The Triton path of `rlfuse.kernels.gated_delta.gated_norm.gated_rmsnorm`."""
    return _GatedRMSNorm.apply(x, z, weight, eps)
