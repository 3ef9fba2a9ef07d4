"""Rotary position embedding, NeoX half-split layout (Llama / Qwen in `transformers`).

For x (T, H, Dh) with halves x1 = x[..., :Dh/2], x2 = x[..., Dh/2:] and angles
a = positions[:, None] * inv_freq[None, :] computed in fp32:
    y1 = x1 cos a - x2 sin a,   y2 = x2 cos a + x1 sin a
Arithmetic in fp32, result cast to x.dtype. `inv_freq` (Dh/2,) fp32 already holds any
frequency scaling (Llama-3 "llama3" rope type): see `rope_inv_freq`.
Batch-invariant: each token uses only its own position.

Triton path: one program per block of BLOCK_T tokens and group of heads computes the
fp32 angles pos * inv_freq in-kernel (the same product as the reference: int position
-> fp32, times fp32 inv_freq) and their cos/sin once (or loads them from the step's
table, below), then loops over its heads. The backward is
the same kernel rotating by -a:
    dx1 = dy1 cos a + dy2 sin a,   dx2 = dy2 cos a - dy1 sin a
Output and gradient are new contiguous (T, H, Dh) tensors in x.dtype; x may be any
(T, H, Dh) view with unit stride on the last dim (e.g. q_proj(x).view(T, H, Dh)).

The step's table: every layer of a forward rotates by the same angles, so the model computes
`cos_sin = rope_cos_sin(positions, inv_freq)` once, a (T, Dh) fp32 [cos a | sin a] made
by the kernels' own cos/sin code, and passes it to every layer's `rope` / `qk_norm_rope`
(`cos_sin=`), whose Triton kernels then load cos/sin instead of computing them: the same
bits, with libdevice sin/cos run once per token per forward instead of once per token,
layer and program. On the reference backend `rope_cos_sin` gives None and the references
compute their own (a table is never needed for the result, only for speed).

Multi-axis RoPE (Qwen3-VL's interleaved mRoPE over (t, h, w) position rows; the vision
tower's 2-D RoPE over (h, w)): frequency f of a token turns by positions[axis[f], t] *
inv_freq[f], `axis` (Dh/2,) naming the row. Only the table changes: `rope_cos_sin(positions
(R, T), inv_freq, axis)` builds it (Triton kernel or reference, per backend) and every op
then runs from the table as above. A token whose rows are equal gets the single-row bits.

Fused with the per-head norms and the KV store (the decode path's small kernels):
`qk_norm_rope(q, k, positions, inv_freq, q_weight, k_weight, eps, v=, kv_cache=,
slot_mapping=)` is, as the reference `qk_norm_rope_ref` spells out,
    q, k = rmsnorm(q, q_weight, eps), rmsnorm(k, k_weight, eps)   (weights given: Qwen3)
    q, k = rope(q, positions, inv_freq), rope(k, positions, inv_freq)
    store_kvcache(k, v, *kv_cache, slot_mapping)                   (kv_cache given)
in one Triton launch, bitwise equal to that sequence in both numerics: each head row is
normalized with the RMSNorm kernel's own row reduction, tile and rounding steps
(`rlfuse.kernels.norm.triton_rms`), then rotated with the RoPE arithmetic above. With
kv_cache it returns (q, None): k lives only in the cache. Forward only: where autograd
records, the op runs the unfused sequence (the same bits) and their backward kernels.
Tests: `python -m pytest -q tests/test_kernel_layers.py tests/test_kernel_fused.py -k rope`.
"""

from __future__ import annotations

import math

import torch

