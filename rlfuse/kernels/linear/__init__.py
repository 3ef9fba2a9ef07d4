"""Linear layers: the GEMM (exact: batch-invariant split plans) and LoRA applied beside it."""

from rlfuse.kernels.linear.gemm import linear, linear_exact, linear_exact_ref, linear_fused
from rlfuse.kernels.linear.lora import lora_linear, lora_linear_ref

__all__ = ["linear", "linear_exact", "linear_exact_ref", "linear_fused", "lora_linear", "lora_linear_ref"]
