"""SwiGLU, the Triton kernels (the math, the rounding and the launch rules are in
`rlfuse.kernels.activation.glu`'s docstring)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.triton_common import round_to

# Tile: the best of 12 BLOCK x warps settings for both kernels in an H100 sweep at Qwen3-0.6B
# shapes (bench_layers.py; docs/perf-log.md).
_BLOCK = 1024  # elements a program (4 a thread)


_WARPS = 8     # warps a program


@triton.jit
def _fwd(g, u, DT: tl.constexpr):
    """y = silu(g) * u for g, u loaded in fp32, rounded like torch (returned in fp32)."""
    # 1. silu in fp32, rounded to the input dtype like F.silu
    s = round_to(tl.math.div_rn(g, 1.0 + tl.exp(-g)), DT)
    # 2. product in fp32 (exact for bf16/fp16 operands), one rounding
    return round_to(s * u, DT)


@triton.jit
def _bwd(dy, g, u, DT: tl.constexpr):
    """(dg, du) in fp32 for fp32 dy, g, u, with autograd's roundings."""
    den = 1.0 + tl.exp(-g)
    sig = tl.math.div_rn(1.0, den)
    s = round_to(tl.math.div_rn(g, den), DT)  # the forward's silu, rounded as it was
    du = round_to(dy * s, DT)
    t = round_to(dy * u, DT)  # autograd's grad wrt silu(g), rounded by the mul's backward
    return round_to(t * (sig * (1.0 + g * (1.0 - sig))), DT), du


@triton.jit(do_not_specialize=['N'])  # row counts vary per step: one compile
def _swiglu_fwd_kernel(G_ptr, U_ptr, Y_ptr, N, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = None if EVEN else offs < N
    g = tl.load(G_ptr + offs, mask=mask, other=None if EVEN else 0.0).to(tl.float32)
    u = tl.load(U_ptr + offs, mask=mask, other=None if EVEN else 0.0).to(tl.float32)
    DT: tl.constexpr = U_ptr.dtype.element_ty
    tl.store(Y_ptr + offs, _fwd(g, u, DT).to(DT), mask=mask)


@triton.jit(do_not_specialize=['N'])  # row counts vary per step: one compile
def _swiglu_bwd_kernel(DY_ptr, G_ptr, U_ptr, DG_ptr, DU_ptr, N, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = None if EVEN else offs < N
    dy = tl.load(DY_ptr + offs, mask=mask, other=None if EVEN else 0.0).to(tl.float32)
    g = tl.load(G_ptr + offs, mask=mask, other=None if EVEN else 0.0).to(tl.float32)
    u = tl.load(U_ptr + offs, mask=mask, other=None if EVEN else 0.0).to(tl.float32)
    DT: tl.constexpr = U_ptr.dtype.element_ty
    dg, du = _bwd(dy, g, u, DT)
    tl.store(DU_ptr + offs, du.to(DT), mask=mask)
    tl.store(DG_ptr + offs, dg.to(DT), mask=mask)


@triton.jit  # the row count is the grid, never an argument: one compile per I
def _swiglu_packed_fwd_kernel(GU_ptr, Y_ptr, I, s_gu, s_y, BLOCK: tl.constexpr):
    """Row m, columns [c0, c0 + BLOCK): gate = GU[m, c], up = GU[m, I + c]."""
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(GU_ptr + m * s_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU_ptr + m * s_gu + I + cols, mask=ok, other=0.0).to(tl.float32)
    DT: tl.constexpr = Y_ptr.dtype.element_ty
    tl.store(Y_ptr + m * s_y + cols, _fwd(g, u, DT).to(DT), mask=ok)


@triton.jit
def _swiglu_packed_bwd_kernel(DY_ptr, GU_ptr, DGU_ptr, I, s_dy, s_gu, s_dgu, BLOCK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    dy = tl.load(DY_ptr + m * s_dy + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(GU_ptr + m * s_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU_ptr + m * s_gu + I + cols, mask=ok, other=0.0).to(tl.float32)
    DT: tl.constexpr = DGU_ptr.dtype.element_ty
    dg, du = _bwd(dy, g, u, DT)
    tl.store(DGU_ptr + m * s_dgu + cols, dg.to(DT), mask=ok)
    tl.store(DGU_ptr + m * s_dgu + I + cols, du.to(DT), mask=ok)


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


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def swiglu_packed_fwd_triton(gate_up: torch.Tensor) -> torch.Tensor:
    gu = _rows(gate_up)
    M, I = gu.shape[0], gu.shape[1] // 2
    y = torch.empty((M, I), dtype=gu.dtype, device=gu.device)
    if M:
        _swiglu_packed_fwd_kernel[(M, triton.cdiv(I, _BLOCK))](gu, y, I, gu.stride(0), y.stride(0), BLOCK=_BLOCK,
                                                               num_warps=_WARPS)
    return y.view(*gate_up.shape[:-1], I)


class _SwiGLUPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return swiglu_packed_fwd_triton(gate_up)

    @staticmethod
    def backward(ctx, dy):
        (gate_up,) = ctx.saved_tensors
        gu, dy2 = _rows(gate_up), _rows(dy)
        M, I = dy2.shape
        dgu = torch.empty_like(gu)
        if M:
            _swiglu_packed_bwd_kernel[(M, triton.cdiv(I, _BLOCK))](dy2, gu, dgu, I, dy2.stride(0), gu.stride(0),
                                                                   dgu.stride(0), BLOCK=_BLOCK, num_warps=_WARPS)
        return dgu.view(gate_up.shape)


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """swiglu of the halves of gate_up's last dim, on the Triton backend (autograd where needed)."""
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return _SwiGLUPacked.apply(gate_up)
    return swiglu_packed_fwd_triton(gate_up)
