"""The static decode path: decode steps over persistent buffers, replayed as CUDA graphs.

A decode-shaped step (every sequence computes one token) with B <= the largest bucket
runs on the bucket nb = the smallest graph batch size >= B: its inputs go into ONE
static int64 buffer (`_FIELDS` fields of `_field_stride(nb)` elements: input ids,
positions, slot mapping, block-table rows, seq_lens, top-k, seeds, offsets and the
step's shared-prefix plan), the forward reads them there and writes the last hidden
states into a static output. Rows past B are padding: slot -1, seq_len 0, the all-zero
block-table row, so they write nothing and attend to nothing.

Hybrid models (linear-attention layers, `rlfuse.engine.cache.linear`): each row also
carries its state slot; the layers read and update the state in place through those
slots with fixed shapes (`GatedDeltaNet.forward_decode`), padding rows through the
cache's scratch slot. Admission (a slot zeroed, or a group member's state copied) is
host bookkeeping done before the step, outside the graph. The decode body is not
idempotent then (it advances the state), so a capture's warm-up runs its rows on the
scratch slot.

On CUDA each (bucket, shared-prefix plan or not) is captured as a CUDA graph on first
use (or all at once by `capture`, largest first so one memory pool fits all) and
replayed; on CPU the same buffers run without capture. The shared-prefix plan
(`rlfuse.engine.step.shared_prefix`): sequences whose prompts sit in the same cache blocks
read them once; it is planned on the host when the running set changes.

The runner (`rlfuse.engine.step.runner`) owns the block tables and the KV cache and
calls `step`; this module owns the buffers, the graphs and the plan.
Test: python -m pytest -q tests/test_engine.py tests/test_kernel_shared_prefix.py
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from rlfuse.engine.cache.kv import cache_dtype
from rlfuse.engine.cache.linear import LinearStateCache
from rlfuse.engine.config import EngineConfig
from rlfuse.engine.sequence import Sequence
from rlfuse.engine.step.shared_prefix import plan_shared_prefix, shared_prefix_pays
from rlfuse.engine.step.upload import upload
from rlfuse.kernels.attention.paged import SharedPrefixDecode, shared_prefix_members
from rlfuse.kernels.backend import resolve_backend
from rlfuse.model import CausalLM, LinearDecode, PagedKV

log = logging.getLogger(__name__)
# the fields of the static int64 buffer, `_field_stride(nb)` elements each
# (the _SH_* fields: the step's SharedPrefixDecode plan; _LIN_SLOT: hybrid models, each row's
# linear-attention state slot)
_IDS, _POS, _SLOTS, _ROWS, _SEQ_LENS, _TOP_K, _SEEDS, _OFFSETS, _SH_LEN, _SH_PERM, _SH_FIRST, _SH_NUM, _LIN_SLOT = \
    range(13)
_FIELDS = 13


def _field_stride(nb: int) -> int:
    """int64 elements between static fields of bucket nb: even, so every field starts on a
    16-byte boundary (Triton specializes kernels on pointer alignment: an odd bucket would
    give the sampler a second compiled variant)."""
    return nb + (nb & 1)


class StaticDecode:
    """Static buffers, decode CUDA graphs per batch-size bucket and the shared-prefix plan
    (the module docstring). `bt`: the runner's device block tables, whose row `pad_row`
    is all zeros (padding rows read it)."""

    def __init__(self, model: CausalLM, cfg: EngineConfig, bt: torch.Tensor, pad_row: int,
                 linear: LinearStateCache | None = None):
        self.model, self.cfg, self.mcfg = model, cfg, model.config
        self.linear = linear
        W = model.lm_head_weight
        self.device, self.dtype = W.device, W.dtype
        self.bt, self.pad_row = bt, pad_row
        self.block_size = cfg.block_size
        self.use_graphs = self.device.type == "cuda"
        self.graph_sizes = cfg.graph_batch_sizes()
        self.max_bs = max(self.graph_sizes) if self.graph_sizes else 0
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (bucket, shared-prefix plan)
        self.graph_pool = None
        n = self.max_bs
        self.s_i64 = torch.zeros(_FIELDS * _field_stride(n), dtype=torch.int64, device=self.device)
        self.s_cu = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        self.s_out = torch.zeros((n, self.mcfg.hidden_size), dtype=self.dtype, device=self.device)
        # sequences per shared-prefix chunk (0: no sharing); plan: _share_plan
        self.share_members = 0
        if (cfg.share_prefix_decode is not False and cfg.enable_prefix_caching
                and resolve_backend("paged_attention", W) == "triton"):
            self.share_members = shared_prefix_members(self.mcfg.num_attention_heads, self.mcfg.num_key_value_heads,
                                                       cfg.numerics == "exact", W.element_size())
        self._share_key, self._share_arrays = None, None
        self.graph_steps = 0
        self.shared_steps = 0

    def step(self, kv_caches, seqs: list[Sequence], starts: list[int], rows: list[int], sampled: list[int],
             top_k: list[int], seeds: list[int], offsets: list[int], feed: torch.Tensor | None):
        """One decode step of B = len(seqs) <= max_bs sequences: fill the buffers, replay the
        bucket's graph. -> (last hidden states of the sampled rows, (top-k, seeds, offsets)
        device views for the sampler). `feed`: the look-ahead input ids, on the device."""
        B, S, bs = len(seqs), len(sampled), self.block_size
        nb = next(g for g in self.graph_sizes if g >= B)
        fs = _field_stride(nb)
        host = np.zeros((_FIELDS, fs), dtype=np.int64)
        host[_SLOTS], host[_ROWS] = -1, self.pad_row  # padding rows: no K/V write, the zero table row
        if self.linear is not None:
            host[_LIN_SLOT] = self.linear.pad_slot
            host[_LIN_SLOT, :B] = self.linear.admit_step(seqs, starts)
        if feed is None:
            host[_IDS, :B] = [s.token_ids[p] for s, p in zip(seqs, starts)]
        host[_POS, :B] = [p + s.rope_delta for s, p in zip(seqs, starts)]  # image prompts: index + delta
        host[_SLOTS, :B] = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, starts)]
        host[_ROWS, :B] = rows
        host[_SEQ_LENS, :B] = [p + 1 for p in starts]  # the index, not the position (mRoPE: they differ)
        host[_TOP_K, :S], host[_SEEDS, :S], host[_OFFSETS, :S] = top_k, seeds, offsets
        shared = self._share_plan(seqs, host, nb)
        self.shared_steps += shared
        self.s_i64[:_FIELDS * fs].copy_(upload(host.reshape(-1), torch.int64, self.device))
        if feed is not None:
            self.s_i64[:B].copy_(feed)  # the input ids: the running step's samples, on the device
        self._replay(kv_caches, nb, shared)
        h = self.s_out[:B] if S == B else self.s_out[upload(sampled, torch.int64, self.device)]
        return h, tuple(self.s_i64[f * fs:f * fs + S] for f in (_TOP_K, _SEEDS, _OFFSETS))

    def _share_plan(self, seqs: list[Sequence], host: np.ndarray, nb: int) -> bool:
        """Fill the _SH_* fields with the step's shared-prefix plan; False: nothing to share or
        it does not pay. Cached while the running set and its first blocks stay the same."""
        if not self.share_members or len(seqs) < 2:
            return False
        key = tuple((s.seq_id, s.block_table[0]) for s in seqs)
        if key != self._share_key:
            bs, m = self.block_size, self.mcfg
            share_len, perm, first, count, n = plan_shared_prefix(
                [s.block_table[:s.num_prompt_tokens // bs] for s in seqs], bs, self.share_members, nb // 2)
            pays = self.cfg.share_prefix_decode or shared_prefix_pays(  # the chunk leaders' shared keys
                n, int(share_len[perm[first[:n]]].sum()), m.num_key_value_heads,
                2 * m.num_key_value_heads * m.head_dim * cache_dtype(self.cfg, self.dtype).itemsize, self.device)
            self._share_key, self._share_arrays = key, (share_len, perm, first, count, n if pays else 0)
        share_len, perm, first, count, n = self._share_arrays
        host[_SH_LEN, :len(seqs)], host[_SH_PERM, :len(seqs)], host[_SH_FIRST, :nb // 2], host[_SH_NUM, :nb // 2] = \
            share_len, perm, first, count
        return n > 0

    def _decode_body(self, kv_caches, nb: int, shared: bool) -> None:
        st, fs = self.s_i64, _field_stride(nb)
        ids, pos, slots, rows, seq_lens = (st[f * fs:f * fs + nb] for f in (_IDS, _POS, _SLOTS, _ROWS, _SEQ_LENS))
        plan = SharedPrefixDecode(*(st[f * fs:f * fs + (nb // 2 if f in (_SH_FIRST, _SH_NUM) else nb)]
                                    for f in (_SH_LEN, _SH_PERM, _SH_FIRST, _SH_NUM)), self.share_members) if shared else None
        # each row's token index (seq_len - 1; padding rows 0): mRoPE positions are index + delta
        linear = None if self.linear is None else LinearDecode(self.linear.layers, st[_LIN_SLOT * fs:_LIN_SLOT * fs + nb],
                                                               (seq_lens - 1).clamp_min(0))
        attn = PagedKV(kv_caches, slots, self.s_cu[:nb + 1], seq_lens.to(torch.int32),
                       self.bt.index_select(0, rows), 1, plan, linear)
        self.s_out[:nb].copy_(self.model(ids, pos, attn))

    def _replay(self, kv_caches, nb: int, shared: bool = False) -> None:
        if not self.use_graphs:
            self._decode_body(kv_caches, nb, shared)
            return
        g = self.graphs.get((nb, shared))
        if g is None:
            g = self._capture(kv_caches, nb, shared)
        g.replay()
        self.graph_steps += 1

    def _capture(self, kv_caches, nb: int, shared: bool = False) -> torch.cuda.CUDAGraph:
        t0 = time.perf_counter()
        lin = None
        if self.linear is not None:  # the warm-up must not advance the rows' linear-attention state
            fs = _field_stride(nb)
            lin = self.s_i64[_LIN_SLOT * fs:_LIN_SLOT * fs + nb]
            keep = lin.clone()
            lin.fill_(self.linear.pad_slot)
        self._decode_body(kv_caches, nb, shared)  # warm-up: compiles kernels; rewrites the same K/V the replay writes
        if lin is not None:
            lin.copy_(keep)
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.graph_pool):
            self._decode_body(kv_caches, nb, shared)
        if self.graph_pool is None:
            self.graph_pool = g.pool()
        self.graphs[(nb, shared)] = g
        log.debug("captured the decode CUDA graph for batch size %d%s in %.0f ms", nb,
                  " (shared prefixes)" if shared else "", 1e3 * (time.perf_counter() - t0))
        return g

    def capture(self, kv_caches, up_to: int | None = None) -> None:
        """Capture every bucket now (largest first, so one memory pool fits all), over
        padding inputs; normally buckets are captured on first use. `up_to`: only the
        buckets a decode batch of at most that many sequences can use."""
        if not self.use_graphs:
            return
        top = next((s for s in self.graph_sizes if s >= up_to), self.max_bs) if up_to else self.max_bs
        variants = (False, True) if self.share_members else (False,)  # + the shared-prefix plan's graphs
        todo = [(s, v) for s in sorted(self.graph_sizes, reverse=True) for v in variants
                if (s, v) not in self.graphs and s <= top and (s > 1 or not v)]
        if not todo:
            return
        t0 = time.perf_counter()
        for size, shared in todo:
            host = np.zeros((_FIELDS, _field_stride(size)), dtype=np.int64)
            host[_SLOTS], host[_ROWS] = -1, self.pad_row  # padding; the plan: no chunk
            if self.linear is not None:
                host[_LIN_SLOT] = self.linear.pad_slot
            self.s_i64[:host.size].copy_(torch.from_numpy(host.reshape(-1)))
            self._capture(kv_caches, size, shared)
        log.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs),
                 f"{min(self.graph_sizes)}..{self.max_bs}", time.perf_counter() - t0)

    def drop_graphs(self) -> None:
        self.graphs.clear()
        self.graph_pool = None
