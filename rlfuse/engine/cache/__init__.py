"""The engine's per-sequence cache state: paged KV blocks (the block manager and the device pool they index) and fixed-size state slots, under one contract (`state.CacheState`)."""

from rlfuse.engine.cache.blocks import BlockManager, block_hash
from rlfuse.engine.cache.kv import KVCache, bytes_per_block, plan_num_blocks
from rlfuse.engine.cache.state import CacheState, StateSlots

__all__ = ["BlockManager", "CacheState", "KVCache", "StateSlots", "block_hash", "bytes_per_block", "plan_num_blocks"]
