"""LoRA linear: y = x W^T + b + s * ((x_a A^T) B^T), the adapter applied, never merged.

Contract: x (..., K); weight W (N, K), bias b (N,) or None; adapter A (r, K), B (N, r);
scale s a Python float (alpha / r, or alpha / sqrt(r) for rsLoRA); x_a (..., K), the
adapter branch's input, defaults to x (the model passes dropout(x) while training). One
float dtype for all tensors; y (..., N) in x.dtype. Differentiable w.r.t. x, W, b, A, B
(the model freezes W and b, so only A and B get gradients).
Fused projections (`sizes`, P <= 4 parts, e.g. q/k/v or a Gated DeltaNet's qkv/z/b/a as
one W): A (P r, K) holds each part's A below the previous one, B (N, r) each part's B in
its output rows; part p's columns get z[:, p r:(p + 1) r] B_p^T. Adapter banks (`rlfuse serve` with several
adapters, punica / S-LoRA style): A (n, P r, K), B (n, N, r), scale an (n,) fp32 tensor,
`adapter` (M,) int each row's adapter (-1: none, the base's bits); inference only.

The steps:
    1. base = x W^T + b                 the layer as it is without the adapter
    2. z    = x_a A^T                   (..., r), the shrink, rounded to x.dtype
    3. d    = z B^T                     (..., N), the expand
    4. y    = base + s d
Numerics "fast": F.linear for 1 and 2 (cuBLAS on GPU; 2 is one GEMM over every part's
and adapter's A), then 3 and 4: on the GPU (triton backend, no gradient) one kernel that
adds s z B^T to the base in place (`triton_lora.lora_add_triton`); else
`torch.addmm(base, z, B^T, alpha=s)` per part (one GEMM whose epilogue adds base).
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
A row's bits depend on its own x and adapter only: a bank batch mixing adapters gives each
row the bits of a batch of its adapter alone (both backends), and a fused projection's
part p the bits of the separate projection under the torch backend.
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


def _spans(sizes, N: int) -> list[tuple[int, int]]:
    """[(first, end) output column of each part]."""
    sizes = (N,) if sizes is None else tuple(sizes)
    ends = [0]
    for n in sizes:
        ends.append(ends[-1] + n)
    return list(zip(ends[:-1], ends[1:]))


def _expand_torch(base, z, lora_b, scale, sizes, adapter, exact: bool):
    """base (M, N) + each row's adapter term; z (M, n P r); lora_b (n, N, r). Exact: the
    expand by the exact linear, rounded, then `* s` and `+ base` as rounded elementwise ops
    (PEFT's steps); fast: `addmm` (one GEMM whose epilogue adds the base)."""
    n, N, r = lora_b.shape
    spans = _spans(sizes, N)
    out = base
    for a in range(n):
        s = scale[a] if isinstance(scale, torch.Tensor) else scale
        cols = []
        for p, (lo, hi) in enumerate(spans):
            zp, bp = z[:, (a * len(spans) + p) * r:(a * len(spans) + p + 1) * r], lora_b[a, lo:hi]
            if exact:
                cols.append(base[:, lo:hi] + linear_exact(zp, bp) * s)
            elif isinstance(s, torch.Tensor):
                cols.append(base[:, lo:hi] + (zp @ bp.t()) * s)
            else:
                cols.append(torch.addmm(base[:, lo:hi], zp, bp.t(), alpha=s))
        ya = cols[0] if len(cols) == 1 else torch.cat(cols, 1)
        out = ya if adapter is None else torch.where((adapter == a)[:, None], ya, out)
    return out


def lora_linear_ref(x, weight, bias, lora_a, lora_b, scale, x_a=None, *, sizes=None, adapter=None):
    """The exact-mode reference: the module docstring's steps with the exact linear's
    reference products, each rounded (what `lora_linear` computes in exact numerics under
    the torch backend)."""
    N, K = weight.shape
    base = linear_exact_ref(x, weight, bias).reshape(-1, N)
    z = linear_exact_ref(x if x_a is None else x_a, lora_a.reshape(-1, K)).reshape(base.shape[0], -1)
    bw = lora_b if lora_b.dim() == 3 else lora_b.unsqueeze(0)
    out = base
    for a in range(bw.shape[0]):
        s = scale[a] if isinstance(scale, torch.Tensor) else scale
        r, spans = bw.shape[2], _spans(sizes, N)
        d = torch.cat([linear_exact_ref(z[:, (a * len(spans) + p) * r:(a * len(spans) + p + 1) * r], bw[a, lo:hi])
                       for p, (lo, hi) in enumerate(spans)], 1)
        ya = base + d * s
        out = ya if adapter is None else torch.where((adapter == a)[:, None], ya, out)
    return out.view(*x.shape[:-1], N)


def _check(x, weight, lora_a, lora_b, scale, sizes, adapter):
    K, N = x.shape[-1], weight.shape[0]
    bank = lora_a.dim() == 3
    n = lora_a.shape[0] if bank else 1
    P = 1 if sizes is None else len(sizes)
    r = lora_b.shape[-1]
    if (weight.shape != (N, K) or lora_a.shape[-2:] != (P * r, K) or lora_b.shape[-2:] != (N, r)
            or lora_b.dim() != lora_a.dim() or (bank and lora_b.shape[0] != n)):
        raise ValueError(f"lora_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, A {tuple(lora_a.shape)}, "
                         f"B {tuple(lora_b.shape)}, {P} part(s): expected weight (N, K), A ([n,] parts * r, K), "
                         f"B ([n,] N, r)")
    if not (x.dtype == weight.dtype == lora_a.dtype == lora_b.dtype):
        raise ValueError(f"lora_linear: one dtype for x, weight, A and B, got {x.dtype}, {weight.dtype}, "
                         f"{lora_a.dtype}, {lora_b.dtype}")
    if sizes is not None and (not 1 <= P <= 4 or sum(sizes) != N):
        raise ValueError(f"lora_linear: sizes {tuple(sizes)} must be 1 to 4 parts summing to N = {N}")
    if (bank or adapter is not None) != isinstance(scale, torch.Tensor) or (
            isinstance(scale, torch.Tensor) and (scale.shape != (n,) or scale.dtype != torch.float32)):
        raise ValueError(f"lora_linear: a bank of {n} adapter(s) (3-D A and B, or per-row adapters) takes scale as "
                         f"an ({n},) fp32 tensor, one adapter alone a float; got {scale!r:.60}")
    if adapter is not None and (adapter.shape != (x.numel() // max(K, 1),) or adapter.dtype.is_floating_point):
        raise ValueError(f"lora_linear: adapter must be an ({x.numel() // max(K, 1)},) integer tensor (one per "
                         f"row), got {tuple(adapter.shape)} {adapter.dtype}")


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scale: float | torch.Tensor, x_a: torch.Tensor | None = None, *,
                sizes: tuple[int, ...] | None = None, adapter: torch.Tensor | None = None,
                joined: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """Public op: the current numerics and backend pick the path (module docstring).
    `joined` (one adapter): (WA, bA), a buffer whose rows are `weight` then `lora_a` (both
    views of it) and `bias` followed by zeros (None without a bias): a fast no-gradient
    forward runs base and shrink as ONE GEMM over it, the shrink in the base GEMM."""
    _check(x, weight, lora_a, lora_b, scale, sizes, adapter)
    if joined is not None and x_a is None and not is_exact() and lora_a.dim() == 2 and not (
            torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, lora_a,
                                                                                       lora_b))):
        return _joined_fast(x, joined, lora_b, scale, sizes, weight.shape[0])
    x_a = x if x_a is None else x_a
    backend = resolve_backend("lora", x)
    if is_exact() and backend == "triton":
        return triton_ops("linear.triton_lora").lora_linear_exact_triton(x, weight, bias, lora_a, lora_b, scale,
                                                                        x_a, sizes=sizes, adapter=adapter)
    N, K = weight.shape
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, lora_a,
                                                                                      lora_b, x_a))
    if is_exact():  # the differentiable exact products (torch backward), with lora_linear_ref's bits
        base = linear_exact(x, weight, bias).reshape(-1, N)
        z = linear_exact(x_a, lora_a.reshape(-1, K)).reshape(base.shape[0], -1)
    else:
        base = F.linear(x, weight, bias).reshape(-1, N)
        z = F.linear(x_a, lora_a.reshape(-1, K)).reshape(base.shape[0], -1)
        if backend == "triton" and not grad:  # cuBLAS base and shrink, then one kernel adds the expand in place
            return triton_ops("linear.triton_lora").lora_add_triton(base, z, lora_b, scale, sizes=sizes,
                                                                   adapter=adapter).view(*x.shape[:-1], N)
    bw = lora_b if lora_b.dim() == 3 else lora_b.unsqueeze(0)
    return _expand_torch(base, z, bw, scale, sizes, adapter, is_exact()).view(*x.shape[:-1], N)


def _joined_fast(x, joined, lora_b, scale, sizes, N: int):
    """Fast numerics over a joined buffer: [base | z] = x [W; A]^T (+ [b; 0]) in one GEMM,
    then the expand added to the base columns in place; returns the (strided) base view."""
    wa, ba = joined
    out = F.linear(x, wa, ba)  # (..., N + P r)
    base, z = out[..., :N], out[..., N:]
    if resolve_backend("lora", x) == "triton":
        triton_ops("linear.triton_lora").lora_add_triton(base, z, lora_b, scale, sizes=sizes)
        return base
    flat = out.view(-1, out.shape[-1])
    y = _expand_torch(flat[:, :N], flat[:, N:], lora_b.unsqueeze(0), scale, sizes, None, False)
    return y.view(*x.shape[:-1], N)
