"""The linear layer every architecture uses: nn.Linear's parameters and state-dict names,
its forward through `rlfuse.kernels.linear` (F.linear in fast numerics, batch-invariant in
exact numerics)."""

from __future__ import annotations

from torch import nn

from rlfuse.kernels.linear.gemm import linear


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict names) whose forward goes through
    `rlfuse.kernels.linear.gemm`: F.linear in fast numerics, batch-invariant in exact."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)
