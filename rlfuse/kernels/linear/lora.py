"""LoRA linear: y = x W^T + b + s * ((x_a A^T) B^T), the adapter applied, never merged.

Contract: x (..., K); weight W (N, K), bias b (N,) or None; adapter A (r, K), B (N, r);
scale s a Python float (alpha / r, or alpha / sqrt(r) for rsLoRA); x_a (..., K), the
adapter branch's input, defaults to x (the model passes dropout(x) while training). One
float dtype for all tensors; y (..., N) in x.dtype. Differentiable w.r.t. x, W, b, A, B
(the model freezes W and b, so only A and B get gradients).

The steps:
    1. base = x W^T + b                 the layer as it is without the adapter
    2. z    = x_a A^T                   (..., r), the shrink, rounded to x.dtype
    3. d    = z B^T                     (..., N), the expand
    4. y    = base + s d
Numerics "fast": F.linear for 1 and 2 (cuBLAS on GPU), then 3 and 4 as one
`torch.addmm(base, z, B^T, alpha=s)` (one GEMM whose epilogue adds base: no separate
multiply and add kernels).
Numerics "exact": every output element is reduced in an order that does not depend on
the number of rows, so row m of y depends on row m of x and the weights only
(`torch.equal(lora_linear(x)[:k], lora_linear(x[:k]))`) and the engine's decode and
prefill give the trainer's bits:
  * torch backend (`lora_linear_ref`): PEFT's rounding step by step, each product the exact
    linear's reference (`rlfuse.kernels.linear.gemm.linear_exact_ref`), each result rounded to
    x.dtype, then `base + d * s` as two rounded elementwise ops (never one fused
    multiply-add, whose rounding depends on the code path);
  * triton backend (`rlfuse.kernels.linear.triton_lora`): step 2 by the exact linear, steps 1, 3
    and 4 in one GEMM whose epilogue adds s z B^T before the single rounding.
The two backends are each batch-invariant, not equal to each other (as for `linear`).
With the adapter switched off the model calls `linear(x, W, b)`, step 1 alone: the base
model's bits.
Tests: python -m pytest -q tests/test_lora.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.linear.gemm import linear_exact, linear_exact_ref


def lora_linear_ref(x, weight, bias, lora_a, lora_b, scale: float, x_a=None):
    """The exact-mode reference: the module docstring's steps with the exact linear's
    reference products, each rounded (what `lora_linear` computes in exact numerics under
    the torch backend)."""
    base = linear_exact_ref(x, weight, bias)
    d = linear_exact_ref(linear_exact_ref(x if x_a is None else x_a, lora_a), lora_b)
    return base + d * scale


def _check(x, weight, lora_a, lora_b):
    K, N, r = x.shape[-1], weight.shape[0], lora_a.shape[0]
    if weight.shape != (N, K) or lora_a.shape != (r, K) or lora_b.shape != (N, r):
        raise ValueError(f"lora_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, A {tuple(lora_a.shape)}, "
                         f"B {tuple(lora_b.shape)}: expected weight (N, K), A (r, K), B (N, r)")
    if not (x.dtype == weight.dtype == lora_a.dtype == lora_b.dtype):
        raise ValueError(f"lora_linear: one dtype for x, weight, A and B, got {x.dtype}, {weight.dtype}, "
                         f"{lora_a.dtype}, {lora_b.dtype}")


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scale: float, x_a: torch.Tensor | None = None) -> torch.Tensor:
    """Public op: the current numerics and backend pick the path (module docstring)."""
    _check(x, weight, lora_a, lora_b)
    x_a = x if x_a is None else x_a
    if is_exact():
        if resolve_backend("lora", x) == "triton":
            return triton_ops("linear.triton_lora").lora_linear_exact_triton(x, weight, bias, lora_a, lora_b, scale, x_a)
        # the differentiable exact products (torch backward), with lora_linear_ref's bits
        base = linear_exact(x, weight, bias)
        return base + linear_exact(linear_exact(x_a, lora_a), lora_b) * scale
    N, r = weight.shape[0], lora_a.shape[0]
    base = F.linear(x, weight, bias).reshape(-1, N)
    z = F.linear(x_a, lora_a).reshape(-1, r)
    return torch.addmm(base, z, lora_b.t(), alpha=scale).view(*x.shape[:-1], N)
