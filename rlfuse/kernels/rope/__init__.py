"""Rotary position embeddings: RoPE, and per-head q/k norms + RoPE + KV store fused."""

from rlfuse.kernels.rope.rotary import qk_norm_rope, qk_norm_rope_ref, rope, rope_cos_sin, rope_inv_freq, rope_ref

__all__ = ["qk_norm_rope", "qk_norm_rope_ref", "rope", "rope_cos_sin", "rope_inv_freq", "rope_ref"]
