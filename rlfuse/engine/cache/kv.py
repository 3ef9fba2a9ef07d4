"""The paged KV pool and how many blocks fit in memory.

Layout: one tensor (2, L, num_blocks, block_size, Hkv, Dh) in the cache dtype (the model's,
or float8_e4m3fn with `EngineConfig.kv_cache_dtype: fp8_e4m3`: 1 byte an element, so twice
the tokens in the same bytes, plus the (L, 2, Hkv) fp32 scales of `KVQuant`), L = the
layers that keep K/V (`kv_layers`: every layer of a dense model, only the full-attention
ones of a hybrid: 1 in 4 for Qwen3.5; a linear-attention layer keeps fixed-size slot state
instead, `rlfuse.engine.cache.linear`); `kv_caches[l]` (indexed by the model's layer
index, None for a layer without K/V) is k = pool[0, j], v = pool[1, j], the
(num_blocks, block_size, Hkv, Dh) views that `rlfuse.kernels.attention.paged` takes. One
allocation, so `release()` (sleep) hands the whole pool back and `allocate()` (wake)
re-creates it with the same number of blocks.

Budget on CUDA (measured once, after the weights are loaded and a warm-up forward ran):
    free, total   = torch.cuda.mem_get_info()         (after empty_cache)
    used          = total - free                      (weights, this process, others)
    activations   = peak - current                    (torch allocator, the warm-up's peak)
    kv_bytes      = total * gpu_memory_fraction - used - activations
    num_blocks    = (kv_bytes - scale_bytes) // (2 * L * block_size * Hkv * Dh * itemsize)
A hybrid model's linear-attention state (`state_bytes`, allocated before the plan) is part
of `used`; it is logged beside the pool. On CPU there is nothing to measure: enough blocks
for max_num_seqs sequences of max_model_len tokens, capped at `cpu_kv_cache_gib` minus the
linear-attention state and the scales (one budget for all the cache state).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from rlfuse.engine.config import EngineConfig
from rlfuse.kernels.kv_quant import FP8_DTYPE
from rlfuse.model.config import ModelConfig

log = logging.getLogger(__name__)
_GIB = 1024**3


def kv_layers(mcfg: ModelConfig) -> list[int]:
    """Indices of the layers that keep paged K/V: the full-attention ones."""
    return [i for i in range(mcfg.num_hidden_layers) if mcfg.layer_type(i) == "full_attention"]


def cache_dtype(cfg: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for `EngineConfig.kv_cache_dtype`."""
    return FP8_DTYPE if cfg.kv_cache_dtype == "fp8_e4m3" else model_dtype


def bytes_per_block(mcfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * len(kv_layers(mcfg)) * block_size * mcfg.num_key_value_heads * mcfg.head_dim * dtype.itemsize


def scale_bytes(mcfg: ModelConfig, dtype: torch.dtype) -> int:
    """An fp8 pool's scales and their reciprocals (`KVQuant`: 2 x (L, 2, Hkv) fp32); 0 otherwise."""
    return 2 * mcfg.num_hidden_layers * 2 * mcfg.num_key_value_heads * 4 if dtype == FP8_DTYPE else 0


def plan_num_blocks(mcfg: ModelConfig, cfg: EngineConfig, max_model_len: int, dtype: torch.dtype,
                    device: torch.device, warmup: Callable[[], None], state_bytes: int = 0) -> int:
    """Number of KV blocks for this engine (see the module docstring); `dtype` the cache's;
    `warmup` runs the largest forward the engine will do so its activation peak is measured;
    `state_bytes`: the linear-attention state already allocated (hybrid models)."""
    per_block = bytes_per_block(mcfg, cfg.block_size, dtype)
    fixed = scale_bytes(mcfg, dtype)
    state = (f"; beside {state_bytes / _GIB:.3f} GiB of linear-attention state ({len(kv_layers(mcfg))} of "
             f"{mcfg.num_hidden_layers} layers keep K/V)" if state_bytes else "")
    per_seq = -(-max_model_len // cfg.block_size)
    if cfg.num_kv_blocks is not None:
        log.info("KV cache: %d blocks of %d tokens (%.3f GiB), set by EngineConfig.num_kv_blocks%s",
                 cfg.num_kv_blocks, cfg.block_size, cfg.num_kv_blocks * per_block / _GIB, state)
        return cfg.num_kv_blocks
    if device.type != "cuda":
        want = cfg.max_num_seqs * per_seq
        cap = (int(cfg.cpu_kv_cache_gib * _GIB) - state_bytes - fixed) // per_block
        n = max(1, min(want, cap))
        log.info("KV cache on %s: %d blocks of %d tokens (%.3f GiB): %s%s", device, n, cfg.block_size,
                 n * per_block / _GIB, f"max_num_seqs {cfg.max_num_seqs} x {per_seq} blocks" if n == want
                 else f"capped by cpu_kv_cache_gib {cfg.cpu_kv_cache_gib}", state)
        return n
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    warmup()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    current = torch.cuda.memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    kv_bytes = int(total * cfg.gpu_memory_fraction) - used - (peak - current)
    n = (kv_bytes - fixed) // per_block
    # never more than the running sequences can fill at full length, and as much again for
    # the prefix cache: a small model on a large GPU would otherwise get millions of blocks,
    # and the block manager's bookkeeping per block (seconds and GiBs of host memory at start)
    most = 2 * cfg.max_num_seqs * per_seq
    if n > most:
        log.info("KV cache: %d blocks fit; %d kept (2 x max_num_seqs %d x %d blocks of a max_model_len sequence)",
                 n, most, cfg.max_num_seqs, per_seq)
        n = most
    log.info("KV cache budget on %s: total %.2f GiB x fraction %.2f - used %.2f GiB (torch allocated %.2f GiB) "
             "- warm-up activation peak %.2f GiB = %.2f GiB -> %d blocks of %d tokens (%d tokens, %.1f max-length "
             "sequences), %.1f KiB per token (%s)%s", torch.cuda.get_device_name(device), total / _GIB,
             cfg.gpu_memory_fraction, used / _GIB, current / _GIB, (peak - current) / _GIB, kv_bytes / _GIB, n,
             cfg.block_size, n * cfg.block_size, n / per_seq, per_block / cfg.block_size / 1024, dtype, state)
    if n < 1:
        raise ValueError(f"EngineConfig.gpu_memory_fraction={cfg.gpu_memory_fraction}: no memory left for the KV "
                         f"cache ({kv_bytes / _GIB:.2f} GiB after weights and activations); raise it or lower "
                         f"max_num_batched_tokens / max_num_seqs")
    return n


class KVCache:
    def __init__(self, mcfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.layers = kv_layers(mcfg)
        self.num_layers = mcfg.num_hidden_layers
        self.shape = (2, len(self.layers), num_blocks, block_size, mcfg.num_key_value_heads, mcfg.head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.device = dtype, device
        self.pool: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.allocate()

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize

    @property
    def allocated(self) -> bool:
        return self.pool is not None

    def allocate(self) -> None:
        if self.pool is not None:
            return
        # empty, not zeros: attention reads only slots below each sequence's length, all written
        # before they are read (the kernels mask the rest), so wake() costs no memset
        self.pool = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        at = {layer: j for j, layer in enumerate(self.layers)}
        self.kv_caches = [(self.pool[0, at[i]], self.pool[1, at[i]]) if i in at else None
                          for i in range(self.num_layers)]

    def release(self) -> None:
        self.kv_caches = []
        self.pool = None
