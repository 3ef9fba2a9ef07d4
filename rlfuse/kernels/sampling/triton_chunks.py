"""Per-chunk statistics and the histogram cutoff: stages 1-2 of sampling (read the module
notes of `rlfuse.kernels.sampling.draw`), split out of `rlfuse.kernels.sampling.triton_draw`
for length. Triton helpers only, called from its kernels; the tuning constants stay there
and arrive here as arguments.
"""

import triton
import triton.language as tl

from rlfuse.kernels.sampling.triton_threshold import _gumbel


@triton.jit
def _scan_chunk_scaled(row, lo, V, t, key, CHUNK: tl.constexpr, BLOCK: tl.constexpr, NOISE: tl.constexpr):
    """-> (max s, sum exp(s - max), max v, first index of max v) over one chunk,
    v = s + g (NOISE) or s. Per-lane accumulators, one reduction at the end."""
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    z = tl.zeros((BLOCK,), tl.float32)
    bv = tl.full((BLOCK,), float("-inf"), tl.float32)
    bi = tl.zeros((BLOCK,), tl.int32) + lo
    for off in range(lo, tl.minimum(lo + CHUNK, V), BLOCK):
        idx = off + tl.arange(0, BLOCK)
        msk = idx < V
        s = tl.math.div_rn(tl.load(row + idx, mask=msk, other=float("-inf")).to(tl.float32), t)
        # online sum, one exp: z <- s > m ? z e^(m-s) + 1 : z + e^(s-m)  (0 if both -inf)
        big = tl.maximum(m, s)
        e = tl.exp(tl.minimum(m, s) - tl.where(big == float("-inf"), 0.0, big))
        z = tl.where(s > m, z * e + 1.0, z + e)
        m = big
        v = s
        if NOISE:
            v = tl.where(msk, s + _gumbel(key, idx), float("-inf"))
        upd = v > bv  # strict: a lane keeps its first (smallest) index among equals
        bv = tl.where(upd, v, bv)
        bi = tl.where(upd, idx, bi)
    mc = tl.max(m, axis=0)
    zc = tl.sum(z * tl.exp(m - tl.where(mc == float("-inf"), 0.0, mc)), axis=0)
    vc = tl.max(bv, axis=0)
    return mc, zc, vc, tl.min(tl.where(bv == vc, bi, V), axis=0)


