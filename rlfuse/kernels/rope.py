"""Rotary position embedding, NeoX half-split layout (Llama / Qwen in `transformers`).

For x (T, H, Dh) with halves x1 = x[..., :Dh/2], x2 = x[..., Dh/2:] and angles
a = positions[:, None] * inv_freq[None, :] computed in fp32:
    y1 = x1 cos a - x2 sin a,   y2 = x2 cos a + x1 sin a
Arithmetic in fp32, result cast to x.dtype. `inv_freq` (Dh/2,) fp32 already holds any
frequency scaling (Llama-3 "llama3" rope type): see `rope_inv_freq`.
Batch-invariant: each token uses only its own position.

Triton path: one program per block of BLOCK_T tokens and group of heads computes the
fp32 angles pos * inv_freq in-kernel (the same product as the reference: int position
-> fp32, times fp32 inv_freq) and their cos/sin once, then loops over its heads. The backward is
the same kernel rotating by -a:
    dx1 = dy1 cos a + dy2 sin a,   dx2 = dy2 cos a - dy1 sin a
Output and gradient are new contiguous (T, H, Dh) tensors in x.dtype; x may be any
(T, H, Dh) view with unit stride on the last dim (e.g. q_proj(x).view(T, H, Dh)).
Tests: `python -m pytest -q tests/test_kernel_layers.py -k rope`.
"""

from __future__ import annotations

import math

import torch

from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.invariant import pointwise


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


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
             exact: bool = False) -> torch.Tensor:
    # x (T, H, Dh), positions (T,), inv_freq (Dh/2,); exact: cos/sin with every element on
    # one CPU code path (see rlfuse.kernels.invariant), so a token's rotation ignores T
    ang = positions.float()[:, None] * inv_freq.float()[None, :]  # (T, Dh/2)
    cos, sin = (pointwise(torch.cos, ang), pointwise(torch.sin, ang)) if exact else (ang.cos(), ang.sin())
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, Dh/2)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    if resolve_backend("rope", x) == "triton":  # elementwise: batch-invariant in both numerics
        return triton_ops("rope").rope(x, positions, inv_freq)
    return rope_ref(x, positions, inv_freq, exact=is_exact())
