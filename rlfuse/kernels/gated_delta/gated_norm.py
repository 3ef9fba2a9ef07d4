"""Gated RMSNorm (Qwen3.5's norm on the linear-attention output): HF `Qwen3_5RMSNormGated`.

Contract: gated_rmsnorm(x, z, weight, eps): x, z (..., D), weight (D,); output in x.dtype:
  n = x.float() * rsqrt(mean(x.float()^2) + eps)     (fp32, per row)
  y = (weight * n.to(x.dtype)) * silu(z.float())     (torch's promotion, then fp32)
  return y.to(x.dtype)
the casts in HF's order, so fp32 results match transformers bit for bit. Row-wise, each
row reduced in an order fixed by D (Triton tile) or by halving (exact torch reference),
so a row's bits never depend on the other rows. Tests:
`python -m pytest -q tests/test_kernel_gated_delta_layers.py`.
"""

from __future__ import annotations

import torch

from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.invariant import pairwise_sum, pointwise


def gated_rmsnorm_ref(x, z, weight, eps: float, exact=None):
    exact = is_exact() if exact is None else exact
    xf = x.float() if x.dtype != torch.float64 else x
    zf = z.float() if z.dtype != torch.float64 else z
    if exact:
        var = pairwise_sum(xf * xf, -1)[..., None] / x.shape[-1]
        n = xf * pointwise(torch.rsqrt, var + eps)
        gate = pointwise(torch.nn.functional.silu, zf)
    else:
        n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        gate = torch.nn.functional.silu(zf)
    return ((weight * n.to(x.dtype)) * gate).to(x.dtype)


def gated_rmsnorm(x, z, weight, eps: float):
    """Public op: picks the backend."""
    if z.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"gated_rmsnorm: x and z must share a shape (..., D) and weight be (D,); got x "
                         f"{tuple(x.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)}")
    if resolve_backend("gated_rmsnorm", x) == "triton":
        return triton_ops("gated_delta.triton_gated_norm").gated_rmsnorm(x, z, weight, eps)
    return gated_rmsnorm_ref(x, z, weight, eps)
