"""Threshold and draw over a filtered row's candidates: stage 4b-4c of sampling (read the
module notes of `rlfuse.kernels.sampling.draw`), split out of `rlfuse.kernels.sampling.triton_draw`
for length. Triton helpers only, called from its `_threshold_draw_kernel`; the Gumbel noise
is also used by the first pass (`triton_chunks`).
"""

import triton
import triton.language as tl


@triton.jit
def _gumbel(key, idx):  # key uint32 scalar, idx int32 -> -log(-log(u)), u as the reference
    x = key ^ idx.to(tl.uint32)
    x = x ^ (x >> 16)  # hash32: uint32 products wrap like the reference's & 0xFFFFFFFF
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x6A09E667
    x = x ^ (x >> 16)
    u = ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # in (0, 1): see uniform_from_keys
    return -tl.log(-tl.log(u))


@triton.jit
def _load_candidates(row, cand_row, cand_s_row, j, valid, t, FULL: tl.constexpr):
    """(index, s) of candidates j: the row itself (FULL) or the compacted list."""
    if FULL:
        return j, tl.math.div_rn(tl.load(row + j, mask=valid, other=float("-inf")).to(tl.float32), t)
    idx = tl.load(cand_row + j, mask=valid, other=0)
    return idx, tl.load(cand_s_row + j, mask=valid, other=float("-inf"))


@triton.jit
def _bisect(row, cand_row, cand_s_row, n, t, c, m, lo, hi, k, use_k, p_mass, use_p, floor, use_f,
            FULL: tl.constexpr, CAND_BLOCK: tl.constexpr, N_PROBES: tl.constexpr,
            VALUE_SWEEPS: tl.constexpr):
    """Largest key in [lo, hi) with P true; P(lo) assumed true, P(hi) false. Keys are
    fp32 bit patterns made order-preserving (negatives flipped), in int64. Probes split
    (lo, hi) evenly in key space, except the first VALUE_SWEEPS sweeps, which split the values: keys
    crowd near 0 (a [-10, 0] range is ~97% keys of [-1, 0]), so key-space probes spend
    sweeps there. Any probes inside (lo, hi) keep the bisection exact."""
    pr = tl.arange(0, N_PROBES).to(tl.int64)
    sweep = 0
    while hi - lo > 1:
        probe = lo + ((hi - lo) * (pr + 1)) // (N_PROBES + 1)  # (N_PROBES,) keys
        if sweep < VALUE_SWEEPS:
            v_lo = tl.where(lo >= 2147483648, lo - 2147483648, -1 - lo).to(tl.int32)
            v_lo = v_lo.to(tl.float32, bitcast=True)
            v_hi = tl.where(hi >= 2147483648, hi - 2147483648, -1 - hi).to(tl.int32)
            v_hi = v_hi.to(tl.float32, bitcast=True)
            tv = v_lo + (v_hi - v_lo) * ((pr + 1).to(tl.float32) / (N_PROBES + 1))
            tb = tv.to(tl.int32, bitcast=True).to(tl.int64)
            kv = tl.minimum(tl.maximum(tl.where(tb >= 0, tb + 2147483648, -1 - tb), lo + 1), hi - 1)
            # -inf or nan ends (a whole-row search from -inf): keep the key-space probes
            # (tl.where, not `scalar & vector`: the interpreter cannot broadcast the bool)
            probe = tl.where(tl.where(tl.abs(v_hi - v_lo) < float("inf"), tv == tv, False), kv, probe)
        sweep += 1
        bits = tl.where(probe >= 2147483648, probe - 2147483648, -1 - probe)
        tau = bits.to(tl.int32).to(tl.float32, bitcast=True)
        cnt = tl.zeros((N_PROBES,), tl.int32)
        mass = tl.zeros((N_PROBES,), tl.float32)
        for j0 in range(0, n, CAND_BLOCK):
            j = j0 + tl.arange(0, CAND_BLOCK)
            valid = j < n
            idx, s = _load_candidates(row, cand_row, cand_s_row, j, valid, t, FULL)
            valid = valid & (s >= c)
            e = tl.where(valid, tl.exp(s - m), 0.0)
            ge = (s[:, None] >= tau[None, :]) & valid[:, None]
            cnt += tl.sum(ge.to(tl.int32), axis=0)
            mass += tl.sum(tl.where(ge, e[:, None], 0.0), axis=0)
        # tl.where, not `scalar & vector`: Triton's interpreter cannot broadcast the bool
        ok = tl.where(use_k, cnt >= k, False) | tl.where(use_p, mass >= p_mass, False) | \
            tl.where(use_f, tau <= floor, False)
        lo, hi = tl.max(tl.where(ok, probe, lo), axis=0), tl.min(tl.where(ok, hi, probe), axis=0)
    return lo


