"""One engine step on the LIVE model: inputs -> forward over the paged KV cache -> samples.

The runner never copies weights: it calls `model.forward(input_ids, positions, PagedKV)`
and reads `model.lm_head_weight` at every step, and CUDA graphs capture those same
parameter tensors, so an in-place update by the trainer is seen by the next step.

Per step (B sequences, T = sum of their new tokens, S of them sampled):
  1. upload: the block-table entries added since the last step (the table lives on the
     device, one row per running sequence), then ONE int64 array holding input ids,
     positions, slot mapping, rows, seq_lens, cu_seqlens, sampled rows, top-k, seeds and
     offsets, and one fp32 array (temperature, top-p, min-p). No per-step allocation of
     block tables on the host.
  2. forward. Decode-shaped batches (every sequence computes one token) up to the largest
     graph bucket run on the static decode path (`rlfuse.engine.step.static_decode`: static
     buffers, a CUDA graph per bucket, the shared-prefix plan); everything else (prefill
     chunks, mixed batches) runs eagerly (`rlfuse.engine.step.eager`).
  3. sample: fp32 logits = h_last @ W^T, `rlfuse.kernels.sampling.draw.sample` with per-row
     seeds and offset = the sampled token's position (no host sync), then the reported
     log-prob from `rlfuse.kernels.loss.logprob.token_logprobs(h_last, W, ids, T)` -- the
     trainer's function, per distinct temperature (T = 1 for greedy rows). Vision models'
     image-pad / vision start / end ids are -inf before sampling (never sampled). The
     sampling glue is `rlfuse.engine.step.sampler`.
  4. read-back: ids and log-probs are copied together into pinned host memory behind an
     event; `collect` waits for it (the step's one host sync). `launch` returns before
     that, so the engine can enqueue the next decode step first (`launch(feed=...)`,
     look-ahead: see `LLM.step`) and do its bookkeeping while the device works
     (`rlfuse.engine.step.pending`).
Test: python -m pytest -q tests/test_engine.py
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np
import torch

from rlfuse.engine.cache.kv import KVCache, cache_dtype, plan_num_blocks
from rlfuse.engine.cache.kv_scales import calibrate_kv_scales
from rlfuse.engine.cache.linear import LinearStateCache, linear_layers
from rlfuse.engine.config import EngineConfig
from rlfuse.engine.media import FeatureCache, MediaItem, encode_images
from rlfuse.engine.sequence import Sequence
from rlfuse.engine.step.eager import EagerStep
from rlfuse.engine.step.pending import Pending, collect, read_back
from rlfuse.engine.step.routing import RoutingRecord
from rlfuse.engine.step.sampler import Sampler
from rlfuse.engine.step.static_decode import StaticDecode
from rlfuse.engine.step.upload import upload
from rlfuse.kernels.attention import check_exact_attention
from rlfuse.kernels.backend import current_backend, num_sms, use_numerics
from rlfuse.kernels.kv_quant import FP8_DTYPE, KVQuant
from rlfuse.model import CausalLM, Packed, PagedKV
from rlfuse.model.lora_bank import adapter_bank
from rlfuse.model.vision import ImageFeatures

log = logging.getLogger(__name__)


def param_version(model) -> int:
    """Sum of the parameters' version counters: changes with every in-place update."""
    return sum(p._version for p in model.parameters())


