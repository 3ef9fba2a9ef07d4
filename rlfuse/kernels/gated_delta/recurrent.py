"""The gated delta rule token by token: the fast-numerics decode path.

Contract:
  o, state = fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, *,
                                              initial_state=None, scale=None, state_out=None,
                                              state_slots=None, gate_params=None)
  g, beta = gdn_gates(a, b, A_log, dt_bias)
inputs as `chunk_gated_delta_rule`'s (raw q, k: l2-normalized and scaled inside; packed
varlen sequences); returns o (T, Hv, Dv) in v.dtype and the state after the LAST token of
each sequence (B, Hv, Dk, Dv) fp32, written into `state_out` when given (it may be
`initial_state` itself: an in-place decode step, CUDA-graph friendly).
`cu_seqlens` None: one token per sequence (T = B, the decode step; no offsets to build).
With `state_slots` (B,) int64, `initial_state` is a POOL of per-slot states (N, Hv, Dk, Dv)
fp32 (the engine's, one slot per running sequence): sequence b starts from
initial_state[state_slots[b]] and its final state is written back into that slot in place
(no gather / scatter copies of the states; fixed shapes, no host values: the engine's
static decode step, captured in CUDA graphs); the pool is returned as `state`. Sequences
sharing a slot (the decode step's padding rows on the engine's scratch slot) leave that
slot's contents undefined.
With `gate_params = (A_log, dt_bias)` (each (Hv,)), the `g` and `beta` arguments are the RAW
projections a and b (T, Hv) and the kernel computes the gates in its prologue, as
`gdn_gates` (the reference) does: no separate elementwise kernels in the decode step.

Gates (HF's order): beta = sigmoid(b) rounded to b.dtype (the model dtype); g =
-exp(A_log.float()) * softplus(a.float() + dt_bias.float()) in fp32 (A_log and a in fp32:
exp(A) would overflow in fp16; softplus(x) = x above 20, log1p(exp(x)) below, torch's
threshold). The Triton prologue's exp / log / sigmoid are not torch's bit for bit: a fast
path, within fp32 rounding of the reference.

Math, per token: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q (HF's
`torch_recurrent_gated_delta_rule` order). One token costs O(Dk Dv) per head, against the
chunked call's O(64 (Dk + Dv) 64) over the buffered tokens, but it rounds differently
from the chunked form, so it is a FAST-numerics path only: in exact numerics the engine
keeps the chunk-boundary state and a buffer, and calls `chunk_gated_delta_rule` (see its
docstring); calling this op under exact numerics is an error. With the same state layout
the engine can still start from the chunk state S_c by passing [buffer + new tokens].
Tests: `python -m pytest -q tests/test_kernel_gated_delta.py -k recurrent`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.gated_delta.chunk import check_inputs, check_state_pool, recurrent_gated_delta_rule_ref
from rlfuse.kernels.invariant import elementwise


def gdn_gates(a, b, A_log, dt_bias):
    """The gates from the raw projections a, b (T, Hv) -> g (T, Hv) fp32, beta (T, Hv) in
    b.dtype (module docstring; the trainer's and the exact engine's, and the reference of
    the recurrent kernel's gate prologue)."""
    beta = elementwise(torch.sigmoid, b)
    decay = elementwise(torch.exp, A_log.float())
    return -decay * elementwise(F.softplus, a.float() + dt_bias), beta


def _check_gate_params(gate_params, Hv: int):
    if len(gate_params) != 2 or any(p.shape != (Hv,) for p in gate_params):
        raise ValueError(f"fused_recurrent_gated_delta_rule: gate_params must be (A_log, dt_bias), each (Hv,) = "
                         f"({Hv},), got {[tuple(p.shape) for p in gate_params]}")


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, *, initial_state=None, scale=None,
                                     state_out=None, state_slots=None, gate_params=None):
    """Public op (contract in the module docstring): picks the backend; fast numerics only."""
    if is_exact():
        raise ValueError("fused_recurrent_gated_delta_rule is the fast-numerics decode path; exact numerics "
                         "decodes through chunk_gated_delta_rule from the chunk-boundary state + buffer")
    B = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    Hv, Dk, Dv = v.shape[1], q.shape[2], v.shape[2]
    if state_slots is not None:
        check_state_pool("fused_recurrent_gated_delta_rule", initial_state, state_slots, B, (Hv, Dk, Dv))
        if state_out is not None:
            raise ValueError("fused_recurrent_gated_delta_rule: state_slots writes the states back into the pool "
                             "(initial_state); pass no state_out")
        check_inputs(q, k, v, g, beta, cu_seqlens, None)
    else:
        check_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    if state_out is not None and (state_out.shape != (B, Hv, Dk, Dv) or state_out.dtype != torch.float32):
        raise ValueError(f"fused_recurrent_gated_delta_rule: state_out must be fp32 (B, Hv, Dk, Dv) = "
                         f"{(B, Hv, Dk, Dv)}, got {tuple(state_out.shape)} {state_out.dtype}")
    scale = Dk ** -0.5 if scale is None else float(scale)
    if gate_params is not None:
        _check_gate_params(gate_params, Hv)
    if resolve_backend("fused_recurrent_gated_delta_rule", v) == "triton":
        return triton_ops("gated_delta.triton_recurrent").fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens, initial_state=initial_state, scale=scale, state_out=state_out,
            state_slots=state_slots, gate_params=gate_params)
    if gate_params is not None:  # g, beta are the raw a, b
        g, beta = gdn_gates(g, beta, *gate_params)
    if cu_seqlens is None:
        cu_seqlens = torch.arange(B + 1, device=v.device, dtype=torch.int32)
    if state_slots is not None:  # the reference gathers the slots' states and scatters the results back
        o, state = recurrent_gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens,
                                                  initial_state=initial_state.index_select(0, state_slots),
                                                  scale=scale)
        if state is not None:
            initial_state.index_copy_(0, state_slots, state.float())
        return o, initial_state
    o, state = recurrent_gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens, initial_state=initial_state,
                                              scale=scale)
    state = state.float() if state is not None else torch.zeros(0, Hv, Dk, Dv, device=v.device)
    if state_out is not None:
        state_out.copy_(state)
        state = state_out
    return o, state
