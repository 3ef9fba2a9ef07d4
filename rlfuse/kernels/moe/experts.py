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
"""

from __future__ import annotations

import torch

from rlfuse.kernels.moe.combine import combine, gather_rows
from rlfuse.kernels.moe.grouped_gemm import grouped_linear
from rlfuse.kernels.moe.routing import Routing
from rlfuse.kernels.activation.glu import swiglu_packed


def experts_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, r: Routing) -> torch.Tensor:
    E, two_i, D = gate_up.shape
    if down.shape != (E, D, two_i // 2) or two_i % 2 or x.shape[-1] != D:
        raise ValueError(f"experts_mlp: gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, x "
                         f"{tuple(x.shape)}: expected gate_up (E, 2I, D), down (E, D, I), x (T, D)")
    h = grouped_linear(gather_rows(x, r), gate_up, r.offsets)
    return combine(grouped_linear(swiglu_packed(h), down, r.offsets), r)
