"""RMSNorm: y = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)

Contract: x (..., D) any float dtype, w (D,). The reduction runs in fp32; the
normalized row is cast to x.dtype before the multiply by w (the Hugging Face
convention, so our outputs match `transformers` bit for bit in fp32). The output dtype
is torch's promotion of (w.dtype, x.dtype), the product rounded once.
Batch-invariant: each row is reduced on its own, in a fixed order.

Fused residual add (vLLM's fused_add_rms_norm): `add_rmsnorm(h, x, w, eps)` returns
(s, rmsnorm(s, w, eps)) with s = h + x, one rounding to h.dtype, in one kernel; the
decoder carries the residual stream and each layer's pending output so that both adds
of a layer land in the norm after them. Bitwise equal to `h + x` then `rmsnorm` in both
numerics (the add is the same single rounding of the same operands, the norm the same
kernel with the same tile). Backward: ds = rmsnorm's dx + the gradient reaching s from
its other use (one add in s.dtype, as autograd accumulates them), dh = dx = ds.

Offset RMSNorm (Qwen3.5's): `offset_rmsnorm(x, w, eps)` = (rmsnorm(x.float(), 1 + w.float(),
eps)).to(x.dtype): the normalized row stays fp32, times 1 + w in fp32, ONE rounding at the
end (HF's `Qwen3_5RMSNorm`); with `residual` h: (s, offset_rmsnorm(s)), s = h + x. Without
a gradient to take, the Triton backend runs it as one kernel (the forward kernel's OFFSET
flag: the same loads, reduction tree and products as the composition on x.float(), so the
same bits: no fp32 copy of x, no 1 + w or cast kernels, no separate add); with one, the
composition (the rmsnorm op's autograd).

Triton path, rows flattened to (N, D), r = rsqrt(mean(x^2) + eps) per row:
  forward   tiles of ROWS x BLOCK_D (ROWS depends on D only, never on N, so a row's
            reduction tree is the same in any batch); stores r (N,) fp32 for backward.
  backward  with n = x r (fp32), dn = dy w (fp32):
                dx = r (dn - n mean(dn n))                       per row
                dw = sum_rows dy * rnd_x(n)                       (rnd_x: cast to x.dtype)
            Each of P programs owns a fixed contiguous range of rows and writes its dw
            partial sum (P, D) fp32; a second kernel sums the P partials in order and
            casts. P depends on N and the GPU only, so dw is deterministic run to run (no
            atomics).
Tests: `python -m pytest -q tests/test_kernel_layers.py tests/test_kernel_fused.py -k rmsnorm`.
"""

from __future__ import annotations

import torch

from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.invariant import pairwise_sum, pointwise


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def rmsnorm_exact_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # exact numerics on the torch backend: the same math with a batch-invariant row sum
    xf = x.float()
    var = pairwise_sum(xf * xf, -1)[..., None] / x.shape[-1]
    return weight * (xf * pointwise(torch.rsqrt, var + eps)).to(x.dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Public op: picks the backend (see `rlfuse.kernels.backend`)."""
    if resolve_backend("rmsnorm", x) == "triton":
        return triton_ops("norm.triton_rms").rmsnorm(x, weight, eps)  # batch-invariant in both numerics
    return (rmsnorm_exact_ref if is_exact() else rmsnorm_ref)(x, weight, eps)


def add_rmsnorm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(s, y): s = h + x (the residual stream), y = rmsnorm(s), both in one kernel on the
    Triton backend; h and x (..., D) of one dtype. The reference is the two ops."""
    if h.shape != x.shape or h.dtype != x.dtype:
        raise ValueError(f"add_rmsnorm: h {tuple(h.shape)} {h.dtype} and x {tuple(x.shape)} {x.dtype} "
                         "must have one shape and dtype")
    if resolve_backend("rmsnorm", h) == "triton":
        return triton_ops("norm.triton_rms").add_rmsnorm(h, x, weight, eps)
    s = h + x
    return s, rmsnorm(s, weight, eps)


def offset_rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm as the composition of ops (the reference, and the path a gradient
    goes through): the rmsnorm op on the fp32 row with weight 1 + w, the normed row's cast a
    no-op, one rounding to x.dtype at the end."""
    return rmsnorm(x.float(), 1.0 + weight.float(), eps).to(x.dtype)


def offset_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Public op: y = offset_rmsnorm(x), or with `residual` h: (s, offset_rmsnorm(s)), s = h + x
    (module docstring). One Triton kernel when no gradient is needed in fast numerics, else the
    reference."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"offset_rmsnorm: residual {tuple(residual.shape)} {residual.dtype} and x "
                         f"{tuple(x.shape)} {x.dtype} must have one shape and dtype")
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (residual is not None and residual.requires_grad))
    # exact numerics keep the composition on both sides (engine and trainer) until the one
    # kernel's bits have been checked on a GPU (tests/test_kernel_layers.py's cuda test)
    if not grad and not is_exact() and resolve_backend("rmsnorm", x) == "triton":
        return triton_ops("norm.triton_rms").offset_rmsnorm(x, weight, eps, residual)
    if residual is None:
        return offset_rmsnorm_ref(x, weight, eps)
    s = residual + x
    return s, offset_rmsnorm_ref(s, weight, eps)
