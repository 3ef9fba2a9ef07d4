"""Full causal attention (a layer's token mixer, `self_attn` in HF names): q/k/v projections
(or one fused GEMM, `rlfuse.model.fuse`), optional per-head q/k RMSNorm (Qwen3), RoPE, then
varlen attention over `Packed` sequences or paged attention over the engine's KV cache
(`PagedKV`), whose store of the new K/V runs in the RoPE kernel. With an fp8 KV cache
(`attn.kv_quant`), the store quantizes K/V and paged attention dequantizes them; packed
sequences read K and V fake-quantized with the same scales (`KVQuant.apply`), so both
paths attend over the same values.

A mixer's interface (what `DecoderLayer` calls, and what a linear-attention mixer must
take too): forward(x (T, D), positions (T,), attn: Packed | PagedKV, inv_freq, cos_sin)
-> (T, D).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from rlfuse.kernels.attention.paged import paged_attention
from rlfuse.kernels.attention.varlen import varlen_attention
from rlfuse.kernels.rope.rotary import qk_norm_rope
from rlfuse.model.layers.linear import Linear
from rlfuse.model.layers.norm import RMSNorm
from rlfuse.model.layers.packed import PagedKV

if TYPE_CHECKING:
    from rlfuse.model.config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, o_bias: bool | None = None):
        """o_bias: a bias on o_proj (None: cfg.attention_bias, as q/k/v have)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.n_q, self.n_kv, self.dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.n_q * self.dh, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.dh, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.dh, bias=cfg.attention_bias)
        self.o_proj = Linear(self.n_q * self.dh, cfg.hidden_size, bias=cfg.attention_bias if o_bias is None else o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.dh, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.dh, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_fused = None  # q/k/v as one GEMM: set by rlfuse.model.fuse (a plain attribute, no state)

    def forward(self, x_TD, positions, attn, inv_freq, cos_sin=None):
        """cos_sin: the forward's RoPE table (`rope_cos_sin`) or None (computed in the kernel)."""
        T = x_TD.shape[0]
        if self.qkv_fused is not None and self.qkv_fused.live(self):
            qkv = self.qkv_fused(x_TD)  # (T, (Hq + 2 Hkv) Dh)
            q, k, v = qkv.split(self.qkv_fused.sizes, -1)
            if qkv.requires_grad:  # what backward saves of a view would keep all of qkv alive
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        else:
            q, k, v = self.q_proj(x_TD), self.k_proj(x_TD), self.v_proj(x_TD)
        q, k, v = q.view(T, self.n_q, self.dh), k.view(T, self.n_kv, self.dh), v.view(T, self.n_kv, self.dh)
        # q/k norms (Qwen3), RoPE and the paged path's KV store: one kernel outside autograd
        norm = () if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        if isinstance(attn, PagedKV):
            k_cache, v_cache = attn.kv_caches[self.layer_idx]
            kv_scale = None if attn.kv_quant is None else attn.kv_quant.layer(self.layer_idx)
            q, _ = qk_norm_rope(q, k, positions, inv_freq, *norm, v=v, kv_cache=(k_cache, v_cache),
                                slot_mapping=attn.slot_mapping, cos_sin=cos_sin, kv_scale=kv_scale)
            o = paged_attention(q, k_cache, v_cache, attn.cu_seqlens_q, attn.seq_lens,
                                attn.block_tables, attn.max_seqlen_q, shared=attn.shared, kv_scale=kv_scale)
        else:
            q, k = qk_norm_rope(q, k, positions, inv_freq, *norm, cos_sin=cos_sin)
            if attn.kv_quant is not None:
                k, v = attn.kv_quant.apply(self.layer_idx, k, v)
            o = varlen_attention(q, k, v, attn.cu_seqlens, attn.max_seqlen, prefix=attn.prefix)
        return self.o_proj(o.reshape(T, self.n_q * self.dh))
