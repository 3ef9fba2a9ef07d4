"""The gated MLP (SwiGLU): down(silu(gate(x)) * up(x)), gate and up as two GEMMs or one
fused GEMM (`rlfuse.model.fuse`). An MoE block replaces it per layer (the architecture's
`mlp` builder) with the same forward(x (T, D)) -> (T, D)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from rlfuse.kernels.activation.glu import swiglu, swiglu_packed
from rlfuse.model.layers.linear import Linear

if TYPE_CHECKING:
    from rlfuse.model.config import ModelConfig


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        """intermediate_size: the width, if not the config's (an MoE block's shared expert)."""
        super().__init__()
        inter = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = Linear(cfg.hidden_size, inter, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, inter, bias=cfg.mlp_bias)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_fused = None  # gate/up as one GEMM: set by rlfuse.model.fuse (a plain attribute, no state)

    def forward(self, x):
        if self.gate_up_fused is not None and self.gate_up_fused.live(self):
            return self.down_proj(swiglu_packed(self.gate_up_fused(x)))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
