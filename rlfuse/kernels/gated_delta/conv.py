"""Depthwise causal conv1d over packed varlen sequences (Gated DeltaNet's short conv on
q, k, v), prefill and one-token decode update.

Contract:
  y, conv_state = causal_conv1d(x, weight, bias, cu_seqlens, *, initial_state=None, activation="silu")
  y = causal_conv1d_update(x, conv_state, weight, bias, activation="silu", state_slots=None)
x (T, C) packed (prefill) or (B, C) (update); weight (C, W) depthwise (HF stores
conv1d.weight as (C, 1, W)); bias (C,) or None; initial_state / conv_state (B, C, W-1) =
the previous W-1 inputs of each sequence, oldest first (zeros if None). Prefill returns
the last W-1 inputs of each sequence (taken from initial_state where it is shorter);
the update shifts x into conv_state in place. y in x.dtype.
With `state_slots` (B,) int64, the update's `conv_state` is a POOL of per-slot states
(N, C, W-1) (the engine's, one slot per running sequence, in its storage dtype): row b
reads and shifts conv_state[state_slots[b]] in place (no gather / scatter copies, no dtype
round trip; fixed shapes, no host values: the static decode step). The arithmetic is the
pool-free update's on the gathered states, so the bits are the same (the window's state
values are the ones the update wrote, inputs of x.dtype; a state of a wider dtype holds
them exactly). Rows sharing a slot (padding rows on the engine's scratch slot) leave its
contents and their own outputs undefined.

Math: y_t = act(sum_{j=0}^{W-1} w[j] x_{t-W+1+j} + bias), in fp32, the products added
left to right (j = 0, 1, ..., W-1) and the bias last, then SiLU (x * sigmoid(x)), then one
cast. Prefill and update build the same W-value window and run the same elementwise ops
in the same order (`_window_conv`), so a token's y has the same bits either way (on the
Triton backend, one shared `conv_window` function with FMA contraction off). Tests:
`python -m pytest -q tests/test_kernel_gated_delta_layers.py`.
"""

from __future__ import annotations

import torch

from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.invariant import pointwise

ACTIVATIONS = (None, "silu")


def _silu(y: torch.Tensor, exact: bool) -> torch.Tensor:
    return pointwise(torch.nn.functional.silu, y) if exact else torch.nn.functional.silu(y)


def _window_conv(xw: torch.Tensor, weight: torch.Tensor, bias, activation, exact: bool) -> torch.Tensor:
    """xw (N, C, W) the windows (oldest first) -> (N, C) fp32 (fp64 for fp64 inputs):
    products added left to right, bias last, then the activation."""
    ct = torch.float64 if xw.dtype == torch.float64 else torch.float32
    xw, w = xw.to(ct), weight.to(ct)
    acc = xw[..., 0] * w[:, 0]
    for j in range(1, w.shape[1]):
        acc = acc + xw[..., j] * w[:, j]
    if bias is not None:
        acc = acc + bias.to(ct)
    return _silu(acc, exact) if activation == "silu" else acc


def causal_conv1d_ref(x, weight, bias, cu_seqlens, *, initial_state=None, activation="silu", exact=None):
    """Prefill reference: gathers each token's window from its sequence (or the initial
    state) and applies `_window_conv`; differentiable by autograd."""
    exact = is_exact() if exact is None else exact
    T, C = x.shape
    W = weight.shape[1]
    B = cu_seqlens.shape[0] - 1
    if initial_state is None:
        initial_state = x.new_zeros(B, C, W - 1)
    # rows [0, T) = x, then B blocks of W-1 rows = each sequence's initial state
    buf = torch.cat([x, initial_state.to(x.dtype).transpose(1, 2).reshape(B * (W - 1), C)])
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(B, device=x.device), lens, output_size=T)   # (T,)
    pos = torch.arange(T, device=x.device) - cu[:-1][seq]                            # position in seq
    src = pos[:, None] - (W - 1) + torch.arange(W, device=x.device)[None, :]         # (T, W)
    rows = torch.where(src >= 0, cu[:-1][seq][:, None] + src, T + seq[:, None] * (W - 1) + (W - 1) + src)
    y = _window_conv(buf[rows].transpose(1, 2), weight, bias, activation, exact)
    # the last W-1 inputs of each sequence: positions n-W+1 .. n-1
    src = lens[:, None] - (W - 1) + torch.arange(W - 1, device=x.device)[None, :]    # (B, W-1)
    rows = torch.where(src >= 0, cu[:-1][:, None] + src,
                       T + torch.arange(B, device=x.device)[:, None] * (W - 1) + (W - 1) + src)
    return y.to(x.dtype), buf[rows].transpose(1, 2).contiguous()  # (B, C, W-1), updated in place later


