"""Sampling (temperature, top-k, top-p, min-p, Gumbel-max draw with per-row keys), the
Triton kernels: chunk statistics, the cutoff, candidate compaction and the threshold and
draw (the contract, the stages and the rounding rules are in `rlfuse.kernels.sampling.draw`'s
docstring)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rlfuse.kernels.sampling.triton_chunks import (
    _histogram_cutoff,
    _merge_chunk_stats,
    _scan_chunk_raw,
    _scan_chunk_scaled,
)
from rlfuse.kernels.sampling.triton_threshold import _all_pairs_threshold_draw, _bisect_threshold_draw

# Tuning constants (H100, bench_sampling.py; the sweeps that chose them: docs/perf-log.md).
_BINS_PER_NAT = 2.0     # histogram resolution: the grid is floor(x rnd(BINS_PER_NAT / T))
_HIST_BINS = 64         # histogram bins a chunk: ~31.5 nats below its max, then one rest bin
_BISECT_PROBES = 8      # thresholds probed per bisection sweep
_CHUNK = 16384          # elements per chunk program (V = 151936: 10 chunks a row)
_SCAN_BLOCK = 2048      # elements per step in the streaming loops
_HIST_BLOCK = 8192      # elements per step in the chunk histogram loop
_BISECT_BLOCK = 1024    # candidates per step in the bisection
_VALUE_SPLIT_SWEEPS = 2  # first bisection sweeps that split values, not keys (see _bisect)
_COMPACT_BLOCK = {4: 256, 2: 128}  # compaction step by logit bytes: small CTAs, many per SM
_COMPACT_WARPS = 1      # warps a compaction program
_DRAW_WARPS = 8         # warps a threshold-and-draw program
_MAX_CANDIDATES = 16384  # candidates kept in scratch per row; more: the whole-row path
_ALL_PAIRS_MAX = 128    # up to this many candidates: all-pairs threshold instead of bisection
_ALL_PAIRS_STEP = 16    # thresholds tested per all-pairs tile (a STEP x MAX compare)
_MAX_CHUNKS = 64        # chunks a row at most: the cutoff holds every chunk histogram in one
                        # (S, HIST_BINS) tile (a bound on the `chunk` knob, not a tuned value)

# Row modes (module notes); Triton reads module globals only as constexpr.
_GREEDY = tl.constexpr(0)
_PLAIN = tl.constexpr(1)
_FILTERED = tl.constexpr(2)


# Interpreter note: Triton's interpreter re-patches the language on every call of a
# @triton.jit helper (~1 ms each), so the per-element helpers are written inline below.

@triton.jit
def _row_params(b, V, T_ptr, K_ptr, P_ptr, MP_ptr, SEED_ptr, OFF_ptr):
    temp = tl.load(T_ptr + b).to(tl.float32)
    greedy = temp <= 0
    t = tl.where(greedy, 1.0, temp)
    k = tl.load(K_ptr + b).to(tl.int32)
    top_p = tl.load(P_ptr + b).to(tl.float32)
    min_p = tl.load(MP_ptr + b).to(tl.float32)
    use_k = (k > 0) & (k < V)
    use_p = top_p < 1.0
    use_f = min_p > 0.0
    mode = tl.where(greedy, _GREEDY, tl.where(use_k | use_p | use_f, _FILTERED, _PLAIN))
    # row_keys: hash32(hash32(hash32(seed_lo) ^ seed_hi) ^ offset_lo)
    seed = tl.load(SEED_ptr + b).to(tl.int64)
    key = seed.to(tl.uint32)  # truncation = & 0xFFFFFFFF
    for r in tl.static_range(3):
        key = key ^ (key >> 16)
        key = key * 0x7FEB352D
        key = key ^ (key >> 15)
        key = key * 0x6A09E667
        key = key ^ (key >> 16)
        if r == 0:
            key = key ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        if r == 1:
            key = key ^ tl.load(OFF_ptr + b).to(tl.int64).to(tl.uint32)
    return mode, t, k, top_p, min_p, use_k, use_p, use_f, key


@triton.jit
def _chunk_stats_kernel(L_ptr, stride_l, T_ptr, K_ptr, P_ptr, MP_ptr, SEED_ptr, OFF_ptr,
                        MAX_part, SUM_part, BEST_part, ARG_part, HIST_part, V, S,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, HIST_BLOCK: tl.constexpr,
                        N_BINS: tl.constexpr, BINS_PER_NAT: tl.constexpr):
    """Stage 1 for chunk c of row b: its max, sum and best score (module notes)."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    mode, t, k, top_p, min_p, use_k, use_p, use_f, key = _row_params(
        b, V, T_ptr, K_ptr, P_ptr, MP_ptr, SEED_ptr, OFF_ptr)
    row = L_ptr + b.to(tl.int64) * stride_l
    lo = c * CHUNK
    po = b * S + c
    if mode == _FILTERED:  # max and sum in raw-logit units; BEST_part holds the max x
        xc, zc = _scan_chunk_raw(row, lo, V, tl.math.div_rn(1.4426950408889634, t), CHUNK, BLOCK)
        tl.store(MAX_part + po, tl.math.div_rn(xc, t))
        tl.store(SUM_part + po, zc)
        tl.store(BEST_part + po, xc)
        tl.store(ARG_part + po, lo)
        # chunk histogram of floor(x kw), kw = BINS_PER_NAT / T, on its absolute grid (module notes)
        kw = tl.math.div_rn(BINS_PER_NAT, t)
        a_top = tl.floor(xc * kw)
        hist = tl.zeros((N_BINS,), tl.int32)
        for off in range(lo, tl.minimum(lo + CHUNK, V), HIST_BLOCK):
            idx = off + tl.arange(0, HIST_BLOCK)
            d = a_top - tl.floor(tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * kw)
            hist += tl.histogram(tl.where(d < N_BINS - 1, d, N_BINS - 1).to(tl.int32), N_BINS)
        tl.store(HIST_part + po.to(tl.int64) * N_BINS + tl.arange(0, N_BINS), hist)
    else:
        if mode == _PLAIN:
            mc, zc, vc, ic = _scan_chunk_scaled(row, lo, V, t, key, CHUNK, BLOCK, True)
        else:
            mc, zc, vc, ic = _scan_chunk_scaled(row, lo, V, t, key, CHUNK, BLOCK, False)
        tl.store(MAX_part + po, mc)
        tl.store(SUM_part + po, zc)
        tl.store(BEST_part + po, vc)
        tl.store(ARG_part + po, ic)


