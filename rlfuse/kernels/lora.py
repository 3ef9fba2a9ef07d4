"""LoRA linear: y = x W^T + b + s * ((x_a A^T) B^T), the adapter applied, never merged.

Contract: x (..., K); weight W (N, K), bias b (N,) or None; adapter A (r, K), B (N, r);
scale s a Python float (alpha / r, or alpha / sqrt(r) for rsLoRA); x_a (..., K), the
adapter branch's input, defaults to x (the model passes dropout(x) while training). One
float dtype for all tensors; y (..., N) in x.dtype. Differentiable w.r.t. x, W, b, A, B
(the model freezes W and b, so only A and B get gradients).

The rounding is PEFT's (`peft.tuners.lora.Linear.forward`), step by step, each result
rounded to x.dtype:
    1. base = linear(x, W, b)          the layer as it is without the adapter
    2. z    = linear(x_a, A)           (..., r), the shrink
    3. d    = linear(z, B)             (..., N), the expand
    4. y    = base + d * s             two rounded elementwise ops (never one fused
                                       multiply-add, whose rounding depends on the path)
Each product runs through `rlfuse.kernels.linear.linear`, so it inherits that op's two
numerics: "fast" is F.linear (cuBLAS on GPU; on the CPU the same calls as PEFT's); "exact"
reduces every output element in a canonical order that does not depend on the number of
rows (Triton on CUDA, the pairwise reference on CPU). Steps 1-3 are then batch-invariant,
and step 4 is elementwise, so row m of y depends on row m of x and the weights only:
`torch.equal(lora_linear(x)[:k], lora_linear(x[:k]))`, and the engine's decode and
prefill give the trainer's bits. With the adapter switched off the model calls
`linear(x, W, b)`, step 1 alone: the base model's bits.

Why three products and not one kernel: A and B are tiny (r << K, N), so steps 2-3 read
r (K + N) weights against the base's N K; the composition also inherits the backward of
`linear` (dA = dz^T x_a, dB = dd^T z), and under the "triton" backend each product is the
exact-mode Triton GEMM. A fused epilogue (step 3 inside the base GEMM) would save two
launches per layer; it is not written.
Tests: python -m pytest -q tests/test_lora.py
"""

from __future__ import annotations

import torch

from rlfuse.kernels.linear import linear, linear_exact_ref


def lora_linear_ref(x, weight, bias, lora_a, lora_b, scale: float, x_a=None):
    """The contract written out with the exact reference products (batch-invariant on any
    device; what `lora_linear` computes in exact numerics under the torch backend)."""
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
    """Public op: the module docstring's four steps, each product through `linear` (the
    current numerics and backend choose F.linear, the exact reference or Triton)."""
    _check(x, weight, lora_a, lora_b)
    base = linear(x, weight, bias)
    d = linear(linear(x if x_a is None else x_a, lora_a), lora_b)
    return base + d * scale
