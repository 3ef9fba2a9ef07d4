"""RMSNorm as a module: alone, or with the residual add fused into its kernel."""

from __future__ import annotations

import torch
from torch import nn

from rlfuse.kernels.norm.rms import add_rmsnorm, rmsnorm


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
