"""The engine's per-sequence cache state: paged KV blocks (the block manager and the device pool they index) and fixed-size state slots (the linear-attention layers' state), under one contract (`state.CacheState`)."""

from rlfuse.engine.cache.blocks import BlockManager, block_hash
from rlfuse.engine.cache.kv import KVCache, bytes_per_block, cache_dtype, plan_num_blocks
from rlfuse.engine.cache.kv_scales import calibrate_kv_scales
from rlfuse.engine.cache.linear import LinearStateCache, linear_layers
from rlfuse.engine.cache.state import CacheState, StateSlots

__all__ = ["BlockManager", "CacheState", "KVCache", "LinearStateCache", "StateSlots", "linear_layers", "block_hash", "bytes_per_block", "cache_dtype", "calibrate_kv_scales", "plan_num_blocks"]
