"""Bidirectional attention within packed segments (the vision tower: every patch of an image
sees every patch of the same image, none of another).

Contract: q, k, v (T, H, Dh), one head count (no GQA); `cu_seqlens` (S+1,) int32, segment s
owns rows cu_seqlens[s]:cu_seqlens[s+1]; rows past cu_seqlens[-1] are zero in the output.
    o[i] = softmax(scale * q[i] . k[j] for j in i's segment) @ v[those j]
softmax in fp32 (the math of `F.scaled_dot_product_attention`, per segment, is_causal off),
output in q.dtype; scale defaults to Dh^-0.5.
Batch invariance: a segment's output depends on its own rows only when it is computed
alone; `rlfuse.model.vision.tower` encodes image by image in exact numerics, so an image's
features never depend on the images beside it.

Reference only: there is no Triton kernel for this op yet (the tower runs once per distinct
image, outside the decode loop); every backend runs `segment_attention_ref`.
Test: python -m pytest -q tests/test_qwen3_vl.py -k attention
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          scale: float | None = None) -> torch.Tensor:
    if not (q.shape == k.shape == v.shape) or q.dim() != 3:
        raise ValueError(f"segment_attention: q, k, v must share one (T, H, Dh) shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bounds = cu_seqlens.tolist()  # host sync: reference only (a few segments per call)
    out = q.new_zeros(q.shape)
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:  # (H, L, Dh) per segment
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                               v[s:e].transpose(0, 1), scale=scale)
            out[s:e] = o.transpose(0, 1)
    return out


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
    """Public op (contract in the module docstring): the reference on every backend for now."""
    return segment_attention_ref(q, k, v, cu_seqlens, scale)
