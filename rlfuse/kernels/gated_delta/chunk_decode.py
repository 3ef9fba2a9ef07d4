"""The exact-numerics decode step of the chunked gated delta rule, from the engine's slots.

Contract:
  o = chunk_gated_delta_decode(tail, state, slots, tail_lens, *, scale=None)
  tail = (q, k (N, CHUNK, Hk, Dk), v (N, CHUNK, Hv, Dv), g (N, CHUNK, Hv) fp32, beta (N, CHUNK, Hv)),
  contiguous: per slot, the raw kernel inputs of the rows since its last chunk boundary, the
  step's new token already written at row tail_lens[b] of slot slots[b]; state (N, Hv, Dk,
  Dv) fp32: each slot's S_c; slots (B,) int64; tail_lens (B,) int64 in [0, CHUNK).
  Returns o (B, Hv, Dv) in v.dtype, the new tokens' outputs. A slot whose token completes
  its chunk (tail_lens[b] = CHUNK - 1) gets the state after that chunk, in place; the
  others keep S_c. Slots shared by several rows (padding rows on a scratch slot) end
  undefined. Fixed shapes, no host values: the engine's static decode step (CUDA graphs).
  Inference only (no autograd).

Math: `chunk_gated_delta_rule` from S_c over each slot's rows [0, tail_lens[b]], laid out
as ONE CHUNK-row chunk whose rows past the token are zeros -- the rows the chunked kernel
pads a shorter sequence with -- read at the token's row. By the chunk contract's (a) and
(b) (`rlfuse.kernels.gated_delta.chunk`), in exact numerics the token's output and the
state after a completed chunk have the bits of the trainer's forward over the whole
sequence; the engine's eager path (one call over [tail + new tokens]) has the same bits.

Steps (Triton, `triton_chunk_decode`: the chunked forward's two kernels, slot-addressed):
  1. the chunk-prep kernel reads the slot's tail rows straight from the pools, the rows
     past the token masked to zero (no gathered or masked copy of the tails);
  2. the state pass reads S_c from the slot and writes the state back in place only when
     the token completed the chunk (1 step in 64; no copy of the states);
  3. the token's row of each chunk's output.
The reference gathers the tails and S_c, masks, calls `chunk_gated_delta_rule_ref`,
selects the state and scatters it back: the same values, bitwise.
Tests: python -m pytest -q tests/test_kernel_gated_delta.py -k decode_state_slots
"""

from __future__ import annotations

import torch

from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.gated_delta.chunk import CHUNK, check_state_pool, chunk_gated_delta_rule_ref


def chunk_gated_delta_decode_ref(tail, state, slots, tail_lens, *, scale=None, exact=None):
    """The contract by gather / mask / `chunk_gated_delta_rule_ref` / select / scatter."""
    exact = is_exact() if exact is None else exact
    B, dev = slots.shape[0], state.device
    Hv, Dv = tail[2].shape[2:]
    valid = torch.arange(CHUNK, device=dev)[None, :] <= tail_lens[:, None]      # (B, CHUNK): tail + the token
    rows = []
    for x in tail:
        buf = x.index_select(0, slots)                                             # (B, CHUNK, ...)
        rows.append(torch.where(valid.view(valid.shape + (1,) * (buf.dim() - 2)), buf, 0.0).flatten(0, 1))
    cu = torch.arange(0, (B + 1) * CHUNK, CHUNK, device=dev, dtype=torch.int32)
    s_c = state.index_select(0, slots)
    o, s_full = chunk_gated_delta_rule_ref(*rows, cu, initial_state=s_c, scale=scale, output_final_state=True,
                                           exact=exact)
    done = (tail_lens == CHUNK - 1).view(B, 1, 1, 1)
    state.index_copy_(0, slots, torch.where(done, s_full.float(), s_c))
    return o.view(B, CHUNK, Hv, Dv)[torch.arange(B, device=dev), tail_lens]


def chunk_gated_delta_decode(tail, state, slots, tail_lens, *, scale=None):
    """Public op (contract in the module docstring): picks the backend."""
    q, k, v, g, beta = tail
    ok = q.dim() == 4 and v.dim() == 4 and q.shape[1] == CHUNK and k.shape == q.shape
    ok = ok and v.shape[:2] == q.shape[:2] and g.shape == v.shape[:3] and beta.shape == g.shape
    if not ok or not all(x.is_contiguous() for x in tail):
        raise ValueError(f"chunk_gated_delta_decode: the tails must be contiguous q, k (N, {CHUNK}, Hk, Dk), "
                         f"v (N, {CHUNK}, Hv, Dv), g and beta (N, {CHUNK}, Hv); got "
                         f"{[tuple(x.shape) for x in tail]}")
    B, Dk = slots.shape[0], q.shape[3]
    check_state_pool("chunk_gated_delta_decode", state, slots, B, (v.shape[2], Dk, v.shape[3]))
    if tail_lens.shape != (B,) or tail_lens.dtype != torch.int64:
        raise ValueError(f"chunk_gated_delta_decode: tail_lens must be (B,) = ({B},) int64, got "
                         f"{tuple(tail_lens.shape)} {tail_lens.dtype}")
    scale = Dk ** -0.5 if scale is None else float(scale)
    if resolve_backend("chunk_gated_delta_decode", v) == "triton":
        return triton_ops("gated_delta.triton_chunk_decode").chunk_gated_delta_decode(
            tail, state, slots, tail_lens, scale=scale, exact=is_exact())
    return chunk_gated_delta_decode_ref(tail, state, slots, tail_lens, scale=scale)
