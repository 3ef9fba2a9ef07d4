"""Linear layers: the GEMM (exact: batch-invariant split plans) and LoRA applied beside it."""

from rlfuse.kernels.linear.gemm import linear, linear_exact, linear_exact_ref, linear_fused, linear_fused_parts
from rlfuse.kernels.linear.lora import lora_linear, lora_linear_ref

__all__ = ["linear", "linear_exact", "linear_exact_ref", "linear_fused", "linear_fused_parts", "lora_linear", "lora_linear_ref"]