def _in_numerics(method):
    """Run an engine entry point in the engine's numerics (`EngineConfig.numerics`); CUDA
    graphs captured inside record the kernels of that numerics."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with use_numerics(self.cfg.numerics):
            return method(self, *args, **kwargs)
    return wrapped


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: EngineConfig, max_model_len: int):
        self.model, self.cfg, self.mcfg = model, cfg, model.config
        own = getattr(model, "kernels", None)  # the model's kernel settings (a run's), entered by its forward
        if own is not None and own.numerics != cfg.numerics:
            raise ValueError(f"EngineConfig.numerics is {cfg.numerics!r} but the model's forwards run in "
                             f"{own.numerics!r} numerics (model.kernels, from the run's engine.numerics); "
                             f"the rollout and the trainer must use one")
        W = model.lm_head_weight
        self.device, self.dtype = W.device, W.dtype
        backend = own.backend if own is not None else current_backend()
        if cfg.numerics == "exact" and (backend == "triton" or (backend == "auto" and W.is_cuda)):
            mc = model.config
            check_exact_attention(mc.num_attention_heads, mc.num_key_value_heads, W.dtype, "engine")
        self.block_size = cfg.block_size
        self.max_blocks = -(-max_model_len // cfg.block_size)
        self.num_rows = cfg.max_num_seqs
        self.free_rows = list(range(self.num_rows - 1, -1, -1))
        # block tables on the device; the extra last row is all zeros for padding rows
        self.bt = torch.zeros((self.num_rows + 1, self.max_blocks), dtype=torch.int32, device=self.device)
        # hybrid models: the linear-attention layers' per-sequence state, one slot per running
        # sequence (allocated before the KV pool is planned, so the plan sees it)
        self.linear = (LinearStateCache(model, self.num_rows, self.dtype, self.device, exact=cfg.numerics == "exact")
                       if linear_layers(model) else None)
        # decode steps up to the largest graph bucket: static buffers and CUDA graphs (None: eager only).
        # The torch reference kernels select rows with boolean masks (the KV store's padding
        # slots), a host sync no graph capture can hold, so on CUDA they decode eagerly.
        eager = cfg.enforce_eager or (backend == "torch" and W.is_cuda)
        if eager and not cfg.enforce_eager:
            log.info("decode CUDA graphs off: kernel_backend torch on CUDA (its reference ops sync with the "
                     "host while decoding); decode steps run eagerly")
        self.decode = None if eager else StaticDecode(model, cfg, self.bt, pad_row=self.num_rows,
                                                                 linear=self.linear)
        if self.linear is not None:
            log.info("hybrid model: %d linear-attention layers, state %.1f MiB for %d sequences (+1 scratch slot)",
                     len(self.linear.layer_ids), self.linear.nbytes / 2**20, self.num_rows)
        self.kv: KVCache | None = None
        # fp8 KV cache: the scales (calibrated by `calibrate_kv`), held by the model too so its
        # packed forwards (the trainer's) quantize K/V the same way; an engine with a cache in
        # the model's dtype clears any an earlier engine left on the model
        self.kv_dtype = cache_dtype(cfg, self.dtype)
        mc = model.config
        self.kv_quant = (KVQuant.unit(mc.num_hidden_layers, mc.num_key_value_heads, self.device)
                         if self.kv_dtype == FP8_DTYPE else None)
        model.kv_quant = self.kv_quant
        if self.kv_quant is not None:
            log.info("KV cache in fp8 (e4m3, per-layer per-KV-head power-of-two scales, calibrated on the prompts "
                     "after each weight update): EngineConfig.kv_cache_dtype")
        self.sampler = Sampler(model)  # logits, sampling, log-probs; vision models: never-sampled ids
        self.routing = RoutingRecord(model, cfg, self.device)  # MoE: experts of each sampled token
        # an adapter bank (rlfuse.model.lora_bank): each row's slot, written before every step
        # into one buffer the adapted projections (and the decode graphs) read
        self.bank = adapter_bank(model)
        if self.bank is not None:
            rows = max(cfg.max_num_batched_tokens, 2 * cfg.max_num_seqs)  # the warm-up's steps too
            self.bank.ids = torch.full((rows,), -1, dtype=torch.int32, device=self.device)
        self.vision = model.config.vision
        self.features = FeatureCache(self._encode) if self.vision is not None else None
        self.eager = EagerStep(model, self.bt, self.block_size, self.linear)  # every other step

    # the static decode path's state, as the engine and tests read it
    @property
    def static(self) -> bool:
        return self.decode is not None

    @property
    def use_graphs(self) -> bool:
        return self.decode is not None and self.decode.use_graphs

    @property
    def max_graph_bs(self) -> int:
        return self.decode.max_bs if self.decode is not None else 0

    @property
    def graphs(self) -> dict:
        return self.decode.graphs if self.decode is not None else {}

    @property
    def graph_steps(self) -> int:
        return self.decode.graph_steps if self.decode is not None else 0

    @property
    def shared_steps(self) -> int:
        return self.decode.shared_steps if self.decode is not None else 0

    # ------------------------------------------------------------------ memory
    def plan_and_allocate(self, max_model_len: int) -> KVCache:
        n = plan_num_blocks(self.mcfg, self.cfg, max_model_len, self.kv_dtype, self.device, self._warmup,
                            self.linear.nbytes if self.linear is not None else 0)
        self.kv = KVCache(self.mcfg, n, self.block_size, self.kv_dtype, self.device)
        self._warm_paged_kernels()
        return self.kv

    @torch.no_grad()
    @_in_numerics
    def _warm_paged_kernels(self, force: bool = False) -> None:
        """Compile the paged-attention variants a generate can meet before any is timed:
        prefill-shaped steps with and without a KV split (the split count follows the
        batch size) and the eager decode step, through the real model forward over the
        allocated cache. Slots are -1 (nothing written) and tables point at block 0 (read,
        discarded). The decode graphs compile their own variants when captured. CUDA only:
        the CPU path has nothing to compile."""
        if (self.device.type != "cuda" and not force) or self.kv is None or self.linear is not None:
            return  # (hybrid models: their eager steps compile on first use)
        t0 = time.perf_counter()
        n_kv = self.mcfg.num_key_value_heads
        big = -(-2 * num_sms(self.device) // n_kv)  # programs >= 2 per SM: no split
        width = min(self.max_blocks, -(-256 // self.block_size))  # >= 4 KV blocks of 64: a split is possible
        for B, q_len in ((1, 2), (min(big, self.cfg.max_num_seqs), 2), (1, 1), (self.cfg.max_num_seqs, 1)):
            T = B * q_len
            lens = torch.full((B,), q_len, dtype=torch.int32, device=self.device)
            cu = torch.zeros(B + 1, dtype=torch.int32, device=self.device)
            cu[1:] = torch.cumsum(lens, 0)
            attn = PagedKV(self.kv.kv_caches, torch.full((T,), -1, dtype=torch.int64, device=self.device), cu, lens,
                           torch.zeros((B, width), dtype=torch.int32, device=self.device), q_len)
            ids = torch.zeros(T, dtype=torch.long, device=self.device)
            self.model(ids, torch.arange(q_len, device=self.device).repeat(B), attn)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("paged-attention kernels warmed (prefill and decode, split and unsplit) in %.1f s",
                 time.perf_counter() - t0)

    @_in_numerics
    def calibrate_kv(self, prompts: list[list[int]]) -> dict:
        """fp8 cache: set the scales from these prompts (`rlfuse.engine.cache.kv_scales`)."""
        return calibrate_kv_scales(self.model, self.kv_quant, prompts, self.cfg.max_num_batched_tokens)

    @torch.no_grad()
    @_in_numerics
    def _warmup(self) -> None:
        """The largest step the engine runs: a prefill of max_num_batched_tokens tokens, then
        logits, filtered sampling and log-probs for max_num_seqs rows."""
        c, L = self.cfg, self.kv_len_cap()
        T = c.max_num_batched_tokens
        lens = [L] * (T // L) + ([T % L] if T % L else [])
        ids = torch.zeros(T, dtype=torch.long, device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in lens])
        self.model(ids, pos, Packed.from_lengths(lens, self.device))
        self.sampler.warmup(c.max_num_seqs)

    def kv_len_cap(self) -> int:
        return self.max_blocks * self.block_size

    # ------------------------------------------------------------------ rows, images
    def _encode(self, items: list[MediaItem]) -> ImageFeatures:
        return encode_images(self.model, items)  # the trainer's encode

    def release(self, seq: Sequence, keep_state: bool = False) -> None:
        """`seq` left the running set (finished, preempted, aborted): free its table row, and
        its linear-attention state slot unless `keep_state` (a parked sequence's)."""
        if seq.row >= 0:
            self.free_rows.append(seq.row)
            seq.row, seq.row_len = -1, 0
        if self.linear is not None and not keep_state:
            self.linear.free(seq)

    def reset_state(self) -> None:
        """Every table row and state slot free (`LLM.abort_all`)."""
        self.free_rows = list(range(self.num_rows - 1, -1, -1))
        if self.linear is not None:
            self.linear.reset()

    def _sync_block_tables(self, seqs: list[Sequence]) -> list[int]:
        rows, r, c, v = [], [], [], []
        for seq in seqs:
            if seq.row < 0:
                seq.row, seq.row_len = self.free_rows.pop(), 0
            n = len(seq.block_table)
            if seq.row_len < n:
                r += [seq.row] * (n - seq.row_len)
                c += range(seq.row_len, n)
                v += seq.block_table[seq.row_len:]
                seq.row_len = n
            rows.append(seq.row)
        if r:
            upd = self._upload([r, c, v], torch.int64)
            self.bt[upd[0], upd[1]] = upd[2].to(torch.int32)
        return rows

    # ------------------------------------------------------------------ step
    def _upload(self, x, dtype) -> torch.Tensor:
        return upload(x, dtype, self.device)

    @torch.no_grad()
    @_in_numerics
    def launch(self, seqs: list[Sequence], num_new: list[int], feed: torch.Tensor | None = None) -> Pending:
        """Enqueue one step on the device and return without waiting for it: compute the
        scheduled tokens; sample every sequence whose chunk reaches its last token. A
        sequence with fewer than min_tokens outputs has its stop ids (EOS included) masked
        out of the sampling. `collect` reads the result back.

        `feed` (look-ahead decode): each sequence is ONE STEP AHEAD of its host state -- the
        step still running samples its next token, which the host has not seen yet. Then
        every sequence computes position num_computed + 1, its input id is taken on the
        device from `feed` (B,) (that step's sampled ids, in this batch's order), and it
        is sampled (decode). Its blocks must already cover num_computed + 2 tokens."""
        assert self.kv is not None and self.kv.allocated, "KV cache released (engine asleep)"
        B = len(seqs)
        ahead = int(feed is not None)
        rows = self._sync_block_tables(seqs)
        starts = [s.num_computed + ahead for s in seqs]
        if ahead:
            assert all(n == 1 for n in num_new) and B <= self.max_graph_bs and self.static
            sampled = list(range(B))
        else:
            sampled = [j for j in range(B) if starts[j] + num_new[j] == len(seqs[j].token_ids)]
        S = len(sampled)
        samp = [(seqs[j].params, seqs[j]) for j in sampled]
        top_k = [p.top_k for p, _ in samp]
        seeds = [s.seed for _, s in samp]
        offsets = [len(s.token_ids) + ahead for _, s in samp]  # position of the token being sampled
        decode = all(n == 1 for n in num_new)
        if self.bank is not None:  # each computed row's adapter slot (-1: the base model)
            slot = [-1 if s.params.adapter is None else s.params.adapter for s in seqs]
            per_row = slot if decode else np.repeat(slot, num_new)
            self.bank.ids[:len(per_row)].copy_(self._upload(per_row, torch.int32))
        self.routing.install(True)
        try:
            # a 1-token chunk of an image prompt needs its 3-row position and features: eager
            if (decode and self.static and B <= self.max_graph_bs
                    and not any(s.mrope is not None and st < s.num_prompt_tokens for s, st in zip(seqs, starts))):
                h, (k_t, seed_t, off_t) = self.decode.step(self.kv.kv_caches, seqs, starts, rows, sampled, top_k,
                                                           seeds, offsets, feed)
            else:
                h, (k_t, seed_t, off_t) = self.eager.step(self.kv.kv_caches, self.features, seqs, num_new, starts,
                                                          rows, sampled, top_k, seeds, offsets)
        finally:
            self.routing.install(False)
        if S == 0:
            return Pending(sampled, None, None, None)
        routing = self.routing.sampled(num_new, sampled, self._upload) if self.routing.blocks else None
        ids, lps = self.sampler.draw(h, samp, k_t, seed_t, off_t, ahead)
        return read_back(sampled, ids, lps, routing)

    collect = staticmethod(collect)

    # ------------------------------------------------------------------ decode graphs
    @torch.no_grad()
    @_in_numerics
    def capture_graphs(self, up_to: int | None = None) -> None:
        """Capture the decode CUDA graphs now (`StaticDecode.capture`)."""
        if self.decode is not None:
            self.routing.install(True)  # the graphs then write each step's routing into the buffers
            try:
                self.decode.capture(self.kv.kv_caches, up_to)
            finally:
                self.routing.install(False)

    def drop_graphs(self) -> None:
        if self.decode is not None:
            self.decode.drop_graphs()
