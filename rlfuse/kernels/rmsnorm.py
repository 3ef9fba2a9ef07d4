"""RMSNorm: y = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)

Contract: x (..., D) any float dtype, w (D,). The reduction runs in fp32; the
normalized row is cast to x.dtype before the multiply by w (the Hugging Face
convention, so our outputs match `transformers` bit for bit in fp32).
Batch-invariant: each row is reduced on its own, in a fixed order.
"""

from __future__ import annotations

import torch

from rlfuse.kernels.backend import resolve_backend


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Public op: picks the backend (see `rlfuse.kernels.backend`)."""
    if resolve_backend("rmsnorm", x, has_triton=_HAS_TRITON) == "triton":
        return _rmsnorm_triton_autograd(x, weight, eps)
    return rmsnorm_ref(x, weight, eps)


_HAS_TRITON = False


def _rmsnorm_triton_autograd(x, weight, eps):  # replaced when the Triton kernel lands
    raise NotImplementedError
