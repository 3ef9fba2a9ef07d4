"""A filtered row's candidate list, threshold and draw: stages 3 and 4b-4c of sampling (read
the module notes of `rlfuse.kernels.sampling`), split out of `rlfuse.kernels.triton.sampling`
for length. Triton helpers only, called from its `_threshold_draw_kernel`; the Gumbel noise
is also used by its first pass.
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
def _value(key):
    """fp32 value of an order-preserving key (fp32 bits, negatives flipped, in int64)."""
    return tl.where(key >= 2147483648, key - 2147483648, -1 - key).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _probe_keys(lo, hi, sweep, N_PROBES: tl.constexpr, VALUE_SWEEPS: tl.constexpr):
    """(N_PROBES,) probe keys inside (lo, hi) and their values tau. Probes split (lo, hi)
    evenly in key space, except the first VALUE_SWEEPS sweeps, which split the values: keys
    crowd near 0 (a [-10, 0] range is ~97% keys of [-1, 0]), so key-space probes spend
    sweeps there. Any probes inside (lo, hi) keep the bisection exact."""
    pr = tl.arange(0, N_PROBES).to(tl.int64)
    probe = lo + ((hi - lo) * (pr + 1)) // (N_PROBES + 1)  # (N_PROBES,) keys
    if sweep < VALUE_SWEEPS:
        v_lo = _value(lo)
        v_hi = _value(hi)
        tv = v_lo + (v_hi - v_lo) * ((pr + 1).to(tl.float32) / (N_PROBES + 1))
        tb = tv.to(tl.int32, bitcast=True).to(tl.int64)
        kv = tl.minimum(tl.maximum(tl.where(tb >= 0, tb + 2147483648, -1 - tb), lo + 1), hi - 1)
        # -inf or nan ends (a whole-row search from -inf): keep the key-space probes
        # (tl.where, not `scalar & vector`: the interpreter cannot broadcast the bool)
        probe = tl.where(tl.where(tl.abs(v_hi - v_lo) < float("inf"), tv == tv, False), kv, probe)
    return probe, _value(probe)


@triton.jit
def _narrow(lo, hi, probe, tau, cnt, mass, k, use_k, p_mass, use_p, floor, use_f):
    """The bracket after one sweep: the largest probe with P true, the smallest with P false."""
    # tl.where, not `scalar & vector`: Triton's interpreter cannot broadcast the bool
    ok = tl.where(use_k, cnt >= k, False) | tl.where(use_p, mass >= p_mass, False) | \
        tl.where(use_f, tau <= floor, False)
    return tl.max(tl.where(ok, probe, lo), axis=0), tl.min(tl.where(ok, hi, probe), axis=0)


@triton.jit
def _bisect(row, cand_row, cand_s_row, n, t, c, m, lo, hi, k, use_k, p_mass, use_p, floor, use_f,
            FULL: tl.constexpr, CAND_BLOCK: tl.constexpr, N_PROBES: tl.constexpr,
            VALUE_SWEEPS: tl.constexpr):
    """Largest key in [lo, hi) with P true; P(lo) assumed true, P(hi) false. Keys are
    fp32 bit patterns made order-preserving (negatives flipped), in int64 (`_probe_keys`)."""
    sweep = 0
    while hi - lo > 1:
        probe, tau = _probe_keys(lo, hi, sweep, N_PROBES, VALUE_SWEEPS)
        sweep += 1
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
        lo, hi = _narrow(lo, hi, probe, tau, cnt, mass, k, use_k, p_mass, use_p, floor, use_f)
    return lo


@triton.jit
def _shrinking_bisect_draw(cand_row, cand_s_row, n, m, key, lo, hi, k, use_k, p_mass, use_p, floor, use_f,
                           CAND_BLOCK: tl.constexpr, N_PROBES: tl.constexpr, VALUE_SWEEPS: tl.constexpr):
    """`_bisect` over the candidate list, shrinking it in place as the bracket narrows, then the
    Gumbel-max draw -> (id, threshold key). Each sweep reads the active list once, against
    the bracket [lo, hi) of the sweep before: s >= value(hi - 1) is at or above every later
    probe and kept (its count and mass join a base, its Gumbel score the running best);
    s < value(lo) is below every later probe and the threshold (dropped); the rest is
    counted against the probes and compacted to the front. The list then shrinks ~N_PROBES
    + 1 fold a sweep, so the sweeps read ~1.1 lists in all instead of one each. Float
    compares throughout, as the probes and the reference's {s >= thr}. Destroys the list."""
    base_cnt = tl.full((), 0, tl.int32)
    base_mass = tl.full((), 0.0, tl.float32)
    best_v = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int32)
    n_act = n
    sweep = 0
    while hi - lo > 1:
        probe, tau = _probe_keys(lo, hi, sweep, N_PROBES, VALUE_SWEEPS)
        sweep += 1
        v_lo = _value(lo)
        v_up = _value(hi - 1)
        cnt = tl.zeros((N_PROBES,), tl.int32)
        mass = tl.zeros((N_PROBES,), tl.float32)
        n_new = tl.full((), 0, tl.int32)
        for j0 in range(0, n_act, CAND_BLOCK):
            j = j0 + tl.arange(0, CAND_BLOCK)
            valid = j < n_act
            idx = tl.load(cand_row + j, mask=valid, other=0)
            s = tl.load(cand_s_row + j, mask=valid, other=float("-inf"))
            up = valid & (s >= v_up)
            stay = valid & (s >= v_lo) & ~up
            e = tl.exp(s - m)
            base_cnt += tl.sum(up.to(tl.int32), axis=0)
            base_mass += tl.sum(tl.where(up, e, 0.0), axis=0)
            v = tl.where(up, s + _gumbel(key, idx), float("-inf"))
            bv = tl.max(v, axis=0)
            bi = tl.min(tl.where(v == bv, idx, 2147483647), axis=0)
            upd = (bv > best_v) | ((bv == best_v) & (bi < best_i))
            best_i = tl.where(upd, bi, best_i)
            best_v = tl.where(upd, bv, best_v)
            ge = (s[:, None] >= tau[None, :]) & stay[:, None]
            cnt += tl.sum(ge.to(tl.int32), axis=0)
            mass += tl.sum(tl.where(ge, e[:, None], 0.0), axis=0)
            tl.debug_barrier()  # every thread has loaded this block before any store into it
            si = stay.to(tl.int32)
            pos = n_new + tl.cumsum(si, axis=0) - 1
            tl.store(cand_row + pos, idx, mask=stay)
            tl.store(cand_s_row + pos, s, mask=stay)
            n_new += tl.sum(si, axis=0)
        tl.debug_barrier()  # the compacted list is complete before the next sweep reads it
        n_act = n_new
        lo, hi = _narrow(lo, hi, probe, tau, cnt + base_cnt, mass + base_mass, k, use_k, p_mass, use_p,
                         floor, use_f)
    thr = _value(lo)
    for j0 in range(0, n_act, CAND_BLOCK):
        j = j0 + tl.arange(0, CAND_BLOCK)
        valid = j < n_act
        idx = tl.load(cand_row + j, mask=valid, other=0)
        s = tl.load(cand_s_row + j, mask=valid, other=float("-inf"))
        v = tl.where(valid & (s >= thr), s + _gumbel(key, idx), float("-inf"))
        bv = tl.max(v, axis=0)
        bi = tl.min(tl.where(v == bv, idx, 2147483647), axis=0)
        upd = (bv > best_v) | ((bv == best_v) & (bi < best_i))
        best_i = tl.where(upd, bi, best_i)
        best_v = tl.where(upd, bv, best_v)
    return best_i, lo


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
        kth = _value(lo)
        acc = tl.zeros((CAND_BLOCK,), tl.float32)
        for j0 in range(0, n, CAND_BLOCK):
            j = j0 + tl.arange(0, CAND_BLOCK)
            valid = j < n
            idx, s = _load_candidates(row, cand_row, cand_s_row, j, valid, t, FULL)
            acc += tl.where(valid & (s >= c) & (s >= kth), tl.exp(s - m), 0.0)
        zk = tl.sum(acc, axis=0)
    if FULL:
        tk = _bisect(row, cand_row, cand_s_row, n, t, c, m, lo, hi, k, use_k, top_p * zk, use_p, floor, use_f,
                     FULL, CAND_BLOCK, N_PROBES, VALUE_SWEEPS)
        thr = _value(tk)
        best_v = tl.full((), float("-inf"), tl.float32)
        best_i = tl.full((), 0, tl.int32)
        for j0 in range(0, n, CAND_BLOCK):
            j = j0 + tl.arange(0, CAND_BLOCK)
            valid = j < n
            idx, s = _load_candidates(row, cand_row, cand_s_row, j, valid, t, FULL)
            v = tl.where(valid & (s >= c) & (s >= thr), s + _gumbel(key, idx), float("-inf"))
            bv = tl.max(v, axis=0)
            bi = tl.min(tl.where(v == bv, idx, 2147483647), axis=0)
            upd = (bv > best_v) | ((bv == best_v) & (bi < best_i))  # ties: the smaller index
            best_i = tl.where(upd, bi, best_i)
            best_v = tl.where(upd, bv, best_v)
    else:
        best_i, tk = _shrinking_bisect_draw(cand_row, cand_s_row, n, m, key, lo, hi, k, use_k, top_p * zk, use_p,
                                            floor, use_f, CAND_BLOCK, N_PROBES, VALUE_SWEEPS)
        thr = _value(tk)
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


