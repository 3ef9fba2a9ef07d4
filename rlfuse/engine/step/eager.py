"""The eager step: any batch the static decode path does not take (prefill chunks, mixed
prefill + decode batches, decode batches over the largest graph bucket, the 1-token chunk
of an image prompt) runs the model forward directly over the paged KV cache.

Its inputs go up in ONE int64 upload (input ids, positions, slot mapping, block-table rows,
seq_lens, cu_seqlens, sampled rows, top-k, seeds, offsets), every section on a 16-byte
boundary; the attention reads the runner's device block tables (`bt`) through the rows.
The runner (`rlfuse.engine.step.runner`) picks the path and samples from what `step` returns.
Test: python -m pytest -q tests/test_engine.py
"""

from __future__ import annotations

import numpy as np
import torch

from rlfuse.engine.cache.linear import LinearStateCache
from rlfuse.engine.media import FeatureCache
from rlfuse.engine.sequence import Sequence
from rlfuse.engine.step.upload import upload
from rlfuse.model import CausalLM, PagedKV


class EagerStep:
    """One eager forward of a scheduled batch (the module docstring). `bt`: the runner's
    device block tables; `linear`: a hybrid model's linear-attention state, else None."""

    def __init__(self, model: CausalLM, bt: torch.Tensor, block_size: int, linear: LinearStateCache | None = None):
        self.model, self.bt, self.block_size, self.linear = model, bt, block_size, linear
        self.device = bt.device

    def step(self, kv_caches, features: FeatureCache | None, seqs: list[Sequence], num_new: list[int],
             starts: list[int], rows: list[int], sampled: list[int], top_k: list[int], seeds: list[int],
             offsets: list[int]):
        """-> (last hidden states of the sampled rows, (top-k, seeds, offsets) device views
        for the sampler). `features`: a vision model's image features (chunks of image
        prompts take their 3-row positions and features from it)."""
        B, bs = len(seqs), self.block_size
        T, S = sum(num_new), len(sampled)
        # one upload; every section starts on a 16-byte boundary: Triton specializes kernels
        # on pointer alignment, so a section at an odd int64 offset (it moves with T, B, S)
        # would compile a second variant of the sampler mid-run (seconds on a GPU)
        lens = dict(ids=T, pos=T, slots=T, rows=B, seq_lens=B, cu=B + 1, samp=S, top_k=S, seeds=S, offsets=S)
        at, o = {}, 0
        for k, n in lens.items():
            at[k], o = o, o + n + (n & 1)
        host = np.zeros(o, dtype=np.int64)
        sec = {k: host[at[k]:at[k] + n] for k, n in lens.items()}
        ids, pos, slots = sec["ids"], sec["pos"], sec["slots"]
        o = 0
        for seq, st, n in zip(seqs, starts, num_new):
            d = seq.rope_delta  # 0 for text: the token's index is its position
            if n == 1:
                ids[o], pos[o] = seq.token_ids[st], st + d
                slots[o] = seq.block_table[st // bs] * bs + st % bs
            else:
                p = np.arange(st, st + n)
                ids[o:o + n] = seq.token_ids[st:st + n]
                pos[o:o + n] = p + d
                slots[o:o + n] = np.asarray(seq.block_table, dtype=np.int64)[p // bs] * bs + p % bs
            o += n
        sec["rows"][:] = rows
        sec["seq_lens"][:] = [st + n for st, n in zip(starts, num_new)]
        sec["cu"][1:] = np.cumsum(num_new)
        sec["samp"][:] = [sec["cu"][j + 1] - 1 for j in sampled]
        sec["top_k"][:], sec["seeds"][:], sec["offsets"][:] = top_k, seeds, offsets
        dev = upload(host, torch.int64, self.device)
        d = {k: dev[at[k]:at[k] + n] for k, n in lens.items()}
        w = -(-max(st + n for st, n in zip(starts, num_new)) // bs)
        attn = PagedKV(kv_caches, d["slots"], d["cu"].to(torch.int32), d["seq_lens"].to(torch.int32),
                       self.bt[d["rows"], :w], max(num_new),
                       linear=None if self.linear is None else self.linear.step(seqs, starts, num_new))
        pos, feats = d["pos"], None
        if any(s.mrope is not None and st < s.num_prompt_tokens for s, st in zip(seqs, starts)):
            pos, feats = features.chunk_inputs(seqs, starts, num_new, pos)
        h = self.model(d["ids"], pos, attn, feats)
        h = h if S == T else h[d["samp"]]
        return h, (d["top_k"], d["seeds"], d["offsets"])