@triton.jit
def _cutoff_kernel(T_ptr, K_ptr, P_ptr, MP_ptr, SEED_ptr, OFF_ptr, MAX_part, SUM_part, BEST_part, HIST_part,
                   CUT_ptr, OFS_ptr, V, S, CHUNK: tl.constexpr, S_BLOCK: tl.constexpr,
                   N_BINS: tl.constexpr, BINS_PER_NAT: tl.constexpr):
    """Stage 2 (cutoff) for a filtered row b: CUT[b] = (c, m); OFS[b, :S + 1] = where each chunk's
    candidates start in the row's list (exclusive prefix of the counts; OFS[b, S] = n)."""
    b = tl.program_id(0)
    mode, t, k, top_p, min_p, use_k, use_p, use_f, key = _row_params(
        b, V, T_ptr, K_ptr, P_ptr, MP_ptr, SEED_ptr, OFF_ptr)
    if mode == _FILTERED:
        m, z, mp = _merge_chunk_stats(b, S, MAX_part, SUM_part, S_BLOCK)
        cs = tl.arange(0, S_BLOCK)
        xp = tl.load(BEST_part + b * S + cs, mask=cs < S, other=float("-inf"))  # chunk max x
        kw = tl.math.div_rn(BINS_PER_NAT, t)
        c, floor, either, cnt = _histogram_cutoff(b, S, V, m, z, xp, kw, HIST_part, k, use_k, top_p, use_p,
                                                  min_p, use_f, CHUNK, S_BLOCK, N_BINS, BINS_PER_NAT)
        tl.store(CUT_ptr + 2 * b, c)
        tl.store(CUT_ptr + 2 * b + 1, m)
        tl.store(OFS_ptr + b * (S + 1) + cs, tl.cumsum(cnt, axis=0) - cnt, mask=cs < S)
        tl.store(OFS_ptr + b * (S + 1) + S, tl.sum(cnt, axis=0))