from rlfuse.kernels.attention.paged import store_kvcache
from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.invariant import pointwise
from rlfuse.kernels.norm.rms import rmsnorm


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) in fp32, with Llama-3 scaling if given.

    `scaling` is the HF `rope_parameters` / `rope_scaling` dict; supported rope types are
    "default" and "llama3" (others raise ValueError naming the type).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r} is not supported (expected 'default' or 'llama3')")
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_angles_ref(positions: torch.Tensor, inv_freq: torch.Tensor, axis: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 angles (T, Dh/2): float(positions)[:, None] * inv_freq; with `axis` (Dh/2,)
    and positions (R, T), frequency f reads row axis[f] (multi-axis RoPE, module docstring)."""
    if axis is None:
        return positions.float()[:, None] * inv_freq.float()[None, :]
    # gathered to the layout of the single-row product (contiguous (T, Dh/2)): equal rows give its bits
    return positions[axis.to(positions.device)].t().contiguous().float() * inv_freq.float()[None, :]


def _cos_sin_ref(ang: torch.Tensor, exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # exact: every element on one CPU code path (see rlfuse.kernels.invariant), so a token's
    # rotation ignores T
    return (pointwise(torch.cos, ang), pointwise(torch.sin, ang)) if exact else (ang.cos(), ang.sin())


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
             exact: bool = False, cos_sin: torch.Tensor | None = None) -> torch.Tensor:
    # x (T, H, Dh), positions (T,), inv_freq (Dh/2,); cos_sin: a (T, Dh) table to use instead
    if cos_sin is None:
        cos, sin = _cos_sin_ref(rope_angles_ref(positions, inv_freq), exact)
    else:
        cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, Dh/2)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 axis: torch.Tensor | None = None) -> torch.Tensor | None:
    """positions (T,) -> the step's cos/sin table (T, Dh) fp32 for the Triton kernels, or
    None where rope runs the reference (see the module docstring). Multi-axis RoPE:
    positions (R, T) and `axis` (Dh/2,) -> always a table (the ops then need it: they take
    the (T,) positions of one row only), by the backend's own cos/sin code."""
    if resolve_backend("rope", positions) == "triton":
        return triton_ops("rope.triton_rotary").cos_sin_table(positions, inv_freq, axis)
    if axis is None:
        return None
    return torch.cat(_cos_sin_ref(rope_angles_ref(positions, inv_freq, axis), is_exact()), dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
         cos_sin: torch.Tensor | None = None) -> torch.Tensor:
    """cos_sin: `rope_cos_sin(positions, inv_freq)` (optional, same result), or a
    multi-axis table (required for those)."""
    if resolve_backend("rope", x) == "triton":  # elementwise: batch-invariant in both numerics
        return triton_ops("rope.triton_rotary").rope(x, positions, inv_freq, cos_sin)
    return rope_ref(x, positions, inv_freq, exact=is_exact(), cos_sin=cos_sin)


def qk_norm_rope_ref(q, k, positions, inv_freq, q_weight=None, k_weight=None, eps=0.0, *,
                     v=None, kv_cache=None, slot_mapping=None, cos_sin=None):
    """The spec of `qk_norm_rope`: the unfused public ops in sequence (on the torch
    backend, the references of the current numerics)."""
    if q_weight is not None:
        q, k = rmsnorm(q, q_weight, eps), rmsnorm(k, k_weight, eps)
    q, k = rope(q, positions, inv_freq, cos_sin), rope(k, positions, inv_freq, cos_sin)
    if kv_cache is None:
        return q, k
    store_kvcache(k, v, kv_cache[0], kv_cache[1], slot_mapping)
    return q, None


def qk_norm_rope(q, k, positions, inv_freq, q_weight=None, k_weight=None, eps=0.0, *,
                 v=None, kv_cache=None, slot_mapping=None, cos_sin=None):
    """q (T, Hq, Dh), k (T, Hkv, Dh) -> (q, k) normalized (if weights) and rotated; with
    kv_cache = (k_cache, v_cache), v (T, Hkv, Dh) and slot_mapping (T,): k and v stored,
    -> (q, None). One launch on the Triton backend outside autograd. cos_sin: the step's
    table (`rope_cos_sin`; optional, same result)."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: give both q_weight and k_weight, or neither")
    if (kv_cache is None) != (v is None) or (kv_cache is None) != (slot_mapping is None):
        raise ValueError("qk_norm_rope: kv_cache, v and slot_mapping go together")
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, q_weight, k_weight))
    if resolve_backend("rope", q) == "triton" and not grad:
        return triton_ops("rope.triton_rotary").qk_norm_rope_triton(q, k, positions, inv_freq, q_weight, k_weight, eps,
                                                      v=v, kv_cache=kv_cache, slot_mapping=slot_mapping,
                                                      cos_sin=cos_sin)
    return qk_norm_rope_ref(q, k, positions, inv_freq, q_weight, k_weight, eps, v=v, kv_cache=kv_cache,
                            slot_mapping=slot_mapping, cos_sin=cos_sin)
