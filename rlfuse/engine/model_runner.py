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
  2. forward. Decode-shaped batches (every sequence computes one token) with B <= the
     largest bucket replay the CUDA graph of the smallest bucket >= B over static
     buffers (rows past B are padding: slot -1, seq_len 0, so they write nothing and
     attend to nothing); graphs are captured on first use of a bucket (or all at once by
     `capture_graphs`). Everything else (prefill chunks, mixed batches) runs eagerly.
     On CPU with enforce_eager=False the same static buffers run without capture.
  3. sample: fp32 logits = h_last @ W^T, `rlfuse.kernels.sampling.sample` with per-row
     seeds and offset = the sampled token's position (no host sync), then the reported
     log-prob from `rlfuse.kernels.logprob.token_logprobs(h_last, W, ids, T)` -- the
     trainer's function, per distinct temperature (T = 1 for greedy rows).
  4. one host sync: ids and log-probs come back together in one `.tolist()`.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from rlfuse.engine.config import EngineConfig
from rlfuse.engine.kv_cache import KVCache, plan_num_blocks
from rlfuse.engine.sequence import Sequence
from rlfuse.kernels.logprob import token_logprobs
from rlfuse.kernels.sampling import sample
from rlfuse.model.transformer import CausalLM, Packed, PagedKV