@triton.jit
def _compact_kernel(L_ptr, stride_l, T_ptr, K_ptr, P_ptr, MP_ptr, SEED_ptr, OFF_ptr,
                    CUT_ptr, OFS_ptr, COUNT_part, MASS_part, XOUT_part, CAND_ptr, CAND_S_ptr, V, S,
                    CHUNK: tl.constexpr, MAX_CAND: tl.constexpr, BLOCK: tl.constexpr,
                    BINS_PER_NAT: tl.constexpr):
    """Stage 3 (compaction) for chunk ci of a filtered row b (other rows: nothing to do)."""
    b = tl.program_id(0)
    ci = tl.program_id(1)
    mode, t, k, top_p, min_p, use_k, use_p, use_f, key = _row_params(
        b, V, T_ptr, K_ptr, P_ptr, MP_ptr, SEED_ptr, OFF_ptr)
    if mode == _FILTERED:
        c = tl.load(CUT_ptr + 2 * b)
        m = tl.load(CUT_ptr + 2 * b + 1)
        kw = tl.math.div_rn(BINS_PER_NAT, t)  # bitwise the chunk-stats kernel's: the same products x kw
        start = tl.load(OFS_ptr + b * (S + 1) + ci)
        own = tl.load(OFS_ptr + b * (S + 1) + ci + 1) - start
        # over MAX_CAND candidates the draw kernel streams the row: no list needed (a limit,
        # not `scalar & vector`: the interpreter cannot broadcast a scalar bool)
        limit = tl.where(tl.load(OFS_ptr + b * (S + 1) + S) <= MAX_CAND, MAX_CAND, 0)
        row = L_ptr + b.to(tl.int64) * stride_l
        cand_row = CAND_ptr + b.to(tl.int64) * MAX_CAND
        cand_s_row = CAND_S_ptr + b.to(tl.int64) * MAX_CAND
        lo = ci * CHUNK
        n = tl.full((), 0, tl.int32)
        mass = tl.zeros((BLOCK,), tl.float32)
        x_out = tl.full((BLOCK,), float("-inf"), tl.float32)  # largest x left out, per lane
        for off in range(lo, tl.minimum(lo + CHUNK, V), BLOCK):
            idx = off + tl.arange(0, BLOCK)
            x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            keep = (idx < V) & (x * kw >= c)  # <=> floor(x kw) >= c: the histogram's bins <= jc
            x_out = tl.maximum(x_out, tl.where(keep, float("-inf"), x))
            ki = keep.to(tl.int32)
            nk = tl.sum(ki, axis=0)
            if nk > 0:  # most blocks hold no candidate: skip the scan and the divisions
                s = tl.math.div_rn(x, t)
                pos = start + n + tl.cumsum(ki, axis=0) - 1
                st = keep & (pos < limit)  # also guards a wrong count, which the draw kernel rejects
                tl.store(cand_row + pos, idx, mask=st)
                tl.store(cand_s_row + pos, s, mask=st)
                mass += tl.where(keep, tl.exp(s - m), 0.0)
                n += nk
        # a count that differs from the histogram's (NaN logits) marks the list unusable
        tl.store(COUNT_part + b * S + ci, tl.where(n == own, n, -1))
        tl.store(MASS_part + b * S + ci, tl.sum(mass, axis=0))
        tl.store(XOUT_part + b * S + ci, tl.max(x_out, axis=0))


