"""The engine's per-sequence cache state: paged KV blocks (the block manager) and the device pool they index."""

from rlfuse.engine.cache.blocks import BlockManager, block_hash
from rlfuse.engine.cache.kv import KVCache, bytes_per_block, plan_num_blocks

__all__ = ["BlockManager", "KVCache", "block_hash", "bytes_per_block", "plan_num_blocks"]
