"""Shared building blocks the architectures assemble: linear, norm, attention, MLP, the decoder layer, attention metadata."""

from rlfuse.model.layers.attention import Attention
from rlfuse.model.layers.decoder import DecoderLayer
from rlfuse.model.layers.linear import Linear
from rlfuse.model.layers.mlp import MLP
from rlfuse.model.layers.norm import RMSNorm
from rlfuse.model.layers.packed import Packed, PagedKV, pack_by_tokens

__all__ = ["MLP", "Attention", "DecoderLayer", "Linear", "Packed", "PagedKV", "RMSNorm", "pack_by_tokens"]
