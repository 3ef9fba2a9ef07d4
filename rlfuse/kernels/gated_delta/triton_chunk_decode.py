"""The exact decode step from the engine's slots, the Triton half (contract and math:
`rlfuse.kernels.gated_delta.chunk_decode`): the chunked forward's own two kernels
(`triton_chunk`: `_chunk_prep_kernel`, `state_pass_kernel`) with HAS_SLOT, so every value
goes through the same code, tiles and compile settings as the trainer's forward; only the
addresses change (inputs read from the slot's tail, the state read from and written to its
slot). Inference only."""

from __future__ import annotations

import torch
import triton

from rlfuse.kernels.gated_delta.chunk import CHUNK
from rlfuse.kernels.gated_delta.triton_chunk import chunk_prep, state_pass_kernel, tile_config
from rlfuse.kernels.triton_common import dot_precision


def chunk_gated_delta_decode(tail, state, slots, tail_lens, *, scale: float, exact: bool):
    """The Triton path of `rlfuse.kernels.gated_delta.chunk_decode.chunk_gated_delta_decode`."""
    q, k, v, g, beta = tail
    B = slots.shape[0]
    Hv, Dk, Dv = state.shape[1:]
    dev = v.device
    o = torch.empty(B * CHUNK, Hv, Dv, dtype=v.dtype, device=dev)
    if B == 0:
        return o.view(0, Hv, Dv)
    lens = tail_lens + 1                                                  # (B,) the rows of each chunk
    cu = torch.arange(0, (B + 1) * CHUNK, CHUNK, device=dev, dtype=torch.int32)
    cfg = tile_config(Dk, Dv, exact)
    BK, BV = cfg.pop("BK"), cfg.pop("BV")
    # 1. the chunk's state-independent quantities, its rows read from the slot's tail
    prep = chunk_prep(q, k, v, g, beta, cu, scale, BK, BV, cfg, slots=slots, slot_lens=lens)
    # 2. the state pass from S_c in the slot, written back only when the chunk completed
    state_pass_kernel[(triton.cdiv(Dv, BV), B * Hv)](
        *prep["buffers"], cu, prep["coff"], state, o, state, o, slots, lens, o.stride(0), o.stride(1), Hv,
        DK=Dk, DV=Dv, BK=BK, BV=BV, C=CHUNK, HAS_S0=True, STORE_SF=True, STORE_O=True, STORE_H=False,
        PREC=dot_precision(v), HAS_SLOT=True, **cfg)
    # 3. the token's row
    return o.view(B, CHUNK, Hv, Dv)[torch.arange(B, device=dev), tail_lens]
