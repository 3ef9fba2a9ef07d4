"""Causal conv1d, the Triton half: prefill (varlen) and decode-update kernels, launchers
and the autograd Function (contract and summation order: `rlfuse.kernels.gated_delta.conv`).

Both kernels build a token's W-value window (from its sequence, or from the conv state
for positions before the sequence's start) and call the one `_conv_window` function:
products added left to right, bias last, SiLU as x * sigmoid(x). FMA contraction is off
in both, so a product is rounded before its add and a token's y has the same bits from
the prefill kernel and from the update kernel. Grids: (token blocks, channel blocks);
the token -> sequence map is computed on the device (`searchsorted`), no host sync.
Backward: NOT a Triton kernel; the Function recomputes the PyTorch reference under
autograd (fast numerics) and differentiates it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.gated_delta.conv import causal_conv1d_ref
from rlfuse.kernels.triton.common import round_to

_COMPILE = dict(enable_fp_fusion=False)
BLOCK_T, BLOCK_C = 16, 64  # tile of the prefill kernel (any: each element is computed on its own)


@triton.jit
def _conv_window(acc, xj, wj, J: tl.constexpr):
    """One window term: acc + w[j] x_j (x_0 w_0 starts the sum)."""
    if J == 0:
        return xj * wj
    else:
        return acc + xj * wj


@triton.jit
def _finish(acc, bias, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    if HAS_BIAS:
        acc = acc + bias
    if SILU:
        acc = acc * tl.sigmoid(acc)
    return acc


@triton.jit(do_not_specialize=["T"])
def _conv_fwd_kernel(X, Wt, Bias, S0, CU, SEQ, Y, T, C, sx, sy, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                     HAS_S0: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tm = t < T
    cm = c < C
    seq = tl.load(SEQ + t, mask=tm, other=0).to(tl.int64)
    pos = t - tl.load(CU + seq, mask=tm, other=0).to(tl.int64)       # position in its sequence
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(W):
        src = pos - (W - 1) + j
        inseq = src >= 0
        xj = tl.load(X + (t - (W - 1) + j)[:, None] * sx + c[None, :],
                     mask=(tm & inseq)[:, None] & cm[None, :], other=0.0).to(tl.float32)
        if HAS_S0:  # positions before the start come from the state's last W-1 columns
            sj = tl.load(S0 + (seq * C)[:, None] * (W - 1) + c[None, :] * (W - 1) + (W - 1 + src)[:, None],
                         mask=(tm & ~inseq)[:, None] & cm[None, :], other=0.0).to(tl.float32)
            xj = tl.where(inseq[:, None], xj, sj)
        wj = tl.load(Wt + c * W + j, mask=cm, other=0.0).to(tl.float32)
        acc = _conv_window(acc, xj, wj[None, :], j)
    bias = tl.load(Bias + c, mask=cm, other=0.0).to(tl.float32)[None, :] if HAS_BIAS else 0.0
    y = _finish(acc, bias, HAS_BIAS, SILU)
    YT: tl.constexpr = Y.dtype.element_ty
    tl.store(Y + t[:, None] * sy + c[None, :], round_to(y, YT).to(YT), mask=tm[:, None] & cm[None, :])


@triton.jit
def _conv_update_kernel(X, Wt, Bias, S, Y, C, sx, sy, ss_b, ss_c, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                        SILU: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    x = tl.load(X + b * sx + c, mask=cm, other=0.0)
    acc = tl.zeros((BC,), dtype=tl.float32)
    for j in tl.static_range(W - 1):
        sj = tl.load(S + b * ss_b + c * ss_c + j, mask=cm, other=0.0)
        acc = _conv_window(acc, sj.to(tl.float32), tl.load(Wt + c * W + j, mask=cm, other=0.0).to(tl.float32), j)
        if j > 0:  # shift the state left by one (the oldest input leaves)
            tl.store(S + b * ss_b + c * ss_c + j - 1, sj, mask=cm)
    acc = _conv_window(acc, x.to(tl.float32), tl.load(Wt + c * W + W - 1, mask=cm, other=0.0).to(tl.float32),
                       W - 1)
    tl.store(S + b * ss_b + c * ss_c + W - 2, x.to(S.dtype.element_ty), mask=cm)
    bias = tl.load(Bias + c, mask=cm, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    y = _finish(acc, bias, HAS_BIAS, SILU)
    YT: tl.constexpr = Y.dtype.element_ty
    tl.store(Y + b * sy + c, round_to(y, YT).to(YT), mask=cm)


def _last_inputs(x, initial_state, cu_seqlens, W):
    """(B, C, W-1): each sequence's last W-1 inputs (from its initial state where shorter);
    tensor ops only (no host sync)."""
    T, C = x.shape
    B = cu_seqlens.shape[0] - 1
    if initial_state is None:
        initial_state = x.new_zeros(B, C, W - 1)
    buf = torch.cat([x, initial_state.to(x.dtype).transpose(1, 2).reshape(B * (W - 1), C)])
    cu = cu_seqlens.long()
    src = (cu[1:] - cu[:-1])[:, None] - (W - 1) + torch.arange(W - 1, device=x.device)[None, :]
    rows = torch.where(src >= 0, cu[:-1][:, None] + src,
                       T + torch.arange(B, device=x.device)[:, None] * (W - 1) + (W - 1) + src)
    return buf[rows].transpose(1, 2)


def conv_fwd(x, weight, bias, cu_seqlens, initial_state, activation):
    T, C = x.shape
    W = weight.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    s0 = initial_state.contiguous() if initial_state is not None else None
    if T:
        seq = torch.searchsorted(cu_seqlens[1:].contiguous(), torch.arange(T, device=x.device, dtype=cu_seqlens.dtype),
                                 right=True)
        grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(C, BLOCK_C))
        _conv_fwd_kernel[grid](x, weight, bias if bias is not None else weight, s0 if s0 is not None else x,
                               cu_seqlens, seq, y, T, C, x.stride(0), y.stride(0), W=W, HAS_BIAS=bias is not None,
                               HAS_S0=s0 is not None, SILU=activation == "silu", BT=BLOCK_T, BC=BLOCK_C, **_COMPILE)
    return y, _last_inputs(x, initial_state, cu_seqlens, W)


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, cu_seqlens, activation):
        ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens)
        ctx.activation = activation
        return conv_fwd(x, weight, bias, cu_seqlens, initial_state, activation)

    @staticmethod
    def backward(ctx, dy, dstate):
        # recompute the reference under autograd and differentiate it (module docstring)
        x, weight, bias, s0, cu = ctx.saved_tensors
        leaves = [t.detach().requires_grad_(t.requires_grad) if t is not None else None for t in (x, weight, bias, s0)]
        with torch.enable_grad():
            y, st = causal_conv1d_ref(*leaves[:3], cu, initial_state=leaves[3], activation=ctx.activation,
                                      exact=False)
            outs, gout = [y], [dy]
            if dstate is not None:
                outs.append(st)
                gout.append(dstate)
            need = [t for t in leaves if t is not None and t.requires_grad]
            got = iter(torch.autograd.grad(outs, need, gout, allow_unused=True) if need else ())
        return (*[next(got) if t is not None and t.requires_grad else None for t in leaves], None, None)


def causal_conv1d(x, weight, bias, cu_seqlens, *, initial_state=None, activation="silu"):
    """The Triton path of `rlfuse.kernels.gated_delta.conv.causal_conv1d`."""
    return _CausalConv1d.apply(x, weight, bias, initial_state, cu_seqlens, activation)


def causal_conv1d_update(x, conv_state, weight, bias, activation="silu"):
    """The Triton path of `rlfuse.kernels.gated_delta.conv.causal_conv1d_update` (inference
    only: no autograd). conv_state is shifted in place."""
    B, C = x.shape
    W = weight.shape[1]
    if conv_state.stride(-1) != 1:
        raise ValueError("causal_conv1d_update: conv_state must have a unit stride in its last dim "
                         f"(it is updated in place), got strides {conv_state.stride()}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if B:
        weight = weight.contiguous()
        _conv_update_kernel[(B, triton.cdiv(C, BLOCK_C))](
            x, weight, bias if bias is not None else weight, conv_state, y, C, x.stride(0), y.stride(0),
            conv_state.stride(0), conv_state.stride(1), W=W, HAS_BIAS=bias is not None,
            SILU=activation == "silu", BC=BLOCK_C, **_COMPILE)
    return y
