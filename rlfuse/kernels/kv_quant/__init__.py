"""FP8 KV cache: K and V as float8_e4m3fn with per-layer, per-KV-head power-of-two scales."""

from rlfuse.kernels.kv_quant.fp8 import (
                                         FP8_DTYPE,
                                         FP8_MAX,
                                         KV_CACHE_DTYPES,
                                         KV_SCALE_MARGIN,
                                         KVQuant,
                                         dequantize_kv,
                                         fake_quant_kv,
                                         is_fp8,
                                         quantize_kv,
                                         quantize_kv_ref,
                                         scales_from_amax,
)

__all__ = ["FP8_DTYPE", "FP8_MAX", "KVQuant", "KV_CACHE_DTYPES", "KV_SCALE_MARGIN", "dequantize_kv", "fake_quant_kv",
           "is_fp8", "quantize_kv", "quantize_kv_ref", "scales_from_amax"]