@triton.jit
def _threshold_draw_kernel(L_ptr, stride_l, T_ptr, K_ptr, P_ptr, MP_ptr, SEED_ptr, OFF_ptr,
                           MAX_part, SUM_part, BEST_part, ARG_part, CUT_ptr, COUNT_part, MASS_part, XOUT_part,
                           CAND_ptr, CAND_S_ptr, IDS_ptr, LP_ptr, THR_ptr, V, S,
                           S_BLOCK: tl.constexpr, MAX_CAND: tl.constexpr, PAIRS_MAX: tl.constexpr,
                           PAIRS_STEP: tl.constexpr, CAND_BLOCK: tl.constexpr, N_PROBES: tl.constexpr,
                           VALUE_SWEEPS: tl.constexpr):
    """Stage 4 for row b: the id, its log-prob and the threshold (module notes)."""
    b = tl.program_id(0)
    mode, t, k, top_p, min_p, use_k, use_p, use_f, key = _row_params(
        b, V, T_ptr, K_ptr, P_ptr, MP_ptr, SEED_ptr, OFF_ptr)
    row = L_ptr + b.to(tl.int64) * stride_l
    # merge the partials (m, Z, id: max value, smallest index among equals)
    m, z, mp = _merge_chunk_stats(b, S, MAX_part, SUM_part, S_BLOCK)
    cs = tl.arange(0, S_BLOCK)
    cm = cs < S
    vp = tl.load(BEST_part + b * S + cs, mask=cm, other=float("-inf"))
    idx = tl.min(tl.where(vp == tl.max(vp, axis=0), tl.load(ARG_part + b * S + cs, mask=cm, other=V), V),
                 axis=0)
    thr = tl.where(mode == _GREEDY, m, float("-inf"))  # greedy: the max; plain: everything
    if mode == _FILTERED:
        c = tl.load(CUT_ptr + 2 * b)  # on the x kw grid; -inf: every element is a candidate
        floor = m + tl.log(tl.where(use_f, min_p, 1.0))  # as in _histogram_cutoff (same m)
        either = ~(use_k & use_p)
        # 4a. exact counts/mass of the candidates; s_out = the largest s left out (x -> rnd(x / T)
        # is monotone, so one division): the candidates hold every s > s_out
        n_s = tl.load(COUNT_part + b * S + cs, mask=cm, other=0)
        n = tl.sum(n_s, axis=0)
        mass_c = tl.sum(tl.load(MASS_part + b * S + cs, mask=cm, other=0.0), axis=0)
        x_out = tl.max(tl.load(XOUT_part + b * S + cs, mask=cm, other=float("-inf")), axis=0)
        s_out = tl.math.div_rn(x_out, t)
        ok = (tl.min(n_s, axis=0) >= 0) & ((c == float("-inf")) | (use_k & (n >= k)) |
              (either & ((use_f & (s_out < floor)) | (use_p & (mass_c >= top_p * z * 1.00001)))))
        listed = ok & (n <= MAX_CAND)
        cand_row = CAND_ptr + b.to(tl.int64) * MAX_CAND
        cand_s_row = CAND_S_ptr + b.to(tl.int64) * MAX_CAND
        # 4b-4c. threshold and Gumbel-max over the candidates; they decide it iff it ends above
        # s_out (then nothing left out is kept), else over the whole row (exact, slow)
        if ok & (n <= PAIRS_MAX):  # (PAIRS_MAX <= MAX_CAND)
            idx, thr = _all_pairs_threshold_draw(cand_row, cand_s_row, n, s_out, m, z, key, k, use_k, top_p,
                                                 use_p, floor, use_f, PAIRS_MAX, PAIRS_STEP)
        elif listed:
            idx, thr = _bisect_threshold_draw(row, cand_row, cand_s_row, n, t, s_out, m, z, key, k, use_k,
                                              top_p, use_p, floor, use_f, False, CAND_BLOCK, N_PROBES,
                                              VALUE_SWEEPS)
        if (~listed) | (thr <= s_out):
            whole_row = tl.full((), float("-inf"), tl.float32)  # cutoff -inf: every s of the row
            idx, thr = _bisect_threshold_draw(row, cand_row, cand_s_row, V, t, whole_row, m, z, key, k, use_k,
                                              top_p, use_p, floor, use_f, True, CAND_BLOCK, N_PROBES,
                                              VALUE_SWEEPS)
    s_id = tl.math.div_rn(tl.load(row + idx).to(tl.float32), t)
    tl.store(IDS_ptr + b, idx.to(tl.int64))
    tl.store(LP_ptr + b, (s_id - m) - tl.log(z))  # as log_softmax: no rounding at m's scale
    tl.store(THR_ptr + b, thr)  # kept set {s >= thr}: for tests and the GPU check