log = logging.getLogger(__name__)
_STATIC_FIELDS = 8  # ids, positions, slots, rows, seq_lens, top_k, seeds, offsets


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: EngineConfig, max_model_len: int):
        self.model, self.cfg, self.mcfg = model, cfg, model.config
        W = model.lm_head_weight
        self.device, self.dtype = W.device, W.dtype
        self.block_size = cfg.block_size
        self.max_blocks = -(-max_model_len // cfg.block_size)
        self.num_rows = cfg.max_num_seqs
        self.free_rows = list(range(self.num_rows - 1, -1, -1))
        # block tables on the device; the extra last row is all zeros for padding rows
        self.bt = torch.zeros((self.num_rows + 1, self.max_blocks), dtype=torch.int32, device=self.device)
        self.static = not cfg.enforce_eager
        self.use_graphs = self.static and self.device.type == "cuda"
        self.graph_sizes = cfg.graph_batch_sizes() if self.static else ()
        self.max_graph_bs = max(self.graph_sizes) if self.graph_sizes else 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_pool = None
        if self.static:
            n = self.max_graph_bs
            self.s_i64 = torch.zeros(_STATIC_FIELDS * n, dtype=torch.int64, device=self.device)
            self.s_cu = torch.arange(n + 1, dtype=torch.int32, device=self.device)
            self.s_out = torch.zeros((n, self.mcfg.hidden_size), dtype=self.dtype, device=self.device)
        self.kv: KVCache | None = None
        self.out_dtype_mm = self._probe_out_dtype_mm()
        self.graph_steps = 0

    # ------------------------------------------------------------------ memory
    def plan_and_allocate(self, max_model_len: int) -> KVCache:
        n = plan_num_blocks(self.mcfg, self.cfg, max_model_len, self.dtype, self.device, self._warmup)
        self.kv = KVCache(self.mcfg, n, self.block_size, self.dtype, self.device)
        return self.kv

    @torch.no_grad()
    def _warmup(self) -> None:
        """The largest step the engine runs: a prefill of max_num_batched_tokens tokens, then
        logits, filtered sampling and log-probs for max_num_seqs rows."""
        c, L = self.cfg, self.kv_len_cap()
        T = c.max_num_batched_tokens
        lens = [L] * (T // L) + ([T % L] if T % L else [])
        ids = torch.zeros(T, dtype=torch.long, device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in lens])
        self.model(ids, pos, Packed.from_lengths(lens, self.device))
        S = c.max_num_seqs
        h = torch.randn(S, self.mcfg.hidden_size, device=self.device).to(self.dtype)
        logits = self._logits(h)
        f = lambda v: torch.full((S,), v, device=self.device)  # noqa: E731
        z = torch.zeros(S, dtype=torch.long, device=self.device)
        ids, _ = sample(logits, f(1.0), z + 50, f(0.9), f(0.05), z, z)
        token_logprobs(h, self.model.lm_head_weight, ids, 1.0)

    def kv_len_cap(self) -> int:
        return self.max_blocks * self.block_size

    # ------------------------------------------------------------------ rows
    def release(self, seq: Sequence) -> None:
        """`seq` left the running set (finished, preempted, aborted): free its table row."""
        if seq.row >= 0:
            self.free_rows.append(seq.row)
            seq.row, seq.row_len = -1, 0

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
            upd = torch.tensor([r, c, v], dtype=torch.int64).to(self.device, non_blocking=True)
            self.bt[upd[0], upd[1]] = upd[2].to(torch.int32)
        return rows

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def run(self, seqs: list[Sequence], num_new: list[int]) -> tuple[list[int], list[int], list[float]]:
        """Compute the scheduled tokens; sample every sequence whose chunk reaches its last
        token. Returns (batch indices sampled, token ids, log-probs). A sequence with fewer
        than min_tokens outputs has its stop ids (EOS included) masked out of the sampling."""
        assert self.kv is not None and self.kv.allocated, "KV cache released (engine asleep)"
        B, bs = len(seqs), self.block_size
        rows = self._sync_block_tables(seqs)
        starts = [s.num_computed for s in seqs]
        sampled = [j for j in range(B) if starts[j] + num_new[j] == len(seqs[j].token_ids)]
        S = len(sampled)
        samp = [(seqs[j].params, seqs[j]) for j in sampled]
        top_k = [p.top_k for p, _ in samp]
        seeds = [s.seed for _, s in samp]
        offsets = [len(s.token_ids) for _, s in samp]  # position of the token being sampled
        decode = all(n == 1 for n in num_new)
        if decode and self.static and B <= self.max_graph_bs:
            nb = next(g for g in self.graph_sizes if g >= B)
            host = np.zeros((_STATIC_FIELDS, nb), dtype=np.int64)
            host[2], host[3] = -1, self.num_rows  # padding rows: no K/V write, the zero table row
            host[0, :B] = [s.token_ids[p] for s, p in zip(seqs, starts)]
            host[1, :B] = starts
            host[2, :B] = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, starts)]
            host[3, :B] = rows
            host[4, :B] = host[1, :B] + 1
            host[5, :S], host[6, :S], host[7, :S] = top_k, seeds, offsets
            self.s_i64[:_STATIC_FIELDS * nb].copy_(torch.from_numpy(host.reshape(-1)), non_blocking=True)
            self._replay(nb)
            h = self.s_out[:B] if S == B else self.s_out[torch.tensor(sampled, device=self.device)]
            k_t, seed_t, off_t = (self.s_i64[f * nb:f * nb + S] for f in (5, 6, 7))
        else:
            h, (k_t, seed_t, off_t) = self._run_eager(seqs, num_new, starts, rows, sampled, top_k, seeds, offsets)
        if S == 0:
            return [], [], []
        fl = torch.tensor([[p.temperature for p, _ in samp], [p.top_p for p, _ in samp],
                           [p.min_p for p, _ in samp]], dtype=torch.float32).to(self.device, non_blocking=True)
        logits = self._logits(h)
        masks = [(i, t) for i, (p, s) in enumerate(samp) if s.num_output_tokens < p.min_tokens for t in s.stop_ids]
        if masks:
            idx = torch.tensor(masks, dtype=torch.int64).to(self.device, non_blocking=True)
            logits[idx[:, 0], idx[:, 1]] = float("-inf")
        ids, _ = sample(logits, fl[0], k_t, fl[1], fl[2], seed_t, off_t)
        lps = self._logprobs(h, ids, [s.temperature_lp for _, s in samp])
        out = torch.stack((ids.double(), lps.double())).tolist()  # host sync: the step's one read-back
        return sampled, [int(t) for t in out[0]], out[1]

    def _run_eager(self, seqs, num_new, starts, rows, sampled, top_k, seeds, offsets):
        B, bs = len(seqs), self.block_size
        T, S = sum(num_new), len(sampled)
        host = np.empty(3 * T + 3 * B + 1 + 4 * S, dtype=np.int64)
        ids, pos, slots = host[:T], host[T:2 * T], host[2 * T:3 * T]
        o = 0
        for seq, st, n in zip(seqs, starts, num_new):
            if n == 1:
                ids[o], pos[o] = seq.token_ids[st], st
                slots[o] = seq.block_table[st // bs] * bs + st % bs
            else:
                p = np.arange(st, st + n)
                ids[o:o + n] = seq.token_ids[st:st + n]
                pos[o:o + n] = p
                slots[o:o + n] = np.asarray(seq.block_table, dtype=np.int64)[p // bs] * bs + p % bs
            o += n
        b = 3 * T
        host[b:b + B] = rows
        host[b + B:b + 2 * B] = [st + n for st, n in zip(starts, num_new)]
        host[b + 2 * B] = 0
        host[b + 2 * B + 1:b + 3 * B + 1] = np.cumsum(num_new)
        c = b + 3 * B + 1
        host[c:c + S] = [host[b + 2 * B + 1 + j] - 1 for j in sampled]
        host[c + S:c + 2 * S], host[c + 2 * S:c + 3 * S], host[c + 3 * S:c + 4 * S] = top_k, seeds, offsets
        dev = torch.from_numpy(host).to(self.device, non_blocking=True)
        rows_t = dev[b:b + B]
        seq_lens = dev[b + B:b + 2 * B].to(torch.int32)
        cu = dev[b + 2 * B:b + 3 * B + 1].to(torch.int32)
        w = -(-max(st + n for st, n in zip(starts, num_new)) // bs)
        attn = PagedKV(self.kv.kv_caches, dev[2 * T:3 * T], cu, seq_lens, self.bt[rows_t, :w], max(num_new))
        h = self.model(dev[:T], dev[T:2 * T], attn)
        h = h if S == T else h[dev[c:c + S]]
        return h, (dev[c + S:c + 2 * S], dev[c + 2 * S:c + 3 * S], dev[c + 3 * S:c + 4 * S])

    # ------------------------------------------------------------------ decode graphs
    def _decode_body(self, nb: int) -> None:
        st = self.s_i64
        ids, pos, slots, rows = (st[f * nb:(f + 1) * nb] for f in range(4))
        seq_lens = st[4 * nb:5 * nb].to(torch.int32)
        attn = PagedKV(self.kv.kv_caches, slots, self.s_cu[:nb + 1], seq_lens, self.bt.index_select(0, rows), 1)
        self.s_out[:nb].copy_(self.model(ids, pos, attn))

    def _replay(self, nb: int) -> None:
        if not self.use_graphs:
            self._decode_body(nb)
            return
        g = self.graphs.get(nb)
        if g is None:
            g = self._capture(nb)
        g.replay()
        self.graph_steps += 1

    def _capture(self, nb: int) -> torch.cuda.CUDAGraph:
        t0 = time.perf_counter()
        self._decode_body(nb)  # warm-up: compiles kernels; rewrites the same K/V the replay writes
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.graph_pool):
            self._decode_body(nb)
        if self.graph_pool is None:
            self.graph_pool = g.pool()
        self.graphs[nb] = g
        log.debug("captured the decode CUDA graph for batch size %d in %.0f ms", nb, 1e3 * (time.perf_counter() - t0))
        return g

    @torch.no_grad()
    def capture_graphs(self) -> None:
        """Capture every bucket now (largest first, so one memory pool fits all), over
        padding inputs; normally buckets are captured on first use."""
        if not self.use_graphs:
            return
        todo = [s for s in sorted(self.graph_sizes, reverse=True) if s not in self.graphs]
        if not todo:
            return
        t0 = time.perf_counter()
        nb = self.max_graph_bs
        host = np.zeros((_STATIC_FIELDS, nb), dtype=np.int64)
        host[2], host[3] = -1, self.num_rows
        for size in todo:
            self.s_i64[:_STATIC_FIELDS * size].copy_(torch.from_numpy(host[:, :size].reshape(-1)))
            self._capture(size)
        log.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs),
                 f"{min(self.graph_sizes)}..{nb}", time.perf_counter() - t0)

    def drop_graphs(self) -> None:
        self.graphs.clear()
        self.graph_pool = None

    # ------------------------------------------------------------------ sampling helpers
    def _probe_out_dtype_mm(self) -> bool:
        """fp32 logits straight from a half-precision matmul (torch.mm(..., out_dtype=float32),
        CUDA only): exact fp32 accumulation without a fp32 copy of the LM head."""
        if self.dtype == torch.float32:
            return False
        if self.device.type == "cuda":
            a = torch.zeros(2, 8, dtype=self.dtype, device=self.device)
            try:
                ok = torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
            except (RuntimeError, TypeError) as e:  # older torch: no out_dtype overload
                ok, why = False, str(e).splitlines()[0]
            if ok:
                log.info("logits: fp32 output of the %s LM-head matmul (torch.mm out_dtype)", self.dtype)
                return True
            log.warning("logits: torch.mm(out_dtype=float32) unavailable (%s); sampling from %s logits cast "
                        "to fp32", why, self.dtype)
        else:
            log.info("logits on %s in %s, cast to fp32 for sampling", self.device, self.dtype)
        return False

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        W = self.model.lm_head_weight
        if self.out_dtype_mm:
            return torch.mm(h, W.t(), out_dtype=torch.float32)
        return torch.mm(h, W.t()).float()

    def _logprobs(self, h: torch.Tensor, ids: torch.Tensor, temps: list[float]) -> torch.Tensor:
        W = self.model.lm_head_weight
        distinct = sorted(set(temps))
        if len(distinct) == 1:
            return token_logprobs(h, W, ids, distinct[0])
        out = torch.empty(len(temps), dtype=torch.float32, device=h.device)
        for t in distinct:  # one call per temperature: bitwise what the trainer computes per row
            idx = torch.tensor([i for i, x in enumerate(temps) if x == t], device=h.device)
            out[idx] = token_logprobs(h[idx], W, ids[idx], t)
        return out