@triton.jit
def _gather_candidates(row, b, S, V, t, kw, c, m, cnt, xp, SLOT_IDX, SLOT_X, SLOT_CUT, SLOT_N, SLOT_XOUT,
                       cand_row, cand_s_row, CHUNK: tl.constexpr, SLOTS: tl.constexpr, S_BLOCK: tl.constexpr,
                       MAX_CAND: tl.constexpr, BLOCK: tl.constexpr):
    """Stage 3: the row's candidates {x kw >= c} into cand_row / cand_s_row (their s, the only
    divisions) -> (count, mass sum exp(s - m), largest x left out, whether the count equals
    the histogram's, chunks streamed). A chunk with candidates (cnt > 0) whose slot cutoff is
    <= c is served by its slot list (which holds every x kw >= its cutoff): all served lists
    are read as one concatenated sequence, BLOCK entries a step whatever the chunk; any other
    chunk with candidates streams its logits (appended after). A chunk without candidates
    contributes its max (xp) to the largest x left out. The order is fixed by the data, so
    the list is deterministic; the draw breaks ties by index, not by list position."""
    cs = tl.arange(0, S_BLOCK)
    cm = cs < S
    has = cm & (cnt > 0)
    served = has & (c >= tl.load(SLOT_CUT + b * S + cs, mask=cm, other=float("inf")))
    ln = tl.where(served, tl.load(SLOT_N + b * S + cs, mask=cm, other=0), 0)
    ends = tl.cumsum(ln, axis=0)  # served list i is entries [ends_i - ln_i, ends_i) of the sequence
    total = tl.sum(ln, axis=0)
    x_left = tl.maximum(tl.max(tl.where(cm & ~has, xp, float("-inf")), axis=0),
                        tl.max(tl.where(served, tl.load(SLOT_XOUT + b * S + cs, mask=cm, other=float("-inf")),
                                        float("-inf")), axis=0))
    n = tl.full((), 0, tl.int32)
    mass = tl.zeros((BLOCK,), tl.float32)
    x_out = tl.full((BLOCK,), float("-inf"), tl.float32)
    for p0 in range(0, total, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        valid = p < total
        ch = tl.zeros((BLOCK,), tl.int32)     # the chunk of entry p: how many lists end at or before p
        start = tl.zeros((BLOCK,), tl.int32)  # where that chunk's list starts: the last such end
        for i in range(0, S):
            e_i = tl.sum(tl.where(cs == i, ends, 0), axis=0)
            passed = e_i <= p
            ch += passed.to(tl.int32)
            start = tl.where(passed, e_i, start)
        src = (b * S + tl.minimum(ch, S - 1)).to(tl.int64) * SLOTS + (p - start)
        x = tl.load(SLOT_X + src, mask=valid, other=float("-inf"))
        idx = tl.load(SLOT_IDX + src, mask=valid, other=0)
        keep = valid & (x * kw >= c)
        x_out = tl.maximum(x_out, tl.where(valid & ~keep, x, float("-inf")))
        ki = keep.to(tl.int32)
        s = tl.math.div_rn(x, t)
        pos = n + tl.cumsum(ki, axis=0) - 1
        st = keep & (pos < MAX_CAND)
        tl.store(cand_row + pos, idx, mask=st)
        tl.store(cand_s_row + pos, s, mask=st)
        mass += tl.where(keep, tl.exp(s - m), 0.0)
        n += tl.sum(ki, axis=0)
    streamed = tl.sum((has & ~served).to(tl.int32), axis=0)
    if streamed > 0:
        for ci in range(0, S):
            if tl.sum(tl.where(cs == ci, (has & ~served).to(tl.int32), 0), axis=0) > 0:
                lo = ci * CHUNK
                for off in range(lo, tl.minimum(lo + CHUNK, V), BLOCK):
                    idx = off + tl.arange(0, BLOCK)
                    x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
                    keep = (idx < V) & (x * kw >= c)  # <=> floor(x kw) >= c: the histogram's bins <= jc
                    x_out = tl.maximum(x_out, tl.where(keep, float("-inf"), x))
                    ki = keep.to(tl.int32)
                    nk = tl.sum(ki, axis=0)
                    if nk > 0:  # most blocks hold no candidate: skip the scan and the divisions
                        s = tl.math.div_rn(x, t)
                        pos = n + tl.cumsum(ki, axis=0) - 1
                        st = keep & (pos < MAX_CAND)
                        tl.store(cand_row + pos, idx, mask=st)
                        tl.store(cand_s_row + pos, s, mask=st)
                        mass += tl.where(keep, tl.exp(s - m), 0.0)
                        n += nk
    # a count that differs from the histogram's (NaN logits) marks the list unusable
    good = n == tl.sum(cnt, axis=0)
    return n, tl.sum(mass, axis=0), tl.maximum(tl.max(x_out, axis=0), x_left), good, streamed
