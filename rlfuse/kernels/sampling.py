"""Sampling from (B, V) logits with temperature, top-k, top-p and min-p, per-row seeds.

Semantics (order matters and is fixed): scale by 1/temperature; keep the top-k scaled
logits (ties at the threshold kept; k <= 0 or k >= V disables); renormalize and keep the
smallest prefix of the sorted distribution whose mass reaches top_p (the most likely
token always stays; top_p = 1 disables); keep tokens with p >= min_p * p_max (min_p = 0
disables). Then draw with the Gumbel-max trick,
    id = argmax_v (kept_logit_v / T + g_v),   g_v = -log(-log(u_v)),
which samples exactly the filtered, renormalized softmax. temperature == 0 means greedy.

Randomness is a counter-based hash, not a torch.Generator: u_v depends only on
(seed_b, offset_b, v), so the same seed and token position give the same draw on any
backend, batch size or batch order. The engine passes offset = the token's position.

Returned log-prob: log softmax(logits / T)[id], the unfiltered policy (T := 1 when
greedy); the engine's rollout log-probs come from `rlfuse.kernels.logprob` instead, the
function the trainer shares.
"""

from __future__ import annotations

import torch

from rlfuse.kernels.backend import resolve_backend

_M32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (lowbias32 family) on int64 tensors holding uint32 values.
    Multipliers are < 2**31 so int64 products never overflow; Triton computes the same
    function in uint32 arithmetic."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x6A09E667) & _M32
    x = x ^ (x >> 16)
    return x


def row_keys(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(B,) int64 keys from per-row seeds and offsets (both int64 >= 0)."""
    s = seeds.long()
    h = hash32(s & _M32)
    h = hash32(h ^ ((s >> 32) & _M32))
    return hash32(h ^ (offsets.long() & _M32))


def uniform_from_keys(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, V) fp32 uniforms in (0, 1): 24 random bits, centred, so never 0 or 1."""
    v = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    bits = hash32(keys[:, None] ^ v[None, :]) >> 8
    return (bits.float() + 0.5) * (1.0 / 16777216.0)


def filter_logits_ref(scaled: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """scaled (B, V) fp32 -> same with filtered entries set to -inf (sort-based)."""
    B, V = scaled.shape
    sorted_vals, _ = scaled.sort(dim=-1, descending=True)
    k = torch.where((top_k <= 0) | (top_k >= V), V, top_k).long()
    kth = sorted_vals.gather(1, (k - 1)[:, None])
    out = scaled.masked_fill(scaled < kth, float("-inf"))
    # top-p on the top-k-renormalized distribution
    sorted_vals = sorted_vals.masked_fill(sorted_vals < kth, float("-inf"))
    sorted_p = torch.softmax(sorted_vals, dim=-1)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    keep_sorted = mass_before < top_p.float()[:, None]
    keep_sorted[:, 0] = True
    n_keep = keep_sorted.sum(-1)
    p_thresh = sorted_vals.gather(1, (n_keep - 1)[:, None])
    out = out.masked_fill(out < p_thresh, float("-inf"))
    # min-p relative to the most likely token: p_v >= min_p * p_max  <=>  s_v >= s_max + log(min_p)
    s_max = sorted_vals[:, :1]
    mp = min_p.float()[:, None]
    floor = torch.where(mp > 0, s_max + torch.log(mp.clamp_min(1e-30)), torch.full_like(mp, float("-inf")))
    return out.masked_fill(out < floor, float("-inf"))


def sample_ref(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    """logits (B, V); temperature, top_p, min_p (B,) float; top_k (B,) int; seeds,
    offsets (B,) int64 -> (ids (B,) int64, logprobs (B,) fp32)."""
    lf = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    scaled = lf / t[:, None]
    logp_full = torch.log_softmax(scaled, dim=-1)
    kept = filter_logits_ref(scaled, top_k, top_p, min_p)
    u = uniform_from_keys(row_keys(seeds, offsets), lf.shape[1])
    gumbel = -torch.log(-torch.log(u))
    ids = torch.where(greedy, scaled.argmax(-1), (kept + gumbel).argmax(-1))
    return ids, logp_full.gather(1, ids[:, None]).squeeze(1)


_HAS_TRITON = False


def sample(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    if resolve_backend("sample", logits, has_triton=_HAS_TRITON) == "triton":
        raise NotImplementedError
    return sample_ref(logits, temperature, top_k, top_p, min_p, seeds, offsets)
