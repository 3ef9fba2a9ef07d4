"""SwiGLU: y = silu(gate) * up, elementwise, in the input dtype (as `transformers`
computes `act_fn(gate_proj(x)) * up_proj(x)`). Batch-invariant (elementwise).

Rounding (matches PyTorch eager for bf16/fp16/fp32 up to the last bit of exp):
    s  = rnd(g / (1 + exp(-g)))        fp32 math, rounded to the input dtype (F.silu)
    y  = rnd(s * u)                    fp32 product, rounded (a bf16*bf16 product is exact
                                       in fp32, so this is torch's rounding)
Backward, with sig = 1 / (1 + exp(-g)) and the same roundings autograd applies:
    du = rnd(dy * s)
    dg = rnd(rnd(dy * u) * sig * (1 + g * (1 - sig)))       (torch's silu_backward)

Triton path: one flat 1-D kernel over numel (int64 offsets), BLOCK elements a program;
the backward writes dgate and dup in one pass (reads dy, g, u once). Whole blocks run
without a mask (EVEN) and the remainder in a second launch: numel is not specialized (one
compile for every size), so a mask `offs < N` has unknown alignment and Triton would load
element by element (about 12% slower on an H100, docs/perf-log.md).
`swiglu_packed(gate_up)` is the same op on the two halves of one tensor's last dim
(gate = gate_up[..., :I], up = gate_up[..., I:]: the fused gate/up GEMM's output,
`rlfuse.model.fuse`), with the same bits per element; its Triton path reads the halves in
place (a 2-D grid of rows x column blocks) and writes d(gate_up) in one tensor.
Tests: `python -m pytest -q tests/test_kernel_layers.py -k swiglu`, tests/test_fuse.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.invariant import pointwise


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_exact_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # torch's CPU silu rounds its SIMD body and scalar tail differently: keep every element on one path
    return pointwise(F.silu, gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if resolve_backend("swiglu", gate) == "triton":  # elementwise: batch-invariant in both numerics
        return triton_ops("activation.triton_glu").swiglu(gate, up)
    return (swiglu_exact_ref if is_exact() else swiglu_ref)(gate, up)


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """swiglu(gate_up[..., :I], gate_up[..., I:]) with I = gate_up.shape[-1] // 2."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: the last dim must hold gate and up halves, got {tuple(gate_up.shape)}")
    if resolve_backend("swiglu", gate_up) == "triton":
        return triton_ops("activation.triton_glu").swiglu_packed(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return (swiglu_exact_ref if is_exact() else swiglu_ref)(gate, up)
