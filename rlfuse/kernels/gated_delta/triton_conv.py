"""Causal conv1d, the Triton half: prefill (varlen) and decode-update kernels, launchers
and the autograd Function (contract and summation order: `rlfuse.kernels.gated_delta.conv`).

Both kernels build a token's W-value window (from its sequence, or from the conv state
for positions before the sequence's start) and call the one `_conv_window` function:
products added left to right, bias last, SiLU as x * sigmoid(x). FMA contraction is off
in both, so a product is rounded before its add and a token's y has the same bits from
the prefill kernel and from the update kernel. Grids: (token blocks, channel blocks);
the token -> sequence map is computed on the device (`searchsorted`), no host sync.
Backward: da = dy * act'(pre-activation) with dweight / dbias partial sums per program
(summed in order by torch), then dx (a token's gradient from the W outputs that read it,
plus the returned state's gradient) and d initial_state; no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.triton_common import round_to

_COMPILE = dict(enable_fp_fusion=False)
BLOCK_T, BLOCK_C = 16, 64  # tile of the prefill kernel (any: each element is computed on its own)
BWD_STEPS = 16  # token tiles per program in the dw / dbias pass: partial sums of 256 tokens each


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


@triton.jit
def _window_x(X, S0, t, tm, c, cm, seq, pos, C, sx, j, W: tl.constexpr, HAS_S0: tl.constexpr):
    """x at window slot j of tokens t (BT,) and channels c (BC,): the input at position
    pos - (W-1) + j of the token's sequence, or the conv state's entry for positions
    before the start (zero without a state), as fp32 (BT, BC)."""
    src = pos - (W - 1) + j
    inseq = src >= 0
    xj = tl.load(X + (t - (W - 1) + j)[:, None] * sx + c[None, :],
                 mask=(tm & inseq)[:, None] & cm[None, :], other=0.0).to(tl.float32)
    if HAS_S0:  # positions before the start come from the state's last W-1 columns
        sj = tl.load(S0 + (seq * C)[:, None] * (W - 1) + c[None, :] * (W - 1) + (W - 1 + src)[:, None],
                     mask=(tm & ~inseq)[:, None] & cm[None, :], other=0.0).to(tl.float32)
        xj = tl.where(inseq[:, None], xj, sj)
    return xj


@triton.jit
def _token_seq(CU, SEQ, t, tm):
    seq = tl.load(SEQ + t, mask=tm, other=0).to(tl.int64)
    start = tl.load(CU + seq, mask=tm, other=0).to(tl.int64)
    n = tl.load(CU + seq + 1, mask=tm, other=0).to(tl.int64) - start
    return seq, t - start, n


@triton.jit(do_not_specialize=["T"])
def _conv_fwd_kernel(X, Wt, Bias, S0, CU, SEQ, Y, T, C, sx, sy, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                     HAS_S0: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tm = t < T
    cm = c < C
    seq, pos, _ = _token_seq(CU, SEQ, t, tm)
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(W):
        xj = _window_x(X, S0, t, tm, c, cm, seq, pos, C, sx, j, W, HAS_S0)
        wj = tl.load(Wt + c * W + j, mask=cm, other=0.0).to(tl.float32)
        acc = _conv_window(acc, xj, wj[None, :], j)
    bias = tl.load(Bias + c, mask=cm, other=0.0).to(tl.float32)[None, :] if HAS_BIAS else 0.0
    y = _finish(acc, bias, HAS_BIAS, SILU)
    YT: tl.constexpr = Y.dtype.element_ty
    tl.store(Y + t[:, None] * sy + c[None, :], round_to(y, YT).to(YT), mask=tm[:, None] & cm[None, :])


@triton.jit(do_not_specialize=["T"])
def _conv_bwd_da_kernel(X, Wt, Bias, S0, CU, SEQ, DY, DA, DWP, DBP, T, C, sx, sdy, W: tl.constexpr,
                        WP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, SILU: tl.constexpr,
                        BT: tl.constexpr, STEPS: tl.constexpr, BC: tl.constexpr):
    """da = dy * act'(pre-activation) (T, C) fp32, and this program's partial sums over its
    BT * STEPS tokens of dw (C, W) and dbias (C,)."""
    pid_t = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    jw = tl.arange(0, WP)
    dw = tl.zeros((BC, WP), dtype=tl.float32)
    db = tl.zeros((BC,), dtype=tl.float32)
    for s in range(STEPS):
        t = (pid_t * STEPS + s).to(tl.int64) * BT + tl.arange(0, BT)
        tm = t < T
        seq, pos, _ = _token_seq(CU, SEQ, t, tm)
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        for j in tl.static_range(W):
            xj = _window_x(X, S0, t, tm, c, cm, seq, pos, C, sx, j, W, HAS_S0)
            acc = _conv_window(acc, xj, tl.load(Wt + c * W + j, mask=cm, other=0.0).to(tl.float32)[None, :], j)
        if HAS_BIAS:
            acc = acc + tl.load(Bias + c, mask=cm, other=0.0).to(tl.float32)[None, :]
        da = tl.load(DY + t[:, None] * sdy + c[None, :], mask=tm[:, None] & cm[None, :], other=0.0).to(tl.float32)
        if SILU:
            sg = tl.sigmoid(acc)
            da = da * sg * (1.0 + acc * (1.0 - sg))
        tl.store(DA + t[:, None] * C + c[None, :], da, mask=tm[:, None] & cm[None, :])
        db += tl.sum(da, 0)
        for j in tl.static_range(W):
            xj = _window_x(X, S0, t, tm, c, cm, seq, pos, C, sx, j, W, HAS_S0)
            dw += tl.where(jw[None, :] == j, tl.sum(da * xj, 0)[:, None], 0.0)
    tl.store(DWP + (pid_t * C + c)[:, None] * W + jw[None, :], dw, mask=cm[:, None] & (jw[None, :] < W))
    tl.store(DBP + pid_t * C + c, db, mask=cm)


@triton.jit(do_not_specialize=["T"])
def _conv_bwd_dx_kernel(Wt, CU, SEQ, DA, DST, DX, T, C, sdx, W: tl.constexpr, HAS_DST: tl.constexpr,
                        BT: tl.constexpr, BC: tl.constexpr):
    """dx_t = sum_j w_j da_{t+W-1-j} over outputs of the same sequence, plus the gradient of
    the returned conv state for the sequence's last W-1 inputs."""
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tm = t < T
    cm = c < C
    seq, pos, n = _token_seq(CU, SEQ, t, tm)
    dx = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(W):
        ok = tm & (pos + (W - 1 - j) < n)
        da = tl.load(DA + (t + (W - 1 - j))[:, None] * C + c[None, :], mask=ok[:, None] & cm[None, :], other=0.0)
        dx += tl.load(Wt + c * W + j, mask=cm, other=0.0).to(tl.float32)[None, :] * da
    if HAS_DST:
        i = pos - (n - (W - 1))
        dx += tl.load(DST + (seq * C)[:, None] * (W - 1) + c[None, :] * (W - 1) + i[:, None],
                      mask=(tm & (i >= 0))[:, None] & cm[None, :], other=0.0).to(tl.float32)
    tl.store(DX + t[:, None] * sdx + c[None, :], dx.to(DX.dtype.element_ty), mask=tm[:, None] & cm[None, :])


