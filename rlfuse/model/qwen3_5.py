"""Qwen3.5 text model: the hybrid decoder of Gated DeltaNet and gated full-attention layers.

transformers' `Qwen3_5ForCausalLM` (model_type "qwen3_5_text"), and the text tower of
`Qwen3_5ForConditionalGeneration` ("qwen3_5"; `rlfuse.model.weights` maps its
`model.language_model.` names and leaves the vision tower and the MTP head unloaded).
Parameter names equal HF's. What differs from Qwen3 (`rlfuse.model.transformer`):

  * `layer_types[i]`: "linear_attention" layers hold `linear_attn` (a `GatedDeltaNet`,
    rlfuse.model.gated_deltanet), "full_attention" layers `self_attn`;
  * full attention has an output gate: q_proj gives, per head, [q (Dh) | gate (Dh)] and the
    attention output is multiplied by sigmoid(gate) before o_proj; q/k per-head norms;
    RoPE rotates only the first rotary_dim = int(Dh * partial_rotary_factor) dims of a head
    (the multimodal rope's three position streams are all the text position for text);
  * every RMSNorm but the gated one scales by (1 + w), w initialised to zero, and rounds
    once at the end: y = (rmsnorm(x in fp32) * (1 + w in fp32)).to(x.dtype)
    (HF `Qwen3_5RMSNorm`; Llama rounds x before the multiply).
The MLP, embeddings, LM head, residual stream and `CausalLM.forward` loop (checkpointing,
the residual add carried into the next norm) are Qwen3's.

Not covered: Qwen3-Next (model_type "qwen3_next"): the same mixers, but MoE MLPs and the
linear-attention projections fused as in_proj_qkvz / in_proj_ba, interleaved per key head;
the config loader refuses it with the supported list.

The forward runs on `Packed` whole sequences (the trainer), with or without a shared
prefix (GRPO's shared prompt: attention reads it once, the linear-attention layers re-run it
per reader, `gated_deltanet.PrefixRows`); the engine's paged path reaches the
full-attention layers only, its linear-attention state is a later step
(`GatedDeltaNet.forward_continue` is the hook).
Test: python -m pytest -q tests/test_qwen3_5.py
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from rlfuse.kernels.attention import varlen_attention
from rlfuse.kernels.paged_attention import paged_attention, store_kvcache
from rlfuse.kernels.rmsnorm import rmsnorm
from rlfuse.kernels.rope import rope, rope_inv_freq
from rlfuse.model.config import ModelConfig
from rlfuse.model.gated_deltanet import GatedDeltaNet, PrefixRows, elementwise
from rlfuse.model.transformer import MLP, CausalLM, Linear, Packed, PagedKV


@dataclasses.dataclass(slots=True)
class PackedWithPrefixRows(Packed):
    """A `Packed` with a shared prefix, carrying the linear-attention layers' re-laid rows
    (PrefixRows), computed once per forward instead of once per layer."""
    prefix_rows: PrefixRows | None = None


class OffsetRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: (rmsnorm(x.float()) * (1 + w.float())).to(x.dtype), w init 0.
    Through the rmsnorm kernel on the fp32 row with weight 1 + w: the kernel's cast of the
    normed row to x.dtype is then a no-op, which gives HF's single rounding at the end."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        """rmsnorm(x); with `residual` h: (h + x, rmsnorm(h + x)) as `transformer.RMSNorm`."""
        if residual is not None:
            s = residual + x
            return s, self(s)
        return rmsnorm(x.float(), 1.0 + self.weight.float(), self.eps).to(x.dtype)


class GatedAttention(nn.Module):
    """Full attention with Qwen3.5's output gate, q/k norms and partial rotary embedding."""

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
            store_kvcache(k, v, k_cache, v_cache, attn.slot_mapping)
            o = paged_attention(q, k_cache, v_cache, attn.cu_seqlens_q, attn.seq_lens, attn.block_tables,
                                attn.max_seqlen_q, shared=attn.shared)
        else:
            o = varlen_attention(q, k, v, attn.cu_seqlens, attn.max_seqlen, prefix=attn.prefix)
        o = o.reshape(T, self.n_q * self.dh) * elementwise(torch.sigmoid, gate.reshape(T, self.n_q * self.dh))
        return self.o_proj(o)


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_type = cfg.layer_type(layer_idx)
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = GatedAttention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, positions, attn, inv_freq, delta=None, cos_sin=None):
        """`transformer.DecoderLayer`'s protocol: -> (h, delta), the stream after the layer
        being h + delta (the add lands in the next norm)."""
        if delta is None:
            x = self.input_layernorm(h)
        else:
            h, x = self.input_layernorm(delta, h)
        if self.layer_type == "linear_attention":
            mixed = self.linear_attn(x, attn, getattr(attn, "prefix_rows", None))
        else:
            mixed = self.self_attn(x, positions, attn, inv_freq, cos_sin)
        h, x = self.post_attention_layernorm(mixed, h)
        return h, self.mlp(x)


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3_5ForCausalLM(CausalLM):
    """`CausalLM` with the hybrid decoder: forward, logits, the padded path and gradient
    checkpointing are CausalLM's; the layers and the RoPE table (rotary_dim wide) are ours."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)  # not CausalLM.__init__: it would build Qwen3 layers first
        if not cfg.is_hybrid:
            raise ValueError(f"Qwen3_5ForCausalLM: config model_type {cfg.model_type!r} has no layer_types")
        self.config = cfg
        self.model = HybridModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def forward(self, input_ids, positions, attn: Packed | PagedKV):
        """CausalLM.forward; a Packed batch with a shared prefix (GRPO's shared prompt) gets
        the linear-attention layers' re-laid rows first (`PrefixRows`, one host sync)."""
        if isinstance(attn, Packed) and attn.prefix is not None and not isinstance(attn, PackedWithPrefixRows):
            attn = PackedWithPrefixRows(attn.cu_seqlens, attn.max_seqlen, attn.prefix, PrefixRows.of(attn))
        return super().forward(input_ids, positions, attn)

    def inv_freq(self, device) -> torch.Tensor:
        device = torch.device(device)
        if device not in self._inv_freq:
            c = self.config
            self._inv_freq[device] = rope_inv_freq(c.rotary_dim, c.rope_theta, c.rope_scaling).to(device)
        return self._inv_freq[device]

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None):
        """transformers' init: matrices N(0, std), (1 + w) norms at w = 0, the gated norm and
        dt_bias at 1, A = exp(A_log) uniform in [0.01, 16)."""
        for name, p in self.named_parameters():
            if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
                p.fill_(1.0)
            elif name.endswith("norm.weight") or name.endswith(".bias"):
                p.zero_()
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 16.0, generator=generator).log())
            else:
                p.normal_(0.0, std, generator=generator)


