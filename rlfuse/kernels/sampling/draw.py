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
greedy); the engine's rollout log-probs come from `rlfuse.kernels.loss.logprob` instead, the
function the trainer shares.

Triton path (`sample_triton`; no host syncs, CUDA-graph safe; every per-row decision is
a branch inside the kernels). Per row, s_v = logit_v / T (IEEE division, as the
reference). Each row has a mode: GREEDY (T <= 0), PLAIN (no filter on) or FILTERED
(0 < top_k < V, top_p < 1 or min_p > 0). top_p >= 1 disables top-p exactly (the
reference's fp32 cumsum can still drop tail tokens whose mass-before rounds up to 1: a
~1e-7-probability event). A row is cut into S = ceil(V / CHUNK) chunks, a function of V
only, so no reduction order depends on the batch. Four kernels, in order:

  1. Chunk statistics (`_chunk_stats_kernel`, grid (B, S)). One streaming pass: per-lane
     running max m and z = sum exp(s - m) with one exp per element
     (z <- s > m ? z e^(m-s) + 1 : z + e^(s-m)), and the running argmax of s + g (PLAIN;
     g from the reference's hash) or of s (GREEDY). FILTERED rows work on the raw logits
     x instead, so that no element is divided by T (the divisions dominate this pass
     otherwise): max x, then max s = rnd(max x / T) exactly (x -> rnd(x / T) is
     monotone), and z = sum 2^((x - max x) log2(e) / T), equal to the s-space sum up to
     rounding (the reference's own sum rounds differently anyway). They also build a
     histogram of floor(x kw), kw = rnd(BINS_PER_NAT / T), relative to the chunk's top
     bin. The grid is absolute (the same products x kw in every kernel), so chunk
     histograms merge by an integer shift. A bin is about 1 / BINS_PER_NAT nats of s wide.
  2. Cutoff (`_cutoff_kernel`, grid (B,), FILTERED rows). Merges m, Z and the chunk
     histograms (bin j: x kw in [A - j, A - j + 1), A = floor(max x kw)) into a cutoff
     c = A - jc or -inf on that grid: top-k: the highest edge with count(x kw >= c) >= k
     (exact counts); top-p alone: where a lower bound of the mass at or above the edge
     reaches top_p Z, one bin lower; min-p: one bin below the edge at or below its floor
     m + log(min_p). With top-k and top-p both on only the top-k rule may raise c (the
     top-k mass Z_k must then be computable from the candidates). The candidates are
     {x kw >= c} = the bins <= jc, so each chunk's count is read off its own histogram,
     exactly: their exclusive prefix sum says where each chunk's candidates start in the
     row's list (no atomics, no second counting pass).
  3. Compaction (`_compact_kernel`, grid (B, S), FILTERED rows). Each chunk writes its
     indices with x kw >= c (and their s, the only divisions) in index order at its
     offset into a (B, max_candidates) scratch (nothing when the row's total exceeds
     it), with its exact count, mass sum exp(s - m), and the largest x left out. A count
     that differs from the histogram's (only NaN logits) marks the row's list unusable.
  4. Threshold and draw (`_threshold_draw_kernel`, grid (B,)). Merges the chunk
     statistics (m, Z, id: max value, smallest index among equals). For FILTERED rows:
     a. s_out = rnd(largest x left out / T): the candidates hold every s > s_out. Their
        exact counts and mass (summed over chunks in order) must satisfy the rule that
        set c;
     b. thr = max tau with P(tau), where
            P(tau) = [#(s >= tau) >= k] or [sum_{s >= tau} e^(s-m) >= top_p Z_k] or [tau <= floor]
        (each clause only when its filter is on). P is monotone and P(tau) <=>
        tau <= max(kth, p_thresh, floor), so the reference keeps exactly {s >= thr}:
        top-p keeps v iff the mass strictly above v is < top_p, i.e. the largest value
        below tau is dropped iff the mass at or above tau reaches top_p. Over the
        candidates P equals P over the row for tau > s_out, so their thr is the row's iff
        it is > s_out (a token just below c can share the k-th token's s after rounding:
        then thr <= s_out). How thr is found:
          - up to `all_pairs_max` candidates: P at every candidate value at once, in
            all-pairs tiles (`_all_pairs_threshold_draw`);
          - more: a bisection on the order-preserving integer key of fp32 values, several
            probes a sweep, over the candidates' stored s (`_bisect_threshold_draw`; kth
            first when top-k and top-p are both on, for Z_k);
          - over `max_candidates` candidates, an unconfirmed rule, an unusable list or
            thr <= s_out: the same bisection streams the whole row in s (exact, slow:
            one program a row);
     c. Gumbel-max over the candidates with s >= thr.

Tuning constants below are set by `benchmarks/kernels/bench_sampling.py` on an H100
(their measurements: docs/perf-log.md). Tests: `python -m pytest -q
tests/test_kernel_sampling.py`; on a GPU also `python -m pytest -m gpu tests`.
"""

from __future__ import annotations

import torch

from rlfuse.kernels.backend import resolve_backend, triton_ops

_MASK32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (lowbias32 family) on int64 tensors holding uint32 values.
    Multipliers are < 2**31 so int64 products never overflow; Triton computes the same
    function in uint32 arithmetic."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x6A09E667) & _MASK32
    x = x ^ (x >> 16)
    return x


def row_keys(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(B,) int64 keys from per-row seeds and offsets (both int64 >= 0)."""
    s = seeds.long()
    h = hash32(s & _MASK32)
    h = hash32(h ^ ((s >> 32) & _MASK32))
    return hash32(h ^ (offsets.long() & _MASK32))


def uniform_from_keys(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, V) fp32 uniforms in (0, 1): 23 random bits, centred, so never 0 or 1.
    23, not 24: bits + 0.5 must be exact in fp32 (24-bit significand); with 24 bits the top
    value 2^24 - 0.5 rounds to 2^24, u = 1.0 and the Gumbel noise becomes +inf."""
    v = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    return bits_to_uniform(hash32(keys[:, None] ^ v[None, :]))


def bits_to_uniform(x: torch.Tensor) -> torch.Tensor:
    """32-bit hash values (int64 holding uint32) -> fp32 in (0, 1), as the kernel maps them."""
    return ((x >> 9).float() + 0.5) * (1.0 / 8388608.0)


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


def sample(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    """Public op: `sample_triton` or `sample_ref` by the kernel backend (`rlfuse.kernels.backend`)."""
    if resolve_backend("sample", logits) == "triton":
        return triton_ops("sampling.triton_draw").sample_triton(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    return sample_ref(logits, temperature, top_k, top_p, min_p, seeds, offsets)