def causal_conv1d_update_ref(x, conv_state, weight, bias, activation="silu", exact=None, state_slots=None):
    """Decode reference: x (B, C); conv_state (B, C, W-1) shifted in place (with
    `state_slots`: the slots' states gathered, updated, scattered back into the pool)."""
    exact = is_exact() if exact is None else exact
    if state_slots is not None:
        st = conv_state.index_select(0, state_slots)
        y = causal_conv1d_update_ref(x, st, weight, bias, activation, exact)
        conv_state.index_copy_(0, state_slots, st)
        return y
    xw = torch.cat([conv_state.to(x.dtype), x[:, :, None]], -1)
    y = _window_conv(xw, weight, bias, activation, exact)
    conv_state.copy_(xw[..., 1:])
    return y.to(x.dtype)


def _check(weight, bias, activation, C, where):
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"{where}: weight must be (C, W) with C = {C}, got {tuple(weight.shape)} "
                         "(squeeze HF's (C, 1, W) conv1d.weight)")
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"{where}: bias must be (C,) = ({C},), got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: activation must be one of {ACTIVATIONS}, got {activation!r}")


def causal_conv1d(x, weight, bias, cu_seqlens, *, initial_state=None, activation="silu"):
    """Public prefill op: (y (T, C), conv_state (B, C, W-1)); picks the backend."""
    _check(weight, bias, activation, x.shape[-1], "causal_conv1d")
    B, C, W = cu_seqlens.shape[0] - 1, x.shape[-1], weight.shape[1]
    if initial_state is not None and initial_state.shape != (B, C, W - 1):
        raise ValueError(f"causal_conv1d: initial_state must be (B, C, W-1) = {(B, C, W - 1)}, "
                         f"got {tuple(initial_state.shape)}")
    if resolve_backend("causal_conv1d", x) == "triton":
        return triton_ops("gated_delta.triton_conv").causal_conv1d(x, weight, bias, cu_seqlens,
                                                                   initial_state=initial_state,
                                                                   activation=activation)
    return causal_conv1d_ref(x, weight, bias, cu_seqlens, initial_state=initial_state, activation=activation)


def causal_conv1d_update(x, conv_state, weight, bias, activation="silu", state_slots=None):
    """Public decode op: y (B, C); conv_state (B, C, W-1) updated in place, or with
    `state_slots` (B,) int64 a pool (N, C, W-1) whose slots are updated in place."""
    _check(weight, bias, activation, x.shape[-1], "causal_conv1d_update")
    B, C, W = x.shape[0], x.shape[1], weight.shape[1]
    if state_slots is None and conv_state.shape != (B, C, W - 1):
        raise ValueError(f"causal_conv1d_update: conv_state must be (B, C, W-1) = "
                         f"{(B, C, W - 1)}, got {tuple(conv_state.shape)}")
    if state_slots is not None:
        if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (C, W - 1):
            raise ValueError(f"causal_conv1d_update: with state_slots, conv_state must be a pool (N, C, W-1) with "
                             f"(C, W-1) = {(C, W - 1)}, got {tuple(conv_state.shape)}")
        if state_slots.shape != (B,) or state_slots.dtype != torch.int64:
            raise ValueError(f"causal_conv1d_update: state_slots must be (B,) = ({B},) int64, got "
                             f"{tuple(state_slots.shape)} {state_slots.dtype}")
    if resolve_backend("causal_conv1d_update", x) == "triton":
        return triton_ops("gated_delta.triton_conv").causal_conv1d_update(x, conv_state, weight, bias,
                                                                          activation=activation,
                                                                          state_slots=state_slots)
    return causal_conv1d_update_ref(x, conv_state, weight, bias, activation, state_slots=state_slots)
