"""RMSNorm as a module: alone, or with the residual add fused into its kernel."""

from __future__ import annotations

import torch
from torch import nn

from rlfuse.kernels.norm.rms import add_rmsnorm, offset_rmsnorm, rmsnorm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        """rmsnorm(x); with `residual` h: (h + x, rmsnorm(h + x)), the add in the norm's kernel."""
        if residual is None:
            return rmsnorm(x, self.weight, self.eps)
        return add_rmsnorm(residual, x, self.weight, self.eps)


class OffsetRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: (rmsnorm(x.float()) * (1 + w.float())).to(x.dtype), w init 0:
    HF's single rounding at the end (Llama's RMSNorm rounds x before the multiply). The
    `offset_rmsnorm` op: one kernel with the residual add when no gradient is taken (the
    engine's steps), the composition through the rmsnorm op's autograd otherwise."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        """rmsnorm(x); with `residual` h: (h + x, rmsnorm(h + x)) as `RMSNorm`."""
        return offset_rmsnorm(x, self.weight, self.eps, residual)
