"""Activations: SwiGLU (gate and up apart, or packed in one tensor)."""

from rlfuse.kernels.activation.glu import swiglu, swiglu_exact_ref, swiglu_packed, swiglu_ref

__all__ = ["swiglu", "swiglu_exact_ref", "swiglu_packed", "swiglu_ref"]
