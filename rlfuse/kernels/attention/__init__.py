"""Attention: varlen (packed sequences, training and prefill), paged (decode over the KV cache), segment (bidirectional, the vision tower)."""

from rlfuse.kernels.attention.paged import (
                                            SharedPrefixDecode,
                                            paged_attention,
                                            paged_attention_exact_ref,
                                            paged_attention_ref,
                                            shared_prefix_members,
                                            store_kvcache,
                                            store_kvcache_ref,
)
from rlfuse.kernels.attention.segment import segment_attention, segment_attention_ref
from rlfuse.kernels.attention.varlen import (
                                            KV_BLOCK,
                                            SharedPrefix,
                                            attend_exact_ref,
                                            check_exact_attention,
                                            supports_head_dim,
                                            varlen_attention,
                                            varlen_attention_exact_ref,
                                            varlen_attention_ref,
)

__all__ = ["KV_BLOCK", "SharedPrefix", "SharedPrefixDecode", "attend_exact_ref", "check_exact_attention", "paged_attention",
           "paged_attention_exact_ref", "paged_attention_ref", "segment_attention", "segment_attention_ref",
           "shared_prefix_members", "store_kvcache",
           "store_kvcache_ref", "supports_head_dim", "varlen_attention", "varlen_attention_exact_ref",
           "varlen_attention_ref"]
