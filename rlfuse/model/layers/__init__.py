"""Shared building blocks the architectures assemble: linear, norms, attention (plain, gated), Gated DeltaNet, MLP, the decoder layer, attention metadata."""

from rlfuse.model.layers.attention import Attention
from rlfuse.model.layers.decoder import DecoderLayer
from rlfuse.model.layers.gated_attention import GatedAttention
from rlfuse.model.layers.gated_deltanet import FusedGatedDeltaNet, GatedDeltaNet, LinearState, PrefixRows
from rlfuse.model.layers.linear import Linear
from rlfuse.model.layers.mlp import MLP
from rlfuse.model.layers.norm import OffsetRMSNorm, RMSNorm
from rlfuse.model.layers.packed import LinearDecode, LinearSlots, Packed, PagedKV, pack_by_tokens

__all__ = ["MLP", "Attention", "DecoderLayer", "FusedGatedDeltaNet", "GatedAttention", "GatedDeltaNet", "Linear", "LinearDecode", "LinearSlots", "LinearState",
           "OffsetRMSNorm", "Packed", "PagedKV", "PrefixRows", "RMSNorm", "pack_by_tokens"]