def sample_triton(logits, temperature, top_k, top_p, min_p, seeds, offsets, *,
                  chunk: int = _CHUNK, max_candidates: int = _MAX_CANDIDATES,
                  all_pairs_max: int = _ALL_PAIRS_MAX, return_threshold: bool = False):
    """Same contract as `sample_ref`. `chunk`, `max_candidates` and `all_pairs_max` (powers
    of two) are tuning knobs; tests shrink them to reach the multi-chunk, bisection and over-capacity paths
    at small V. `return_threshold=True` also returns thr (B,) fp32: a filtered row keeps
    exactly {v : logit_v / T >= thr} (a plain row: -inf; a greedy row: its max)."""
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be (B, V), got {tuple(logits.shape)}")
    B, V = logits.shape
    for name, p in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                    ("min_p", min_p), ("seeds", seeds), ("offsets", offsets)):
        if p.shape != (B,) or p.device != logits.device:
            raise ValueError(f"sample: {name} must have shape ({B},) on {logits.device}, got "
                             f"{tuple(p.shape)} on {p.device}")
    S = triton.cdiv(V, chunk)
    if S > _MAX_CHUNKS:
        raise ValueError(f"sample_triton: chunk={chunk} splits V={V} into {S} chunks, at most {_MAX_CHUNKS}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    # block sizes follow V (and the knobs) only, never B: batch invariance
    block_v = triton.next_power_of_2(V)
    block = min(_SCAN_BLOCK, chunk, block_v)
    block_c = min(_BISECT_BLOCK, block_v)
    # scratch: one allocation carved into 16-byte aligned views (eager calls pay ~5 us per
    # torch.empty; Triton specializes on 16-byte alignment). Per row: chunk statistics
    # (stage 1), cutoff and candidate offsets (stage 2), candidate lists (stage 3).
    f32, i32 = torch.float32, torch.int32
    scratch = {  # name: (shape, dtype)
        "chunk_max": ((B, S), f32),       # max s of each chunk
        "chunk_sum": ((B, S), f32),       # sum exp(s - chunk max)
        "chunk_best": ((B, S), f32),      # best score (s + g or s), or max x on filtered rows
        "chunk_mass": ((B, S), f32),      # candidates' sum exp(s - m)
        "chunk_x_out": ((B, S), f32),     # largest x left out of the candidates
        "chunk_arg": ((B, S), i32),       # index of the best score
        "chunk_count": ((B, S), i32),     # candidates a chunk (-1: unusable list)
        "cutoff": ((B, 2), f32),          # (c, m)
        "offsets": ((B, S + 1), i32),     # where each chunk's candidates start; [S] = total
        "hist": ((B, S, _HIST_BINS), i32),
        "cand": ((B, max_candidates), i32),    # candidate indices
        "cand_s": ((B, max_candidates), f32),  # their s
    }
    sizes = [math.prod(shape) for shape, _ in scratch.values()]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // 4) * 4)
    ws = torch.empty((starts[-1],), dtype=torch.int32, device=dev)
    w = {name: ws[a:a + n].view(shape).view(dt)
         for (name, (shape, dt)), a, n in zip(scratch.items(), starts, sizes)}
    ids = torch.empty((B,), dtype=torch.int64, device=dev)
    # rows padded to 4 floats: thr starts 16-byte aligned whatever B (a row count that is not a
    # multiple of 4, e.g. after a sequence stopped, would compile a second draw kernel mid-run)
    out = torch.empty((2, -(-B // 4) * 4), dtype=torch.float32, device=dev)
    logprobs, thr = out[0, :B], out[1, :B]
    if B == 0:
        return (ids, logprobs, thr) if return_threshold else (ids, logprobs)
    params = [p.contiguous() for p in (temperature, top_k, top_p, min_p, seeds, offsets)]
    s_block = triton.next_power_of_2(S)
    _chunk_stats_kernel[(B, S)](
        logits, logits.stride(0), *params, w["chunk_max"], w["chunk_sum"], w["chunk_best"], w["chunk_arg"],
        w["hist"], V, S, CHUNK=chunk, BLOCK=block, HIST_BLOCK=min(_HIST_BLOCK, chunk, block_v),
        N_BINS=_HIST_BINS, BINS_PER_NAT=_BINS_PER_NAT, num_warps=8)
    _cutoff_kernel[(B,)](
        *params, w["chunk_max"], w["chunk_sum"], w["chunk_best"], w["hist"], w["cutoff"], w["offsets"], V, S,
        CHUNK=chunk, S_BLOCK=s_block, N_BINS=_HIST_BINS, BINS_PER_NAT=_BINS_PER_NAT, num_warps=4)
    compact_block = min(_COMPACT_BLOCK.get(logits.element_size(), 256), chunk, block_v)
    _compact_kernel[(B, S)](
        logits, logits.stride(0), *params, w["cutoff"], w["offsets"], w["chunk_count"], w["chunk_mass"],
        w["chunk_x_out"], w["cand"], w["cand_s"], V, S, CHUNK=chunk, MAX_CAND=max_candidates,
        BLOCK=compact_block, BINS_PER_NAT=_BINS_PER_NAT, num_warps=_COMPACT_WARPS)
    _threshold_draw_kernel[(B,)](
        logits, logits.stride(0), *params, w["chunk_max"], w["chunk_sum"], w["chunk_best"], w["chunk_arg"],
        w["cutoff"], w["chunk_count"], w["chunk_mass"], w["chunk_x_out"], w["cand"], w["cand_s"],
        ids, logprobs, thr, V, S, S_BLOCK=s_block, MAX_CAND=max_candidates,
        PAIRS_MAX=min(all_pairs_max, block_v, max_candidates), PAIRS_STEP=_ALL_PAIRS_STEP,
        CAND_BLOCK=block_c, N_PROBES=_BISECT_PROBES, VALUE_SWEEPS=_VALUE_SPLIT_SWEEPS,
        num_warps=_DRAW_WARPS)
    return (ids, logprobs, thr) if return_threshold else (ids, logprobs)