@triton.jit
def _scan_chunk_raw(row, lo, V, kl, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Filtered rows: -> (max x, sum 2^((x - max x) kl)) over one chunk of raw logits x,
    kl = log2(e) / T: the sum of exp(s - max s) up to rounding, with no division per
    element (max s = max x / T exactly: x -> rnd(x / T) is monotone)."""
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    z = tl.zeros((BLOCK,), tl.float32)
    for off in range(lo, tl.minimum(lo + CHUNK, V), BLOCK):
        idx = off + tl.arange(0, BLOCK)
        x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        big = tl.maximum(m, x)
        e = tl.exp2((tl.minimum(m, x) - tl.where(big == float("-inf"), 0.0, big)) * kl)
        z = tl.where(x > m, z * e + 1.0, z + e)
        m = big
    mc = tl.max(m, axis=0)
    return mc, tl.sum(z * tl.exp2((m - tl.where(mc == float("-inf"), 0.0, mc)) * kl), axis=0)


@triton.jit
def _merge_chunk_stats(b, S, MAX_part, SUM_part, S_BLOCK: tl.constexpr):
    """-> (m, Z, per-chunk maxima (S_BLOCK,)) of row b (the cutoff and the draw kernels
    both call this: the same m bitwise)."""
    cs = tl.arange(0, S_BLOCK)
    mp = tl.load(MAX_part + b * S + cs, mask=cs < S, other=float("-inf"))
    m = tl.max(mp, axis=0)
    z = tl.sum(tl.load(SUM_part + b * S + cs, mask=cs < S, other=0.0) *
               tl.exp(mp - tl.where(m == float("-inf"), 0.0, m)), axis=0)
    return m, z, mp


@triton.jit
def _histogram_cutoff(b, S, V, m, z, xp, kw, HIST_part, k, use_k, top_p, use_p, min_p, use_f,
                CHUNK: tl.constexpr, S_BLOCK: tl.constexpr, N_BINS: tl.constexpr, BINS_PER_NAT: tl.constexpr):
    """Stage 2: the cutoff c on the grid of floor(x kw) (an integer A - jc, or -inf) from the
    merged histogram, and the count of floor(x kw) >= c in each chunk (S_BLOCK,), read off
    the chunk histograms (exact: the grid is absolute, so chunk bins shift by integers).
    Bin j holds x kw in [A - j, A - j + 1), i.e. s = x / T in about [(A - j) W, (A - j + 1) W),
    W = 1 / BINS_PER_NAT; those s-edges only steer the estimates below, which stage 4 checks
    exactly."""
    a_top = tl.floor(tl.max(xp, axis=0) * kw)
    cs = tl.arange(0, S_BLOCK)
    j = tl.arange(0, N_BINS)
    # chunk histograms shifted onto the row's grid: merged bin j = chunk bin j - shift
    shift = a_top - tl.floor(xp * kw)  # >= 0, or inf/nan for an all -inf chunk
    src = j[None, :] - tl.where(shift < N_BINS, shift, N_BINS).to(tl.int32)[:, None]  # (S_BLOCK, N_BINS)
    h_sj = tl.load(HIST_part + (b * S + cs).to(tl.int64)[:, None] * N_BINS + src,
                   mask=(cs < S)[:, None] & (src >= 0) & (src < N_BINS - 1), other=0)
    inner = j < N_BINS - 1
    hist = tl.sum(h_sj, axis=0)  # integer sums: exact; merged bin N_BINS - 1 is not used
    hist = tl.where(inner, hist, 0)
    edge = (a_top - j.to(tl.float32)) * (1.0 / BINS_PER_NAT)  # about the lower s-edge of bin j
    # top-k: the highest edge with count(x kw >= edge) >= k (exact counts)
    j_k = tl.min(tl.where(inner & (tl.cumsum(hist, axis=0) >= k), j, N_BINS), axis=0)
    # top-p: a lower bound of the mass at or above each bin's lower edge, the larger of
    #   L_j = sum_{i <= j} n_i e^(edge_i - m)       (every value in bin i is >= edge_i)
    #   Z - U_j, U_j = sum_{i > j} n_i e^(edge_i + W - m) + rest e^(edge_{N_BINS-2} - m)
    # (U_j bounds the mass below the edge; rest = elements in no inner bin). L alone loses up
    # to e^-W a bin, so with W = 1/2 it never reaches 0.9 Z and every top-p row would take
    # the whole-row path. The first bin reaching top_p Z, one bin lower.
    wl = hist.to(tl.float32) * tl.exp(edge - m)
    low = tl.cumsum(wl, axis=0)
    wu = wl * 2.718281828459045 ** (1.0 / BINS_PER_NAT)
    n_rest = V - tl.sum(hist, axis=0)
    rest = n_rest.to(tl.float32) * tl.exp((a_top - (N_BINS - 2)) * (1.0 / BINS_PER_NAT) - m)
    est = tl.maximum(low, z - (tl.sum(wu, axis=0) - tl.cumsum(wu, axis=0) + rest))
    j_p = tl.min(tl.where(inner & (est >= top_p * z * 1.00001), j, N_BINS), axis=0) + 1
    # min-p: one bin below the edge at or below floor = m + log(min_p) (nan, m = -inf: none)
    floor = m + tl.log(tl.where(use_f, min_p, 1.0))
    f_j = a_top - tl.floor(floor * BINS_PER_NAT) + 1
    j_f = tl.where(f_j < 0, 0, tl.where(f_j < N_BINS - 1, f_j, N_BINS - 1)).to(tl.int32)
    # with top-k and top-p both on only the top-k rule may raise c (Z_k from the candidates)
    either = ~(use_k & use_p)
    jc = tl.minimum(tl.where(use_k, j_k, N_BINS - 1), tl.where(use_p & ~use_k, j_p, N_BINS - 1))
    jc = tl.minimum(jc, tl.where(either & use_f, j_f, N_BINS - 1))
    c = tl.where(jc < N_BINS - 1, a_top - jc, float("-inf"))
    cnt = tl.sum(tl.where(j[None, :] <= jc, h_sj, 0), axis=1)  # (S_BLOCK,)
    every = tl.minimum(V - cs * CHUNK, CHUNK)  # c = -inf: the whole chunk
    cnt = tl.where(jc < N_BINS - 1, cnt, tl.where(cs < S, every, 0))
    return c, floor, either, cnt
