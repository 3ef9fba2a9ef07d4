"""One decoder-only transformer for the Llama, Qwen2, Qwen3 and Qwen3-MoE families (the
MoE block is `rlfuse.model.moe`, picked per layer by `make_mlp`).

Parameter names equal the Hugging Face ones (`model.layers.3.self_attn.q_proj.weight`,
`lm_head.weight`, ...), so a safetensors checkpoint maps 1:1 onto `state_dict()` and
what we save loads in `transformers` unchanged.

The forward works on packed tokens: input_ids (T,), positions (T,) and an attention
descriptor, and returns final hidden states (T, D) -- never logits, so log-probs come
from `rlfuse.kernels.logprob` without a (T, V) tensor. Two descriptors:
  * `Packed(cu_seqlens, max_seqlen, prefix)`: causal attention within each packed sequence
    (training, evaluation, the naive reference generator); with `prefix`, a group's
    sequences read one shared prompt packed once (`rlfuse.kernels.attention.SharedPrefix`);
  * `PagedKV(...)`: the engine's paged KV cache (prefill chunks and decode).
`forward_padded(input_ids (B, S), attention_mask)` packs a padded batch, runs the same
path and scatters back, so padded and packed inputs give the same per-sequence results.

Shape legend: T packed tokens, B sequences, D hidden, Hq/Hkv heads, Dh head dim, V vocab.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlfuse.kernels.attention import SharedPrefix, varlen_attention
from rlfuse.kernels.backend import current_backend, current_numerics, use_backend, use_numerics
from rlfuse.kernels.linear import linear
from rlfuse.kernels.paged_attention import SharedPrefixDecode, paged_attention
from rlfuse.kernels.rmsnorm import add_rmsnorm, rmsnorm
from rlfuse.kernels.rope import qk_norm_rope, rope_cos_sin, rope_inv_freq
from rlfuse.kernels.swiglu import swiglu, swiglu_packed
from rlfuse.model.config import ModelConfig
from rlfuse.model.moe import SparseMoeBlock


def _with_kernels(backend: str, numerics: str, layer, *args):
    with use_backend(backend), use_numerics(numerics):
        return layer(*args)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict names) whose forward goes through
    `rlfuse.kernels.linear`: F.linear in fast numerics, batch-invariant in exact."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


@dataclasses.dataclass(slots=True)
class Packed:
    """Causal attention within packed sequences: rows cu_seqlens[b]:cu_seqlens[b+1]; with
    `prefix`, segment b also reads a shared prefix segment first (SharedPrefix)."""
    cu_seqlens: torch.Tensor  # (B+1,) int32
    max_seqlen: int
    prefix: SharedPrefix | None = None

    @classmethod
    def from_lengths(cls, lengths: list[int], device=None, prefix_of: list[int | None] | None = None) -> "Packed":
        """prefix_of[b]: the segment that segment b reads as its shared prefix (None = none)."""
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
        prefix = None
        if prefix_of is not None and any(p is not None for p in prefix_of):
            prefix = SharedPrefix.from_groups(lengths, prefix_of, device)
        return cls(cu.to(device), max(lengths) if lengths else 0, prefix)


def pack_by_tokens(lengths: list[int], budget: int, shared: list[int] | None = None) -> list[list[int]]:
    """Sequence indices grouped into micro-batches of at most `budget` tokens, greedily in
    order (deterministic, so accumulated sums add up in a fixed order); a sequence longer
    than the budget goes alone. `shared[i]`: tokens of sequence i packed once with sequence
    i - 1 when both share a micro-batch (a shared prompt), so it costs lengths[i] - shared[i]."""
    if budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    batches: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if shared is not None and cur and cur[-1] == i - 1:
            n -= shared[i]
        if cur and used + n > budget:
            batches.append(cur)
            cur, used = [], 0
            n = lengths[i]
        cur.append(i)
        used += n
    if cur:
        batches.append(cur)
    return batches


@dataclasses.dataclass(slots=True)
class PagedKV:
    """Attention against the engine's paged KV cache (see `rlfuse.kernels.paged_attention`).
    The new tokens' K/V are written at `slot_mapping` before attention reads the cache."""
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (num_blocks, block_size, Hkv, Dh)
    slot_mapping: torch.Tensor  # (T,) int64, -1 = padding row
    cu_seqlens_q: torch.Tensor  # (B+1,) int32
    seq_lens: torch.Tensor      # (B,) int32, cached tokens after this step
    block_tables: torch.Tensor  # (B, max_blocks) int32
    max_seqlen_q: int
    shared: SharedPrefixDecode | None = None  # decode: prompt prefixes read once per group


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        """rmsnorm(x); with `residual` h: (h + x, rmsnorm(h + x)), the add in the norm's kernel."""
        if residual is None:
            return rmsnorm(x, self.weight, self.eps)
        return add_rmsnorm(residual, x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_q, self.n_kv, self.dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.n_q * self.dh, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.dh, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.dh, bias=cfg.attention_bias)
        # Qwen2 has q/k/v biases but never an o_proj bias; Llama and Qwen3 follow attention_bias
        self.o_proj = Linear(self.n_q * self.dh, cfg.hidden_size,
                                bias=cfg.attention_bias and cfg.model_type != "qwen2")
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
            q, _ = qk_norm_rope(q, k, positions, inv_freq, *norm, v=v, kv_cache=(k_cache, v_cache),
                                slot_mapping=attn.slot_mapping, cos_sin=cos_sin)
            o = paged_attention(q, k_cache, v_cache, attn.cu_seqlens_q, attn.seq_lens,
                                attn.block_tables, attn.max_seqlen_q, shared=attn.shared)
        else:
            q, k = qk_norm_rope(q, k, positions, inv_freq, *norm, cos_sin=cos_sin)
            o = varlen_attention(q, k, v, attn.cu_seqlens, attn.max_seqlen, prefix=attn.prefix)
        return self.o_proj(o.reshape(T, self.n_q * self.dh))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_fused = None  # gate/up as one GEMM: set by rlfuse.model.fuse (a plain attribute, no state)

    def forward(self, x):
        if self.gate_up_fused is not None and self.gate_up_fused.live(self):
            return self.down_proj(swiglu_packed(self.gate_up_fused(x)))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def make_mlp(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """Layer `layer_idx`'s feed-forward block: the sparse MoE block where the config's MoE
    rule makes the layer sparse (`MoEConfig.is_sparse`), else the dense SwiGLU MLP."""
    m = cfg.moe
    if m is not None and m.is_sparse(layer_idx):
        return SparseMoeBlock(hidden_size=cfg.hidden_size, moe_intermediate_size=m.moe_intermediate_size,
                              num_experts=m.num_experts, top_k=m.num_experts_per_tok,
                              norm_topk_prob=m.norm_topk_prob, layer_idx=layer_idx,
                              record_stats=m.output_router_logits)
    return MLP(cfg)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = make_mlp(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, positions, attn, inv_freq, delta=None, cos_sin=None):
        """h: the residual stream, delta: the previous layer's output not yet added to it
        (None before the first layer). -> (h, delta) with the stream after this layer =
        h + delta: each residual add runs in the kernel of the norm that follows it.
        cos_sin: the forward's RoPE table (`rope_cos_sin`), or None."""
        if delta is None:
            x = self.input_layernorm(h)
        else:
            h, x = self.input_layernorm(delta, h)
        h, x = self.post_attention_layernorm(self.self_attn(x, positions, attn, inv_freq, cos_sin), h)
        return h, self.mlp(x)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The policy model. `forward` returns final hidden states (T, D)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """(V, D): the LM head, i.e. the embedding matrix when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def inv_freq(self, device) -> torch.Tensor:
        # fp32 RoPE frequencies kept outside the module's buffers so `.to(bf16)` never rounds them
        device = torch.device(device)
        if device not in self._inv_freq:
            c = self.config
            self._inv_freq[device] = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling).to(device)
        return self._inv_freq[device]

    def forward(self, input_ids, positions, attn: Packed | PagedKV):
        """input_ids (T,), positions (T,) -> hidden (T, D)."""
        h, delta = self.model.embed_tokens(input_ids), None
        inv_freq = self.inv_freq(h.device)
        # every layer rotates by the same angles: their cos/sin once per forward (Triton only)
        cos_sin = rope_cos_sin(positions, inv_freq)
        backend, numerics = current_backend(), current_numerics()
        for layer in self.model.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                # The recompute runs inside backward, on autograd's device thread for CUDA,
                # where the kernel context variables are back at their defaults: pin the
                # forward's backend and numerics so the recompute saves the same tensors
                # (else CheckpointError, or gradients of a different forward).
                h, delta = checkpoint(_with_kernels, backend, numerics, layer, h, positions, attn, inv_freq,
                                      delta, cos_sin, use_reentrant=False)
            else:
                h, delta = layer(h, positions, attn, inv_freq, delta, cos_sin)
        return self.model.norm(h) if delta is None else self.model.norm(delta, h)[1]

    def forward_padded(self, input_ids, attention_mask=None):
        """input_ids (B, S) with a 0/1 mask (left or right padding) -> hidden (B, S, D);
        padded rows are zero. Positions count only unmasked tokens."""
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = attention_mask.bool()
        starts = (mask[:, 1:] & ~mask[:, :-1]).sum(1) + mask[:, 0].long()
        if bool((starts > 1).any()):  # host sync: convenience path, not a hot loop
            raise ValueError("attention_mask: each row's tokens must be contiguous (left or right padding)")
        lens = mask.sum(1)
        positions = (mask.long().cumsum(1) - 1).clamp_min(0)
        flat = mask.flatten().nonzero().squeeze(1)
        cu = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        h = self.forward(input_ids.flatten()[flat], positions.flatten()[flat], Packed(cu, int(lens.max())))
        out = h.new_zeros(B * S, h.shape[-1]).index_copy(0, flat, h)
        return out.view(B, S, -1)

    def logits(self, hidden):
        """Full logits (..., V) in fp32 -- for tests and small vocabularies only."""
        return hidden.float() @ self.lm_head_weight.float().t()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None):
        """Random init like `transformers` (normal(0, std) matrices, zero biases, unit norms)."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)
