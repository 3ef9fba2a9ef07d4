"""Normalization: RMSNorm, alone and fused with the residual add."""

from rlfuse.kernels.norm.rms import add_rmsnorm, rmsnorm, rmsnorm_exact_ref, rmsnorm_ref

__all__ = ["add_rmsnorm", "rmsnorm", "rmsnorm_exact_ref", "rmsnorm_ref"]
