"""SwiGLU, the Triton kernels (the math, the rounding and the launch rules are in
`rlfuse.kernels.swiglu`'s docstring)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.triton.common import round_to

# Tile: the best of 12 BLOCK x warps settings for both kernels in an H100 sweep at Qwen3-0.6B
# shapes (bench_layers.py; docs/perf-log.md).
_BLOCK = 1024  # elements a program (4 a thread)


_WARPS = 8     # warps a program


@triton.jit(do_not_specialize=['N'])  # row counts vary per step: one compile
def _swiglu_fwd_kernel(G_ptr, U_ptr, Y_ptr, N, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = None if EVEN else offs < N
    g = tl.load(G_ptr + offs, mask=mask, other=None if EVEN else 0.0).to(tl.float32)
    u = tl.load(U_ptr + offs, mask=mask, other=None if EVEN else 0.0)
    DT: tl.constexpr = U_ptr.dtype.element_ty
    # 1. silu in fp32, rounded to the input dtype like F.silu
    s = round_to(tl.math.div_rn(g, 1.0 + tl.exp(-g)), DT)
    # 2. product in fp32 (exact for bf16/fp16 operands), one rounding
    y = round_to(s * u.to(tl.float32), DT)
    tl.store(Y_ptr + offs, y.to(DT), mask=mask)


@triton.jit(do_not_specialize=['N'])  # row counts vary per step: one compile
def _swiglu_bwd_kernel(DY_ptr, G_ptr, U_ptr, DG_ptr, DU_ptr, N, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = None if EVEN else offs < N
    dy = tl.load(DY_ptr + offs, mask=mask, other=None if EVEN else 0.0).to(tl.float32)
    g = tl.load(G_ptr + offs, mask=mask, other=None if EVEN else 0.0).to(tl.float32)
    u = tl.load(U_ptr + offs, mask=mask, other=None if EVEN else 0.0).to(tl.float32)
    DT: tl.constexpr = U_ptr.dtype.element_ty
    den = 1.0 + tl.exp(-g)
    sig = tl.math.div_rn(1.0, den)
    s = round_to(tl.math.div_rn(g, den), DT)  # the forward's silu, rounded as it was
    du = round_to(dy * s, DT)
    t = round_to(dy * u, DT)  # autograd's grad wrt silu(g), rounded by the mul's backward
    dg = round_to(t * (sig * (1.0 + g * (1.0 - sig))), DT)
    tl.store(DU_ptr + offs, du.to(DT), mask=mask)
    tl.store(DG_ptr + offs, dg.to(DT), mask=mask)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate and up must share shape and dtype, got "
                         f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")


def _launch(kernel, *tensors: torch.Tensor) -> None:
    """Whole blocks unmasked, then the remainder (< BLOCK elements) masked, on flat views
    (the remainder starts at a multiple of BLOCK elements: still 16-byte aligned)."""
    n = tensors[0].numel()
    whole = n // _BLOCK * _BLOCK
    if whole:
        kernel[(whole // _BLOCK,)](*tensors, whole, BLOCK=_BLOCK, EVEN=True, num_warps=_WARPS)
    if n > whole:
        kernel[(1,)](*(t.view(-1)[whole:] for t in tensors), n - whole, BLOCK=_BLOCK, EVEN=False,
                     num_warps=_WARPS)


def swiglu_fwd_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check(gate, up)
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty_like(g)
    _launch(_swiglu_fwd_kernel, g, u, y)
    return y


def swiglu_bwd_triton(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    dy, g, u = dy.contiguous(), gate.contiguous(), up.contiguous()
    dg, du = torch.empty_like(g), torch.empty_like(u)
    _launch(_swiglu_bwd_kernel, dy, g, u, dg, du)
    return dg, du


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_fwd_triton(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = swiglu_bwd_triton(dy, gate, up)
        return dg, du


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The op on the Triton backend (autograd where a gradient is needed)."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SwiGLU.apply(gate, up)
    return swiglu_fwd_triton(gate, up)
