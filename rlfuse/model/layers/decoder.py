"""A pre-norm decoder layer assembled from a token mixer and an MLP the architecture picks
per layer (`rlfuse.model.arch`): full attention or, in a hybrid stack, linear attention;
a dense MLP or an MoE block. The residual adds run in the kernel of the norm that follows.

State-dict names are HF's: the mixer sits under its HF attribute (`self_attn`,
`linear_attn`, ...), then `mlp`, `input_layernorm`, `post_attention_layernorm`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from rlfuse.model.layers.norm import RMSNorm

if TYPE_CHECKING:
    from rlfuse.model.config import ModelConfig


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, mixer_name: str, mixer: nn.Module, mlp: nn.Module,
                 norm=RMSNorm):
        """norm: builder(dim, eps) of the two RMSNorms (the architecture's variant)."""
        super().__init__()
        self.mixer_name = mixer_name
        setattr(self, mixer_name, mixer)  # registered first: parameter order as HF's (init draws in this order)
        self.mlp = mlp
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, h, positions, attn, inv_freq, delta=None, cos_sin=None):
        """h: the residual stream, delta: the previous layer's output not yet added to it
        (None before the first layer). -> (h, delta) with the stream after this layer =
        h + delta: each residual add runs in the kernel of the norm that follows it.
        cos_sin: the forward's RoPE table (`rope_cos_sin`), or None."""
        if delta is None:
            x = self.input_layernorm(h)
        else:
            h, x = self.input_layernorm(delta, h)
        h, x = self.post_attention_layernorm(self.mixer(x, positions, attn, inv_freq, cos_sin), h)
        return h, self.mlp(x)
