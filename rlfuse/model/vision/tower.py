"""Qwen3-VL's vision tower: patches -> ViT blocks -> merged image tokens, plus DeepStack
features (transformers' `Qwen3VLVisionModel`; parameter names and shapes equal its, under
`visual.` here and `model.visual.` in a checkpoint). Qwen3.5's (`Qwen3_5VisionModel`) is the
same tower with `deepstack_visual_indexes` = (): no DeepStack mergers, an empty `deepstack`.

For one image of grid (t, h, w) patches (pixel_values rows in the processor's order:
merge-block-major, `rlfuse.model.vision.processor`):
    x = patch_embed(pixels)                       (N, E)   the Conv3d with stride = kernel, as a GEMM
    x = x + bilinear(pos_embed, (h, w))           (N, E)   the learned square grid resampled (align_corners)
    per block:  x = x + attn(ln1(x)),  x = x + mlp(ln2(x))
        attn: qkv GEMM, 2-D RoPE on q and k (NeoX halves of Dh; the first Dh/4 frequencies
        turn by the patch's row, the other Dh/4 by its column, one multi-axis table,
        `rope_cos_sin(coords, inv_freq, axis)`), bidirectional attention within each frame
        (`segment_attention`), proj GEMM
    after block b in deepstack_visual_indexes: ds_j = merger_j(x)   post-shuffle LayerNorm
    embeds = merger(x)                            (N / m^2, D)  LayerNorm, merge m x m, MLP
`ImageFeatures(embeds, deepstack (L, N / m^2, D))` is what the causal LM scatters into the
image-token rows (`rlfuse.model.causal_lm`).

Shape legend: N patches, E vision width, H heads, Dh = E / H, m spatial merge, D text width.
Test: python -m pytest -q tests/test_qwen3_vl.py
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from rlfuse.kernels.attention.segment import segment_attention
from rlfuse.kernels.backend import is_exact
from rlfuse.kernels.linear.gemm import linear
from rlfuse.kernels.rope.rotary import rope, rope_cos_sin, rope_inv_freq
from rlfuse.model.layers.linear import Linear
from rlfuse.model.vision.config import VisionConfig


@dataclasses.dataclass(slots=True)
class ImageFeatures:
    """The tower's output for some images, rows in image order: embeds (N, D) go into the
    image-token rows, deepstack (L, N, D) are added there after decoder layers 0..L-1."""
    embeds: torch.Tensor
    deepstack: torch.Tensor

    def __len__(self) -> int:
        return self.embeds.shape[0]

    def narrow(self, start: int, n: int) -> ImageFeatures:
        """Rows start:start+n (a prefill chunk's share of the image tokens)."""
        return ImageFeatures(self.embeds[start:start + n], self.deepstack[:, start:start + n])

    def split(self, counts: list[int]) -> list[ImageFeatures]:
        """Per image (counts: `tokens_per_image`), e.g. to cache each image's features."""
        return [ImageFeatures(e, d) for e, d in zip(self.embeds.split(counts), self.deepstack.split(counts, 1))]

    @staticmethod
    def cat(parts: list[ImageFeatures]) -> ImageFeatures:
        return ImageFeatures(torch.cat([p.embeds for p in parts]), torch.cat([p.deepstack for p in parts], 1))


def tokens_per_image(grid_thw: torch.Tensor, merge: int) -> list[int]:
    """Image tokens (text-side rows) of each image: t * h * w / merge^2."""
    return [t * h * w // (merge * merge) for t, h, w in grid_thw.tolist()]  # host sync: (n, 3) grid


def _block_order(h: int, w: int, m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) (h*w,) of a frame's patches in the processor's merge-block-major order."""
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)

    def order(x):
        return x.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).reshape(-1)
    return order(rows), order(cols)


def _bilinear_taps(idx: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Source taps (n, 2) and weights (n, 2) of target indices `idx` on an axis of `size`
    samples read from `side` grid points, align_corners=True (the ends map to the ends)."""
    src = idx.float() * (side - 1) / max(size - 1, 1)
    lo = src.floor()
    offsets = torch.arange(2, device=idx.device)
    taps = (lo.long()[:, None] + offsets).clamp(0, side - 1)
    # the hat kernel 1 - |distance| (HF's arithmetic, so the same fp32 weights)
    return taps, (1 - (src[:, None] - lo[:, None] - offsets).abs()).clamp(min=0)


class PatchEmbed(nn.Module):
    """Conv3d(C, E, kernel = stride = (Tp, P, P)) over (C, Tp, P, P) patches: one GEMM with
    the kernel flattened (HF's parameter names and 5-D weight shape)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Module()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj.weight = nn.Parameter(torch.empty(cfg.hidden_size, cfg.in_channels, *k))
        self.proj.bias = nn.Parameter(torch.zeros(cfg.hidden_size))

    def forward(self, pixels):  # (N, C*Tp*P*P) -> (N, E)
        w = self.proj.weight
        return linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.n_heads, self.dh = cfg.num_heads, cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x, cu_seqlens, rope_args):
        N = x.shape[0]
        q, k, v = self.qkv(x).view(N, 3, self.n_heads, self.dh).unbind(1)  # (N, H, Dh) each
        q, k = rope(q, *rope_args), rope(k, *rope_args)
        return self.proj(segment_attention(q, k, v, cu_seqlens).reshape(N, -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cu_seqlens, rope_args):
        x = x + self.attn(self.norm1(x), cu_seqlens, rope_args)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """m x m neighbouring patches (consecutive rows) -> one D-wide token: LayerNorm (per
    patch, or after the shuffle on the joined m^2 E row: `postshuffle`), then fc1, GELU, fc2."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool):
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = Linear(self.width, self.width, bias=True)
        self.linear_fc2 = Linear(self.width, cfg.out_hidden_size, bias=True)

    def forward(self, x):
        x = self.norm(x.reshape(-1, self.width)) if self.postshuffle else self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, postshuffle=True)
                                                   for _ in cfg.deepstack_visual_indexes)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device) -> torch.Tensor:
        """(Dh/2,) fp32: the Dh/4 frequencies of the h axis, then the same for w."""
        device = torch.device(device)
        if device not in self._inv_freq:
            f = rope_inv_freq(self.config.head_dim // 2, self.config.rope_theta)
            self._inv_freq[device] = torch.cat([f, f]).to(device)
        return self._inv_freq[device]

    def layout(self, grid_thw: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-patch metadata of the images: (h, w) coordinates (2, N) for the 2-D RoPE,
        position-grid taps (N, 4) and weights (N, 4), the frames' cu_seqlens (F+1,) int32."""
        m, side = self.config.spatial_merge_size, int(self.config.num_position_embeddings ** 0.5)
        coords, taps, weights, lens = [], [], [], [0]
        for t, h, w in grid_thw.tolist():  # host sync: the (n, 3) grid sizes every tensor here
            if h % m or w % m:
                raise ValueError(f"image_grid_thw: grid ({t}, {h}, {w}) is not a multiple of spatial_merge_size {m}")
            r, c = _block_order(h, w, m, device)
            (rt, rw), (ct, cw) = _bilinear_taps(r, h, side), _bilinear_taps(c, w, side)
            coords.append(torch.stack([r, c]).repeat(1, t))
            taps.append((rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4).repeat(t, 1))
            weights.append((rw[:, :, None] * cw[:, None, :]).reshape(-1, 4).repeat(t, 1))
            lens += [h * w] * t
        cu = torch.tensor(lens, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
        return torch.cat(coords, 1), torch.cat(taps), torch.cat(weights), cu

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> ImageFeatures:
        """pixel_values (N, C*Tp*P*P), grid_thw (n, 3) -> the images' features. In exact
        numerics image by image (batch invariance: an image's features are its own)."""
        if pixel_values.dim() != 2 or pixel_values.shape[1] != self.config.patch_dim:
            raise ValueError(f"pixel_values: expected (n_patches, {self.config.patch_dim}), "
                             f"got {tuple(pixel_values.shape)}")
        grid_thw = grid_thw.reshape(-1, 3)
        if int(grid_thw.prod(-1).sum()) != pixel_values.shape[0]:  # host sync: a (n, 3) tensor
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches; image_grid_thw "
                             f"{grid_thw.tolist()} holds {int(grid_thw.prod(-1).sum())}")
        if is_exact() and grid_thw.shape[0] > 1:
            parts = pixel_values.split(grid_thw.prod(-1).tolist())
            return ImageFeatures.cat([self._encode(p, g[None]) for p, g in zip(parts, grid_thw)])
        return self._encode(pixel_values, grid_thw)

    def _encode(self, pixel_values, grid_thw) -> ImageFeatures:
        x = self.patch_embed(pixel_values)
        coords, taps, weights, cu = self.layout(grid_thw, x.device)
        x = x + (self.pos_embed(taps) * weights[:, :, None]).sum(1).to(x.dtype)  # fp32 weights, as HF
        inv = self.inv_freq(x.device)
        axis = torch.arange(inv.shape[0], device=x.device) >= inv.shape[0] // 2  # h frequencies, then w
        rope_args = (coords[0], inv, rope_cos_sin(coords, inv, axis.long()))
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cu, rope_args)
            if i in self.config.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.config.deepstack_visual_indexes.index(i)](x))
        embeds = self.merger(x)
        ds = torch.stack(deepstack) if deepstack else embeds.new_zeros((0, *embeds.shape))
        return ImageFeatures(embeds, ds)


@torch.no_grad()
def init_vision_weights(tower: VisionTower, std: float, generator: torch.Generator | None) -> None:
    """transformers' init for the tower: matrices and embeddings N(0, std), zero biases,
    unit LayerNorm weights."""
    for name, p in tower.named_parameters():
        if ".norm" in f".{name}" and name.endswith("weight") and p.dim() == 1:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=generator)
