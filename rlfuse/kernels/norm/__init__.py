"""Normalization: RMSNorm, alone and fused with the residual add."""

from rlfuse.kernels.norm.rms import (
                                     add_rmsnorm,
                                     offset_rmsnorm,
                                     offset_rmsnorm_ref,
                                     rmsnorm,
                                     rmsnorm_exact_ref,
                                     rmsnorm_ref,
)

__all__ = ["add_rmsnorm", "offset_rmsnorm", "offset_rmsnorm_ref", "rmsnorm", "rmsnorm_exact_ref", "rmsnorm_ref"]
