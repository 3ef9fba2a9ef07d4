"""SwiGLU: y = silu(gate) * up, elementwise, in the input dtype (as `transformers`
computes `act_fn(gate_proj(x)) * up_proj(x)`). Batch-invariant (elementwise)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlfuse.kernels.backend import resolve_backend


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


_HAS_TRITON = False


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if resolve_backend("swiglu", gate, has_triton=_HAS_TRITON) == "triton":
        raise NotImplementedError
    return swiglu_ref(gate, up)