def tiny_hybrid_fields(**over) -> dict:
    """ModelConfig fields of a small Qwen3.5 shape for the CPU demo / check / tests (usable as
    a recipe's `model.random_init`): 4 layers (three Gated DeltaNet, then one gated full
    attention), value heads = 2 x key heads, head_dim 16 with half of it rotated. `over`:
    any ModelConfig field (e.g. vocab_size for a tokenizer)."""
    return dict(model_type="qwen3_5_text", vocab_size=512, hidden_size=64, intermediate_size=192,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                partial_rotary_factor=0.5, tie_word_embeddings=False, max_position_embeddings=1024,
                rope_theta=10000.0, layer_types=("linear_attention",) * 3 + ("full_attention",),
                linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4) | over


def tiny_hybrid_config(**over) -> ModelConfig:
    return ModelConfig(**tiny_hybrid_fields(**over))


def tiny_hybrid_model(seed: int = 0, std: float = 0.1, **over) -> Qwen3_5ForCausalLM:
    """The tiny hybrid model (`tiny_hybrid_config(**over)`), fp32, weights drawn from `seed`."""
    model = Qwen3_5ForCausalLM(tiny_hybrid_config(**over))
    model.init_weights(std=std, generator=torch.Generator().manual_seed(seed))
    return model