@triton.jit
def _bisect_threshold_draw(row, cand_row, cand_s_row, n, t, c, m, z, key, k, use_k, top_p, use_p, floor,
                           use_f, FULL: tl.constexpr, CAND_BLOCK: tl.constexpr, N_PROBES: tl.constexpr,
                           VALUE_SWEEPS: tl.constexpr):
    """Stage 4b-4c by bisection over the candidates cand_row[:n] (FULL: the row's s >= c, n = V) -> id."""
    cb = c.to(tl.int32, bitcast=True).to(tl.int64)
    mb = m.to(tl.int32, bitcast=True).to(tl.int64)
    lo = tl.where(cb >= 0, cb + 2147483648, -1 - cb)
    hi = tl.where(mb >= 0, mb + 2147483648, -1 - mb) + 1
    zk = z
    if use_k & use_p:  # kth first: top-p renormalizes over the top-k set
        lo = _bisect(row, cand_row, cand_s_row, n, t, c, m, lo, hi, k, True, 0.0, False, floor, False,
                     FULL, CAND_BLOCK, N_PROBES, VALUE_SWEEPS)
        kth = tl.where(lo >= 2147483648, lo - 2147483648, -1 - lo).to(tl.int32).to(tl.float32, bitcast=True)
        acc = tl.zeros((CAND_BLOCK,), tl.float32)
        for j0 in range(0, n, CAND_BLOCK):
            j = j0 + tl.arange(0, CAND_BLOCK)
            valid = j < n
            idx, s = _load_candidates(row, cand_row, cand_s_row, j, valid, t, FULL)
            acc += tl.where(valid & (s >= c) & (s >= kth), tl.exp(s - m), 0.0)
        zk = tl.sum(acc, axis=0)
    tk = _bisect(row, cand_row, cand_s_row, n, t, c, m, lo, hi, k, use_k, top_p * zk, use_p, floor, use_f,
                 FULL, CAND_BLOCK, N_PROBES, VALUE_SWEEPS)
    thr = tl.where(tk >= 2147483648, tk - 2147483648, -1 - tk).to(tl.int32).to(tl.float32, bitcast=True)
    best_v = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int32)
    for j0 in range(0, n, CAND_BLOCK):
        j = j0 + tl.arange(0, CAND_BLOCK)
        valid = j < n
        idx, s = _load_candidates(row, cand_row, cand_s_row, j, valid, t, FULL)
        v = tl.where(valid & (s >= c) & (s >= thr), s + _gumbel(key, idx), float("-inf"))
        bv = tl.max(v, axis=0)
        bi = tl.min(tl.where(v == bv, idx, 2147483647), axis=0)
        upd = bv > best_v  # strict: the earlier block (smaller index) wins ties
        best_i = tl.where(upd, bi, best_i)
        best_v = tl.where(upd, bv, best_v)
    return best_i, thr


@triton.jit
def _all_pairs_threshold_draw(cand_row, cand_s_row, n, c, m, z, key, k, use_k, top_p, use_p, floor, use_f,
                              PAIRS_MAX: tl.constexpr, PAIRS_STEP: tl.constexpr):
    """Stage 4b-4c when the n <= PAIRS_MAX candidates fit one tile: P is evaluated at every
    candidate value (PAIRS_STEP values tau at a time against all candidates: a
    PAIRS_STEP x PAIRS_MAX compare),
    thr = the largest value with P true (or the min-p floor when higher). kth, p_thresh
    are candidate values; floor is not. No sequential sweeps, unlike the bisection."""
    j = tl.arange(0, PAIRS_MAX)
    valid = j < n
    s = tl.load(cand_s_row + j, mask=valid, other=float("-inf"))
    e = tl.where(valid, tl.exp(s - m), 0.0)
    zk = z
    if use_k & use_p:  # top-p renormalizes over the top-k set: kth first
        kth = tl.full((), float("-inf"), tl.float32)
        for i0 in range(0, n, PAIRS_STEP):
            i = i0 + tl.arange(0, PAIRS_STEP)
            si = tl.load(cand_s_row + i, mask=i < n, other=float("-inf"))
            cnt = tl.sum(((s[None, :] >= si[:, None]) & valid[None, :]).to(tl.int32), axis=1)
            kth = tl.maximum(kth, tl.max(tl.where((i < n) & (cnt >= k), si, float("-inf")), axis=0))
        zk = tl.sum(tl.where(s >= kth, e, 0.0), axis=0)
    best = tl.full((), float("-inf"), tl.float32)
    for i0 in range(0, n, PAIRS_STEP):
        i = i0 + tl.arange(0, PAIRS_STEP)
        si = tl.load(cand_s_row + i, mask=i < n, other=float("-inf"))
        ge = (s[None, :] >= si[:, None]) & valid[None, :]  # row: tau = s_i; column: candidate
        cnt = tl.sum(ge.to(tl.int32), axis=1)
        mass = tl.sum(tl.where(ge, e[None, :], 0.0), axis=1)
        ok = (i < n) & (tl.where(use_k, cnt >= k, False) | tl.where(use_p, mass >= top_p * zk, False))
        best = tl.maximum(best, tl.max(tl.where(ok, si, float("-inf")), axis=0))
    thr = tl.maximum(tl.maximum(best, c), tl.where(use_f, floor, float("-inf")))
    idx = tl.load(cand_row + j, mask=valid, other=0)
    v = tl.where(valid & (s >= thr), s + _gumbel(key, idx), float("-inf"))
    bv = tl.max(v, axis=0)
    return tl.min(tl.where(v == bv, idx, 2147483647), axis=0), thr
