"""Full attention with an output gate (Qwen3.5's `self_attn`, also Qwen3-Next's): q_proj
gives, per head, [q (Dh) | gate (Dh)]; q/k per-head (1 + w) RMSNorms; RoPE on the first
rotary_dim = int(Dh * partial_rotary_factor) dims of a head (the rest pass through); the
attention output is multiplied by sigmoid(gate) before o_proj. Varlen attention over
`Packed` sequences or paged attention over the engine's KV cache, as `Attention`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from rlfuse.kernels.attention.paged import paged_attention, store_kvcache
from rlfuse.kernels.attention.varlen import varlen_attention
from rlfuse.kernels.invariant import elementwise
from rlfuse.kernels.rope.rotary import rope
from rlfuse.model.layers.linear import Linear
from rlfuse.model.layers.norm import OffsetRMSNorm
from rlfuse.model.layers.packed import PagedKV

if TYPE_CHECKING:
    from rlfuse.model.config import ModelConfig


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_q, self.n_kv, self.dh, self.rot = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                                  cfg.rotary_dim)
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_q * self.dh * 2, bias=bias)  # [q | gate] per head
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.dh, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.dh, bias=bias)
        self.o_proj = Linear(self.n_q * self.dh, cfg.hidden_size, bias=bias)
        self.q_norm = OffsetRMSNorm(self.dh, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.dh, cfg.rms_norm_eps)

    def _rope(self, x, positions, inv_freq, cos_sin):
        if self.rot == self.dh:
            return rope(x, positions, inv_freq, cos_sin)
        return torch.cat((rope(x[..., :self.rot].contiguous(), positions, inv_freq, cos_sin), x[..., self.rot:]), -1)

    def forward(self, x_TD, positions, attn, inv_freq, cos_sin=None):
        T = x_TD.shape[0]
        q, gate = self.q_proj(x_TD).view(T, self.n_q, 2 * self.dh).chunk(2, dim=-1)  # (T, Hq, Dh) each
        q = self._rope(self.q_norm(q), positions, inv_freq, cos_sin)
        k = self._rope(self.k_norm(self.k_proj(x_TD).view(T, self.n_kv, self.dh)), positions, inv_freq, cos_sin)
        v = self.v_proj(x_TD).view(T, self.n_kv, self.dh)
        if isinstance(attn, PagedKV):
            k_cache, v_cache = attn.kv_caches[self.layer_idx]
            kv_scale = None if attn.kv_quant is None else attn.kv_quant.layer(self.layer_idx)
            store_kvcache(k, v, k_cache, v_cache, attn.slot_mapping, kv_scale)
            o = paged_attention(q, k_cache, v_cache, attn.cu_seqlens_q, attn.seq_lens, attn.block_tables,
                                attn.max_seqlen_q, shared=attn.shared, kv_scale=kv_scale)
        else:
            if attn.kv_quant is not None:  # the values an fp8 cache gives back (Attention's docstring)
                k, v = attn.kv_quant.apply(self.layer_idx, k, v)
            o = varlen_attention(q, k, v, attn.cu_seqlens, attn.max_seqlen, prefix=attn.prefix)
        o = o.reshape(T, self.n_q * self.dh) * elementwise(torch.sigmoid, gate.reshape(T, self.n_q * self.dh))
        return self.o_proj(o)