@triton.jit
def _conv_bwd_ds0_kernel(Wt, CU, DA, DST, DS0, C, W: tl.constexpr, HAS_DST: tl.constexpr, BC: tl.constexpr):
    """d initial_state[b, :, m] = sum_{j<=m} w_j da_{start+m-j} (outputs inside the
    sequence), plus the returned state's gradient where the sequence is shorter than W-1."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    start = tl.load(CU + b).to(tl.int64)
    n = tl.load(CU + b + 1).to(tl.int64) - start
    for m in tl.static_range(W - 1):
        acc = tl.zeros((BC,), dtype=tl.float32)
        for j in tl.static_range(m + 1):
            inseq = tl.full((BC,), m - j, tl.int64) < n  # output position m - j exists
            da = tl.load(DA + (start + m - j) * C + c, mask=cm & inseq, other=0.0)
            acc += tl.load(Wt + c * W + j, mask=cm, other=0.0).to(tl.float32) * da
        if HAS_DST:  # state entry m is still in the returned state when n <= m
            short = tl.full((BC,), m, tl.int64) >= n
            acc += tl.load(DST + (b * C + c) * (W - 1) + m - n, mask=cm & short, other=0.0).to(tl.float32)
        tl.store(DS0 + (b * C + c) * (W - 1) + m, acc, mask=cm)


@triton.jit
def _conv_update_kernel(X, Wt, Bias, S, SLOT, Y, C, sx, sy, ss_b, ss_c, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                        SILU: tl.constexpr, HAS_SLOT: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    if HAS_SLOT:  # the state lives in a pool: row b shifts slot SLOT[b] in place
        s_row = tl.load(SLOT + b).to(tl.int64)
    else:
        s_row = b
    S_b = S + s_row * ss_b
    x = tl.load(X + b * sx + c, mask=cm, other=0.0)
    acc = tl.zeros((BC,), dtype=tl.float32)
    for j in tl.static_range(W - 1):
        sj = tl.load(S_b + c * ss_c + j, mask=cm, other=0.0)
        acc = _conv_window(acc, sj.to(tl.float32), tl.load(Wt + c * W + j, mask=cm, other=0.0).to(tl.float32), j)
        if j > 0:  # shift the state left by one (the oldest input leaves)
            tl.store(S_b + c * ss_c + j - 1, sj, mask=cm)
    acc = _conv_window(acc, x.to(tl.float32), tl.load(Wt + c * W + W - 1, mask=cm, other=0.0).to(tl.float32),
                       W - 1)
    ST: tl.constexpr = S.dtype.element_ty  # x rounded to nearest-even if the state is narrower (exact if not)
    tl.store(S_b + c * ss_c + W - 2, round_to(x.to(tl.float32), ST).to(ST), mask=cm)
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
    return buf[rows].transpose(1, 2).contiguous()


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


def conv_bwd(x, weight, bias, cu_seqlens, initial_state, activation, dy, dstate):
    """dx, dweight, dbias, d initial_state (None for absent inputs). dweight and dbias are
    per-program partial sums added in order by torch: deterministic, no atomics."""
    T, C = x.shape
    W = weight.shape[1]
    B = cu_seqlens.shape[0] - 1
    x = x if x.stride(-1) == 1 else x.contiguous()
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    weight = weight.contiguous()
    s0 = initial_state.contiguous() if initial_state is not None else None
    dst = dstate.contiguous() if dstate is not None else None
    seq = torch.searchsorted(cu_seqlens[1:].contiguous(), torch.arange(T, device=x.device, dtype=cu_seqlens.dtype),
                             right=True)
    da = torch.empty(T, C, dtype=torch.float32, device=x.device)
    nblk = max(1, triton.cdiv(T, BLOCK_T * BWD_STEPS))
    dwp = torch.zeros(nblk, C, W, dtype=torch.float32, device=x.device)
    dbp = torch.zeros(nblk, C, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    ds0 = torch.empty(B, C, W - 1, dtype=torch.float32, device=x.device)
    grid_c = triton.cdiv(C, BLOCK_C)
    if T:
        _conv_bwd_da_kernel[(nblk, grid_c)](
            x, weight, bias if bias is not None else weight, s0 if s0 is not None else x, cu_seqlens, seq, dy, da,
            dwp, dbp, T, C, x.stride(0), dy.stride(0), W=W, WP=triton.next_power_of_2(W), HAS_BIAS=bias is not None,
            HAS_S0=s0 is not None, SILU=activation == "silu", BT=BLOCK_T, STEPS=BWD_STEPS, BC=BLOCK_C, **_COMPILE)
        _conv_bwd_dx_kernel[(triton.cdiv(T, BLOCK_T), grid_c)](
            weight, cu_seqlens, seq, da, dst if dst is not None else da, dx, T, C, dx.stride(0), W=W,
            HAS_DST=dst is not None, BT=BLOCK_T, BC=BLOCK_C, **_COMPILE)
    if s0 is not None and B:
        _conv_bwd_ds0_kernel[(B, grid_c)](weight, cu_seqlens, da, dst if dst is not None else da, ds0, C, W=W,
                                         HAS_DST=dst is not None, BC=BLOCK_C, **_COMPILE)
    dw = dwp.sum(0).to(weight.dtype)
    db = dbp.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dw, db, (ds0.to(initial_state.dtype) if initial_state is not None else None)


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, cu_seqlens, activation):
        ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens)
        ctx.activation = activation
        return conv_fwd(x, weight, bias, cu_seqlens, initial_state, activation)

    @staticmethod
    def backward(ctx, dy, dstate):
        x, weight, bias, s0, cu = ctx.saved_tensors
        dx, dw, db, ds0 = conv_bwd(x, weight, bias, cu, s0, ctx.activation, dy, dstate)
        return dx, dw, db, ds0, None, None


def causal_conv1d(x, weight, bias, cu_seqlens, *, initial_state=None, activation="silu"):
    """The Triton path of `rlfuse.kernels.gated_delta.conv.causal_conv1d`."""
    return _CausalConv1d.apply(x, weight, bias, initial_state, cu_seqlens, activation)


def causal_conv1d_update(x, conv_state, weight, bias, activation="silu", state_slots=None):
    """The Triton path of `rlfuse.kernels.gated_delta.conv.causal_conv1d_update` (inference
    only: no autograd). conv_state (or with `state_slots` its slots) is shifted in place."""
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
            x, weight, bias if bias is not None else weight, conv_state,
            state_slots if state_slots is not None else conv_state, y, C, x.stride(0), y.stride(0),
            conv_state.stride(0), conv_state.stride(1), W=W, HAS_BIAS=bias is not None,
            SILU=activation == "silu", HAS_SLOT=state_slots is not None, BC=BLOCK_C, **_COMPILE)
    return y
