"""The engine's per-sequence cache state: paged KV blocks (the block manager and the device pool they index), fixed-size state slots (the linear-attention layers' state), under one contract (`state.CacheState`), and parked finished sequences whose continuations take both over (`parked`)."""

from rlfuse.engine.cache.blocks import BlockManager, block_hash
from rlfuse.engine.cache.kv import KVCache, bytes_per_block, cache_dtype, kv_layers, plan_num_blocks
from rlfuse.engine.cache.kv_scales import calibrate_kv_scales
from rlfuse.engine.cache.linear import LinearStateCache, linear_layers
from rlfuse.engine.cache.parked import Parked
from rlfuse.engine.cache.state import CacheState, StateSlots

__all__ = ["BlockManager", "CacheState", "KVCache", "LinearStateCache", "Parked", "StateSlots", "linear_layers",
           "block_hash", "bytes_per_block", "cache_dtype", "calibrate_kv_scales", "kv_layers", "plan_num_blocks"]
