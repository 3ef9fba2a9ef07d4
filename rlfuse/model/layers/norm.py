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


class OffsetRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: (rmsnorm(x.float()) * (1 + w.float())).to(x.dtype), w init 0.
    Through the rmsnorm kernel on the fp32 row with weight 1 + w: the kernel's cast of the
    normed row to x.dtype is then a no-op, which gives HF's single rounding at the end
    (Llama's RMSNorm rounds x before the multiply)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        """rmsnorm(x); with `residual` h: (h + x, rmsnorm(h + x)) as `RMSNorm`."""
        if residual is not None:
            s = residual + x
            return s, self(s)
        return rmsnorm(x.float(), 1.0 + self.weight.float(), self.eps).to(x.dtype)
