"""The causal LM every registered architecture builds: embeddings, a stack of decoder layers
whose mixer and MLP the architecture picks per layer (`rlfuse.model.arch`: ArchSpec), a final
norm and the LM head. Shared building blocks are in `rlfuse.model.layers`.

Parameter names equal the Hugging Face ones (`model.layers.3.self_attn.q_proj.weight`,
`lm_head.weight`, ...), so a safetensors checkpoint maps 1:1 onto `state_dict()` and
what we save loads in `transformers` unchanged.

The forward works on packed tokens: input_ids (T,), positions (T,) and an attention
descriptor, and returns final hidden states (T, D) -- never logits, so log-probs come
from `rlfuse.kernels.loss.logprob` without a (T, V) tensor. Two descriptors:
  * `Packed(cu_seqlens, max_seqlen, prefix)` (`rlfuse.model.layers.packed`): causal attention within each packed sequence
    (training, evaluation, the naive reference generator); with `prefix`, a group's
    sequences read one shared prompt packed once (`rlfuse.kernels.attention.varlen.SharedPrefix`);
  * `PagedKV(...)`: the engine's paged KV cache (prefill chunks and decode).
`forward_padded(input_ids (B, S), attention_mask)` packs a padded batch, runs the same
path and scatters back, so padded and packed inputs give the same per-sequence results.

Vision-language models (`cfg.vision`, Qwen3-VL, Qwen3.5): `visual` is the vision tower
(`rlfuse.model.vision`), frozen by default (`set_vision_trainable`). `encode_images(pixels,
grid_thw)` -> `ImageFeatures`; the forward takes them (`image_features=`, e.g. cached per
image by the engine) or the pixels, writes the embeds into the rows where input_ids is the
image token (in order; their count must match), adds the DeepStack features there after
decoder layers 0..L-1, and takes positions (3, T) (mRoPE rows t, h, w) or (T,) (text only:
the same bits as three equal rows).

Shape legend: T packed tokens, B sequences, D hidden, Hq/Hkv heads, Dh head dim, V vocab.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlfuse.kernels.backend import KernelSettings, current_settings, use_settings
from rlfuse.kernels.kv_quant import KVQuant
from rlfuse.kernels.loss.logprob import token_logprobs
from rlfuse.kernels.rope.rotary import rope_cos_sin, rope_inv_freq
from rlfuse.model.arch import ARCHS
from rlfuse.model.config import ModelConfig
from rlfuse.model.layers import DecoderLayer, Linear, Packed, PagedKV
from rlfuse.model.vision import ImageFeatures, VisionTower, init_vision_weights, mrope_axis


def _with_kernels(settings: KernelSettings, layer, *args):
    with use_settings(settings):
        return layer(*args)


def build_layer(cfg: ModelConfig, layer_idx: int, layer_type: str) -> DecoderLayer:
    """Layer `layer_idx` of the architecture `cfg.model_type`: its mixer for `layer_type` and its MLP."""
    spec = ARCHS[cfg.model_type]
    if layer_type not in spec.mixers:
        raise ValueError(f"{spec.hf_class}: layer {layer_idx} has layer type {layer_type!r}; this architecture "
                         f"builds {sorted(spec.mixers)}")
    name, mixer = spec.mixers[layer_type]
    return DecoderLayer(cfg, layer_idx, name, mixer(cfg, layer_idx), spec.mlp(cfg, layer_idx), spec.norm)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        types = ARCHS[cfg.model_type].layer_types(cfg)
        if len(types) != cfg.num_hidden_layers:
            raise ValueError(f"{cfg.architecture}: {len(types)} layer types for {cfg.num_hidden_layers} layers")
        self.layers = nn.ModuleList(build_layer(cfg, i, t) for i, t in enumerate(types))
        self.norm = ARCHS[cfg.model_type].norm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The policy model. `forward` returns final hidden states (T, D)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self.kernels: KernelSettings | None = None
        """The backend and numerics every forward and log-prob head of this model runs in
        (the run's session sets them; None: the caller's context)."""
        self.kv_quant: KVQuant | None = None
        """The fp8 KV scales of the engine generating from this model (`rlfuse.kernels.kv_quant`;
        the engine sets it: its own KVQuant with an fp8 cache, None otherwise). Every forward
        gets it in its attention metadata, so packed forwards (the trainer's, the naive
        generator's) attend over K and V quantized with the scales the engine's cache uses."""
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self._mrope_axis: dict[torch.device, torch.Tensor] = {}
        self.visual = None if cfg.vision is None else VisionTower(cfg.vision)
        self.set_vision_trainable(False)

    def set_vision_trainable(self, trainable: bool) -> None:
        """requires_grad of the vision tower's parameters (frozen by default); no-op without one."""
        if self.visual is not None:
            self.visual.requires_grad_(trainable)

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> ImageFeatures:
        """pixel_values (n_patches, C*Tp*P*P), image_grid_thw (n, 3) -> the images' features,
        in this model's kernel settings."""
        if self.visual is None:
            raise ValueError(f"{self.config.architecture} has no vision tower: it takes no images")
        with use_settings(self.kernels):
            return self.visual(pixel_values, image_grid_thw)

    def mrope_axis(self, device) -> torch.Tensor:
        device = torch.device(device)
        if device not in self._mrope_axis:
            self._mrope_axis[device] = mrope_axis(self.config.mrope_section, self.config.rotary_dim // 2).to(device)
        return self._mrope_axis[device]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """(V, D): the LM head, i.e. the embedding matrix when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def inv_freq(self, device) -> torch.Tensor:
        # fp32 RoPE frequencies kept outside the module's buffers so `.to(bf16)` never rounds them
        device = torch.device(device)
        if device not in self._inv_freq:
            c = self.config
            # rotary_dim: the head dims RoPE turns (head_dim but for a partial rotary factor)
            self._inv_freq[device] = rope_inv_freq(c.rotary_dim, c.rope_theta, c.rope_scaling).to(device)
        return self._inv_freq[device]

    def forward(self, input_ids, positions, attn: Packed | PagedKV, image_features: ImageFeatures | None = None, *,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None):
        """input_ids (T,), positions (T,) or (3, T) -> hidden (T, D), in this model's kernel
        settings. Images (vision models): `image_features` or `pixel_values` + `image_grid_thw`."""
        with use_settings(self.kernels):
            if pixel_values is not None:
                if image_features is not None:
                    raise ValueError("forward: give image_features or pixel_values, not both")
                image_features = self.encode_images(pixel_values, image_grid_thw)
            return self._forward(input_ids, positions, attn, image_features)

    def _image_rows(self, input_ids, feats: ImageFeatures) -> torch.Tensor:
        if self.visual is None:
            raise ValueError(f"{self.config.architecture} has no vision tower: it takes no images")
        rows = (input_ids == self.config.vision.image_token_id).nonzero().squeeze(1)  # host sync: once per image forward
        if rows.shape[0] != len(feats):
            raise ValueError(f"input_ids hold {rows.shape[0]} image placeholder tokens (id "
                             f"{self.config.vision.image_token_id}) for {len(feats)} image feature rows")
        return rows

    def _forward(self, input_ids, positions, attn, feats=None):
        if self.kv_quant is not None and attn.kv_quant is None:
            attn = dataclasses.replace(attn, kv_quant=self.kv_quant)
        prepare = ARCHS[self.config.model_type].prepare
        if prepare is not None:  # metadata the family's mixers share, once per forward
            attn = prepare(attn)
        h, delta = self.model.embed_tokens(input_ids), None
        rows = None
        if feats is not None:
            if positions.dim() != 2:  # image tokens at text positions: a silent mistake, refused
                raise ValueError(f"positions {tuple(positions.shape)}: a forward with images takes mRoPE positions "
                                 f"(3, T) (rlfuse.model.vision.mrope_positions)")
            rows = self._image_rows(input_ids, feats)
            h = h.index_copy(0, rows, feats.embeds.to(h.dtype))
        inv_freq = self.inv_freq(h.device)
        if positions.dim() == 2:  # mRoPE rows (t, h, w): the table, then the ops take row 0 (for its length)
            if self.config.mrope_section is None:
                raise ValueError(f"positions {tuple(positions.shape)}: {self.config.architecture} takes (T,) positions")
            cos_sin = rope_cos_sin(positions, inv_freq, self.mrope_axis(h.device))
            positions = positions[0]
        else:
            # every layer rotates by the same angles: their cos/sin once per forward (Triton only)
            cos_sin = rope_cos_sin(positions, inv_freq)
        settings = current_settings()
        for i, layer in enumerate(self.model.layers):
            if self.gradient_checkpointing and torch.is_grad_enabled():
                # The recompute runs inside backward, on autograd's device thread for CUDA,
                # where the kernel context variables are back at their defaults: pin the
                # forward's backend and numerics so the recompute saves the same tensors
                # (else CheckpointError, or gradients of a different forward).
                h, delta = checkpoint(_with_kernels, settings, layer, h, positions, attn, inv_freq,
                                      delta, cos_sin, use_reentrant=False)
            else:
                h, delta = layer(h, positions, attn, inv_freq, delta, cos_sin)
            if rows is not None and i < feats.deepstack.shape[0]:
                # DeepStack: into the layer's output not yet added (text rows untouched, bitwise)
                delta = delta.index_add(0, rows, feats.deepstack[i].to(delta.dtype))
        return self.model.norm(h) if delta is None else self.model.norm(delta, h)[1]

    def token_logprobs(self, hidden_ND, targets_N, temperature=1.0, return_entropy: bool = False):
        """log p(targets) (N,) from final hidden states through the LM head
        (`rlfuse.kernels.loss.logprob`), in this model's kernel settings; with entropy: (logp, ent)."""
        with use_settings(self.kernels):
            return token_logprobs(hidden_ND, self.lm_head_weight, targets_N, temperature, return_entropy=return_entropy)

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
        """Random init like `transformers` (normal(0, std) matrices, zero biases, unit norms;
        a family's own rule where its ArchSpec has one)."""
        own = ARCHS[self.config.model_type].init_weights
        if own is not None:
            own(self, std, generator)
            return
        if self.visual is not None:
            init_vision_weights(self.visual, std, generator)
        for name, p in self.named_parameters():
            if name.startswith("visual."):
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)
