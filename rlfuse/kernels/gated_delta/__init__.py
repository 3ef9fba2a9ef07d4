"""Gated DeltaNet (Qwen3.5 linear attention): the chunked gated delta rule and its decode steps, its causal conv1d and gated RMSNorm."""

from rlfuse.kernels.gated_delta.chunk import (
                                              CHUNK,
                                              chunk_gated_delta_rule,
                                              chunk_gated_delta_rule_ref,
                                              recurrent_gated_delta_rule_ref,
)
from rlfuse.kernels.gated_delta.chunk_decode import chunk_gated_delta_decode, chunk_gated_delta_decode_ref
from rlfuse.kernels.gated_delta.conv import (
                                             causal_conv1d,
                                             causal_conv1d_ref,
                                             causal_conv1d_update,
                                             causal_conv1d_update_ref,
)
from rlfuse.kernels.gated_delta.gated_norm import gated_rmsnorm, gated_rmsnorm_ref
from rlfuse.kernels.gated_delta.recurrent import fused_recurrent_gated_delta_rule, gdn_gates

__all__ = ["CHUNK", "causal_conv1d", "causal_conv1d_ref", "causal_conv1d_update", "causal_conv1d_update_ref",
           "chunk_gated_delta_decode", "chunk_gated_delta_decode_ref", "chunk_gated_delta_rule",
           "chunk_gated_delta_rule_ref", "fused_recurrent_gated_delta_rule",
           "gated_rmsnorm", "gated_rmsnorm_ref", "gdn_gates", "recurrent_gated_delta_rule_ref"]
