"""The routed experts' SwiGLU MLP over a routing: gather, gate/up, SwiGLU, down, combine.

Contract: x (T, D), gate_up (E, 2I, D) (gate rows first, transformers' `experts.gate_up_proj`),
down (E, D, I), a `routing.Routing` r of the T tokens -> (T, D) in x.dtype:
    out[t] = sum_j r.weights[t, j] * down[e] @ swiglu(gate_up[e] @ x[t]),  e = r.experts[t, j]
Steps: 1. xs = gather_rows(x, r)                     (T k, D) expert-sorted
       2. h = grouped_linear(xs, gate_up, r.offsets)  (T k, 2I)
       3. a = swiglu_packed(h)                         (T k, I)   elementwise
       4. ys = grouped_linear(a, down, r.offsets)      (T k, D)
       5. out = combine(ys, r)                         (T, D)
Every step gives a token's rows bits that depend on that token alone (see each op), so
in exact numerics the whole MLP is batch-invariant. Differentiable w.r.t. x, both weights
and r.weights. Tests: python -m pytest -q tests/test_kernel_moe.py -k experts

Per-expert LoRA (`lora`, an `ExpertLoRA`): steps 2 and 4 each add their adapter,
    h  += s * grouped_linear(grouped_linear(xs_a, A_gu, offsets), B_gu, offsets)
    ys += s * grouped_linear(grouped_linear(a_a,  A_d,  offsets), B_d,  offsets)
with A_gu (E, r, D), B_gu (E, 2I, r), A_d (E, r, I), B_d (E, D, r): each expert its own
adapter, applied to the rows routed to it. xs_a / a_a are the adapter branch's inputs
(dropout, when asked, on that branch only). Every term is a grouped GEMM, so the sum is
batch-invariant like the base; unlike `kernels.linear.lora` (added in the base GEMM's
fp32 epilogue) the adapter's term is added after the base product is rounded to x.dtype.
Test: python -m pytest -q tests/test_moe_lora.py
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from rlfuse.kernels.activation.glu import swiglu_packed
from rlfuse.kernels.moe.combine import combine, gather_rows
from rlfuse.kernels.moe.grouped_gemm import grouped_linear
from rlfuse.kernels.moe.routing import Routing


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertLoRA:
    """Per-expert adapters of the experts' two GEMMs (the module docstring's shapes)."""
    gate_up_A: torch.Tensor  # (E, r, D)
    gate_up_B: torch.Tensor  # (E, 2I, r)
    down_A: torch.Tensor     # (E, r, I)
    down_B: torch.Tensor     # (E, D, r)
    scale: float
    branch_input: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Applied to the adapter branch's input (dropout in training forwards); None: identity."""


def _adapted(x: torch.Tensor, w: torch.Tensor, A: torch.Tensor, B: torch.Tensor, lora: ExpertLoRA,
             offsets: torch.Tensor) -> torch.Tensor:
    xa = x if lora.branch_input is None else lora.branch_input(x)
    return grouped_linear(x, w, offsets) + lora.scale * grouped_linear(grouped_linear(xa, A, offsets), B, offsets)


def experts_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, r: Routing,
                lora: ExpertLoRA | None = None) -> torch.Tensor:
    E, two_i, D = gate_up.shape
    if down.shape != (E, D, two_i // 2) or two_i % 2 or x.shape[-1] != D:
        raise ValueError(f"experts_mlp: gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, x "
                         f"{tuple(x.shape)}: expected gate_up (E, 2I, D), down (E, D, I), x (T, D)")
    xs = gather_rows(x, r)
    if lora is None:
        h = grouped_linear(xs, gate_up, r.offsets)
        return combine(grouped_linear(swiglu_packed(h), down, r.offsets), r)
    R = lora.gate_up_A.shape[1]
    want = {"gate_up_A": (E, R, D), "gate_up_B": (E, two_i, R), "down_A": (E, R, two_i // 2), "down_B": (E, D, R)}
    for name, shape in want.items():
        if tuple(getattr(lora, name).shape) != shape:
            raise ValueError(f"experts_mlp: lora.{name} is {tuple(getattr(lora, name).shape)}, expected {shape}")
    h = _adapted(xs, gate_up, lora.gate_up_A, lora.gate_up_B, lora, r.offsets)
    return combine(_adapted(swiglu_packed(h), down, lora.down_A, lora.down_B, lora, r.offsets), r)
