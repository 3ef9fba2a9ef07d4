"""Paged attention over the engine's KV cache, the Triton kernels: the KV store, the
prefill/decode kernel (optionally split over the keys) and the split combine (the
contract, the math and the split rules are in `rlfuse.kernels.attention.paged`'s
docstring)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.attention.paged import SharedPrefixDecode, _check_cache, check_kv_scale, shared_prefix_rows
from rlfuse.kernels.attention.triton_varlen import LOG2E, attend_tile, exact_config
from rlfuse.kernels.attention.varlen import KV_BLOCK
from rlfuse.kernels.backend import num_sms
from rlfuse.kernels.kv_quant.triton_fp8 import to_e4m3
from rlfuse.kernels.triton_common import dot_precision

_MIN_SPLIT_BLOCKS = 2  # keys per split >= 2 * KV_BLOCK: a guess, not yet timed (bench_attention.py: auto vs nosplit)
_MAX_SPLITS = 64


@triton.jit
def _store_kv_kernel(K, V, KC, VC, SLOT, INV, skt, skh, svt, svh, skcb, skct, skch, svcb, svct, svch,
                     n_kv, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOT + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // PAGE
    off = slot % PAGE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    ok = h < n_kv
    k = tl.load(K + t * skt + h * skh + d, mask=ok)
    v = tl.load(V + t * svt + h * svh + d, mask=ok)
    if FP8:  # INV (2, n_kv): row 0 K's, row 1 V's 1 / scale per kv head
        k = to_e4m3(k.to(tl.float32), tl.load(INV + h, mask=ok, other=1.0))
        v = to_e4m3(v.to(tl.float32), tl.load(INV + n_kv + h, mask=ok, other=1.0))
    tl.store(KC + blk * skcb + off * skct + h * skch + d, k.to(KC.dtype.element_ty), mask=ok)
    tl.store(VC + blk * svcb + off * svct + h * svch + d, v.to(VC.dtype.element_ty), mask=ok)


@triton.jit
def _dequant(x, s, DT: tl.constexpr, FP8: tl.constexpr):
    """A loaded K or V tile in DT: an fp8 cache's values times their scale s (exact), else a cast."""
    if FP8:
        return (x.to(tl.float32) * s).to(DT)
    else:
        return x.to(DT)


@triton.jit
def _paged_step(acc, l_i, m_i, q, KC, VC, bt_row, kv_off, offs_n, offs_d, start_n, hi, pos,
                skb, skt, svb, svt, qk_scale, k_s, v_s, PAGE: tl.constexpr, MASK: tl.constexpr,
                PREC: tl.constexpr, FP8: tl.constexpr):
    n = start_n + offs_n  # (N,) cache positions of this KV block
    if MASK:
        page = tl.load(bt_row + n // PAGE, mask=n < hi, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + n // PAGE).to(tl.int64)
    k_ptrs = KC + kv_off + page[:, None] * skb + (n % PAGE)[:, None] * skt + offs_d[None, :]
    v_ptrs = VC + kv_off + page[:, None] * svb + (n % PAGE)[:, None] * svt + offs_d[None, :]
    if MASK:
        k = tl.load(k_ptrs, mask=(n < hi)[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=(n < hi)[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    k = _dequant(k, k_s, q.dtype, FP8)
    v = _dequant(v, v_s, q.dtype, FP8)
    return attend_tile(acc, l_i, m_i, q, k, v, n, pos, hi, qk_scale, MASK, PREC)


@triton.jit
def _kv_scales(KV_S, hk, n_kv, FP8: tl.constexpr):
    """An fp8 cache's K and V scales of kv head hk (KV_S (2, n_kv) fp32); 1.0 (unused) else."""
    if FP8:
        return tl.load(KV_S + hk), tl.load(KV_S + n_kv + hk)
    else:
        return 1.0, 1.0


@triton.jit(do_not_specialize=['n_tok', 'n_split', 'split_tokens', 'sbt'])  # vary per step: one compile
# (sbt: the eager path's block tables are (B, w) copies, w = the step's longest context in blocks)
def _paged_attn_kernel(Q, KC, VC, KV_S, O, O_WS, LSE_WS, L_WS, CU_Q, SEQ_LENS, BT, SH_LEN, sqt, sqh, skb, skt, skh,
                       svb, svt, svh, sot, soh, sbt, n_tok, n_hq, n_rep, n_split, split_tokens, qk_scale,
                       PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       SPLIT: tl.constexpr, PREC: tl.constexpr, ALL_MASKED: tl.constexpr,
                       CASCADE: tl.constexpr, FP8: tl.constexpr):
    pid, hk, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    qb = pid // n_split
    sp = pid % n_split
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    if qb * BLOCK_Q >= q_len:
        return
    kv_len = tl.load(SEQ_LENS + b)
    share = 0
    if CASCADE:  # keys [0, share) were attended by _paged_attn_prefix_kernel
        share = tl.load(SH_LEN + b).to(tl.int32)
    lo = share + sp * split_tokens
    kv_end = kv_len - q_len + tl.minimum(q_len, (qb + 1) * BLOCK_Q)  # last key of the block + 1
    hi = tl.minimum(lo + split_tokens, kv_end)
    if SPLIT:
        if lo >= hi:
            return  # nothing to see: the workspace keeps lse = -inf for these rows
    r = tl.arange(0, BLOCK_M)
    j = qb * BLOCK_Q + r // GROUP  # query index within the sequence
    g = r % GROUP
    row_ok = (r // GROUP < BLOCK_Q) & (j < q_len) & (g < n_rep)
    hq = hk * n_rep + g
    pos = kv_len - q_len + j
    t = (q_start + j).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + t[:, None] * sqt + hq[:, None] * sqh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = BT + b.to(tl.int64) * sbt
    k_s, v_s = _kv_scales(KV_S, hk, n_hq // n_rep, FP8)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CASCADE and not SPLIT:
        if share > 0:  # continue the prefix's online softmax where _paged_attn_prefix_kernel stopped
            st = t * n_hq + hq
            acc = tl.load(O_WS + st[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            m_i = tl.load(LSE_WS + st, mask=row_ok, other=float("-inf"))
            l_i = tl.load(L_WS + st, mask=row_ok, other=0.0)
    # keys below the block's first query position (rounded down to KV blocks) need no mask
    first = kv_len - q_len + qb * BLOCK_Q + 1
    full_end = tl.maximum(lo, tl.minimum(hi, (tl.maximum(first, 0) // BLOCK_N) * BLOCK_N))
    if ALL_MASKED:  # exact numerics: the same masked tile as varlen_attention's exact forward
        full_end = lo
    for start_n in range(lo, full_end, BLOCK_N):
        acc, l_i, m_i = _paged_step(acc, l_i, m_i, q, KC, VC, bt_row, hk * skh, offs_n, offs_d, start_n, hi,
                                    pos, skb, skt, svb, svt, qk_scale, k_s, v_s, PAGE, False, PREC, FP8)
    for start_n in range(full_end, hi, BLOCK_N):
        acc, l_i, m_i = _paged_step(acc, l_i, m_i, q, KC, VC, bt_row, hk * skh, offs_n, offs_d, start_n, hi,
                                    pos, skb, skt, svb, svt, qk_scale, k_s, v_s, PAGE, True, PREC, FP8)
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:
        ws = (sp * n_tok + t) * n_hq + hq  # (n_split, T, Hq) row index
        tl.store(O_WS + ws[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])
        tl.store(LSE_WS + ws, tl.where(has, m_i + tl.log2(l_i), float("-inf")), mask=row_ok)
    else:
        tl.store(O + t[:, None] * sot + hq[:, None] * soh + offs_d[None, :], o.to(O.dtype.element_ty),
                 mask=row_ok[:, None])


@triton.jit(do_not_specialize=['n_tok', 'n_split', 'split_tokens', 'slot0'])
def _paged_attn_prefix_kernel(Q, KC, VC, KV_S, O_WS, LSE_WS, L_WS, CU_Q, SEQ_LENS, BT, SH_LEN, SH_PERM, SH_FIRST,
                              SH_NUM, sqt, sqh, skb, skt, skh, svb, svt, svh, sbt, n_tok, n_hq, n_rep, slot0,
                              n_split, split_tokens, qk_scale, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                              GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              PREC: tl.constexpr, HANDOFF: tl.constexpr, MASKED: tl.constexpr,
                              FP8: tl.constexpr):
    """Decode rows of up to BLOCK_M // GROUP sequences that share their first SH_LEN keys
    (the same cache blocks): each K/V tile of that prefix is read once for all of them.
    HANDOFF (unsplit): the online-softmax state (acc, m, l) goes to the workspace and
    `_paged_attn_kernel` continues from it (in exact numerics, MASKED: the same arithmetic as
    one pass). Else: a normalized partial and its lse in split slot slot0 + sp, for the
    combine."""
    pid, hk = tl.program_id(0), tl.program_id(1)
    c = pid // n_split
    sp = pid % n_split
    cnt = tl.load(SH_NUM + c).to(tl.int32)
    if cnt == 0:
        return
    first = tl.load(SH_FIRST + c)
    r = tl.arange(0, BLOCK_M)
    mem = r // GROUP
    g = r % GROUP
    row_ok = (mem < cnt) & (g < n_rep)
    b = tl.load(SH_PERM + first + mem, mask=mem < cnt, other=0).to(tl.int64)
    lead = tl.load(SH_PERM + first).to(tl.int64)
    share = tl.load(SH_LEN + lead).to(tl.int32)
    lo = sp * split_tokens
    hi = tl.minimum(lo + split_tokens, share)
    if lo >= hi:
        return
    hq = hk * n_rep + g
    t = tl.load(CU_Q + b, mask=mem < cnt, other=0).to(tl.int64)  # decode: one query token each
    pos = tl.load(SEQ_LENS + b, mask=mem < cnt, other=1) - 1
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + t[:, None] * sqt + hq[:, None] * sqh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = BT + lead * sbt  # the members' tables agree on the prefix blocks
    k_s, v_s = _kv_scales(KV_S, hk, n_hq // n_rep, FP8)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):  # whole KV blocks: share is a multiple of BLOCK_N
        acc, l_i, m_i = _paged_step(acc, l_i, m_i, q, KC, VC, bt_row, hk * skh, offs_n, offs_d, start_n, hi,
                                    pos, skb, skt, svb, svt, qk_scale, k_s, v_s, PAGE, MASKED, PREC, FP8)
    if HANDOFF:
        st = t * n_hq + hq
        tl.store(O_WS + st[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(LSE_WS + st, m_i, mask=row_ok)
        tl.store(L_WS + st, l_i, mask=row_ok)
    else:
        ws = ((slot0 + sp) * n_tok + t) * n_hq + hq
        tl.store(O_WS + ws[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None], mask=row_ok[:, None])
        tl.store(LSE_WS + ws, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit(do_not_specialize=['n_tok', 'n_split'])  # row counts vary per step: one compile
def _paged_attn_combine_kernel(O, O_WS, LSE_WS, sot, soh, n_tok, n_hq, n_split,
                               HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    ws = (s * n_tok + t) * n_hq + h
    lse = tl.load(LSE_WS + ws, mask=s < n_split, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty splits
    offs_d = tl.arange(0, HEAD_DIM)
    o_s = tl.load(O_WS + ws[:, None] * HEAD_DIM + offs_d[None, :], mask=(lse > float("-inf"))[:, None], other=0.0)
    den = tl.sum(w, 0)
    o = tl.sum(w[:, None] * o_s, 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(O + t * sot + h * soh + offs_d, o.to(O.dtype.element_ty))


def _config(head_dim: int, itemsize: int, decode: bool) -> dict:
    """BLOCK_M = query rows per program (tokens x GQA group; decode always uses one token).
    Chosen so ptxas (sm_90a, Triton 3.9, offline) reports no register spills: 128 rows
    with 8 warps at Dh 128 in 16-bit, 32 rows in fp32 (IEEE FMA dots, a test dtype).
    Not yet timed on our GPU (benchmarks/kernels/bench_attention.py)."""
    if decode:
        return dict(BLOCK_M=16, num_warps=4, num_stages=3)
    if itemsize == 4:
        return dict(BLOCK_M=32, num_warps=8, num_stages=2)
    return dict(BLOCK_M=64 if head_dim > 128 else 128, num_warps=8, num_stages=2)


def store_kvcache_triton(k, v, k_cache, v_cache, slot_mapping, kv_scale=None):
    _check_cache(k_cache, v_cache, "store_kvcache")
    check_kv_scale(k_cache, kv_scale, "store_kvcache")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"store_kvcache: k {tuple(k.shape)}, v {tuple(v.shape)}, slot_mapping "
                         f"{tuple(slot_mapping.shape)} do not match the cache {tuple(k_cache.shape)}")
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    T, n_kv, dh = k.shape
    if T == 0:
        return
    _store_kv_kernel[(T,)](k, v, k_cache, v_cache, slot_mapping, kv_scale[1] if fp8 else k, k.stride(0),
                           k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
                           n_kv, PAGE=k_cache.shape[1], HEAD_DIM=dh, BLOCK_H=triton.next_power_of_2(n_kv), FP8=fp8)


def paged_attention_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q: int,
                           scale: float | None = None, *, num_splits: int | None = None,
                           config: dict | None = None, out: torch.Tensor | None = None, exact: bool = False,
                           shared: SharedPrefixDecode | None = None, kv_scale=None):
    """Launcher. `num_splits` forces the KV split count (None: heuristic, 1: no split);
    `config` overrides BLOCK_M (rows per program, prefill), num_warps, num_stages;
    `out` (T, Hq, Dh) receives the result when given (static buffers, tests); `exact`
    runs `varlen_attention`'s exact tile for prefill and decode alike, unsplit; `shared`
    (decode only) reads each shared prefix once per chunk of sequences; `kv_scale` (scale,
    inv) of an fp8 cache, whose tiles are dequantized on load."""
    _check_cache(k_cache, v_cache, "paged_attention")
    check_kv_scale(k_cache, kv_scale, "paged_attention")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    kv_s = kv_scale[0] if fp8 else q  # any pointer when unused
    T, Hq, dh = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    if dh != k_cache.shape[3] or Hq % Hkv:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)}")
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        if x.dtype != torch.int32:
            raise ValueError(f"paged_attention: {name} must be int32, got {x.dtype}")
    B = cu_seqlens_q.shape[0] - 1
    if seq_lens.shape != (B,) or block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"paged_attention: seq_lens {tuple(seq_lens.shape)} / block_tables "
                         f"{tuple(block_tables.shape)} must have B = {B} rows")
    if q.stride(-1) != 1:
        q = q.contiguous()
    scale = dh ** -0.5 if scale is None else float(scale)
    o = torch.empty((T, Hq, dh), dtype=q.dtype, device=q.device) if out is None else out
    assert o.shape == q.shape and o.dtype == q.dtype and o.stride(-1) == 1
    if T == 0 or B == 0 or max_seqlen_q <= 0 or block_tables.shape[1] == 0:
        return o.zero_()
    n_rep = Hq // Hkv
    group = triton.next_power_of_2(n_rep)
    if exact:
        if k_cache.dtype != q.dtype and not fp8:
            raise ValueError(f"paged_attention: exact numerics needs the KV cache in the compute dtype "
                             f"({q.dtype}) or fp8 with scales, got {k_cache.dtype}")
        cfg = exact_config(q.element_size())
        num_splits = 1
    else:
        cfg = _config(dh, q.element_size(), decode=max_seqlen_q == 1)
    cfg.update(config or {})
    rows = cfg.pop("BLOCK_M")
    # two query-tile shapes only (decode: 1 token; else the largest), never a function of
    # the step's lengths: each new shape is a Triton compile (0.5-5 s on an H100), and a
    # generate whose chunks had many lengths spent most of its first run compiling (perf-log)
    block_q = 1 if max_seqlen_q == 1 else max(1, rows // group)
    block_m = max(16, block_q * group)  # tl.dot needs >= 16 rows
    if exact:
        block_m = max(rows, block_m)  # decode too: the dot keeps the exact tile's height
    n_qblk = triton.cdiv(max_seqlen_q, block_q)
    max_ctx = block_tables.shape[1] * page
    n_kvblk = triton.cdiv(max_ctx, KV_BLOCK)
    if shared is not None and max_seqlen_q != 1:
        raise ValueError("paged_attention: a shared-prefix plan is for decode steps (one query per sequence)")
    target = 2 * num_sms(q.device)
    if num_splits is None:
        progs = B * Hkv * n_qblk
        # enough programs for ~2 waves on the GPU, each split >= _MIN_SPLIT_BLOCKS KV blocks
        num_splits = 1 if progs >= target else min(triton.cdiv(target, progs), n_kvblk // _MIN_SPLIT_BLOCKS,
                                                   _MAX_SPLITS)
    num_splits = max(1, min(num_splits, n_kvblk))
    split_tokens = triton.cdiv(n_kvblk, num_splits) * KV_BLOCK
    num_splits = triton.cdiv(max_ctx, split_tokens)
    # a shared prefix hands its online-softmax state to an unsplit suffix (always in exact
    # numerics); with a split suffix it takes split slots of its own, merged by the combine
    handoff = shared is not None and num_splits == 1
    sh_splits, sh_tokens = 1, n_kvblk * KV_BLOCK
    if shared is not None and not handoff:
        progs = shared.max_chunks * Hkv
        sh_splits = 1 if progs >= target else triton.cdiv(target, progs)
        sh_splits = max(1, min(sh_splits, n_kvblk, _MAX_SPLITS - num_splits))
        sh_tokens = triton.cdiv(n_kvblk, sh_splits) * KV_BLOCK
        sh_splits = triton.cdiv(max_ctx, sh_tokens)
    split = num_splits > 1
    slots = num_splits + (0 if shared is None or handoff else sh_splits)
    l_ws = o
    if split:
        o_ws = torch.empty((slots, T, Hq, dh), dtype=torch.float32, device=q.device)
        lse_ws = torch.full((slots, T, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    elif handoff:  # the prefix's online-softmax state, picked up per row
        o_ws = torch.empty((T, Hq, dh), dtype=torch.float32, device=q.device)
        lse_ws = torch.empty((T, Hq), dtype=torch.float32, device=q.device)
        l_ws = torch.empty((T, Hq), dtype=torch.float32, device=q.device)
    else:
        o_ws = lse_ws = o  # unused
    sh_len = seq_lens if shared is None else shared.share_len
    if shared is not None:
        sh_rows = shared_prefix_rows(group, exact, q.element_size())
        if shared.max_members * group > sh_rows:
            raise ValueError(f"paged_attention: {shared.max_members} sequences a shared-prefix chunk do not fit "
                             f"its {sh_rows} rows (shared_prefix_members gives the cap)")
        _paged_attn_prefix_kernel[(shared.max_chunks * sh_splits, Hkv)](
            q, k_cache, v_cache, kv_s, o_ws, lse_ws, l_ws, cu_seqlens_q, seq_lens, block_tables, shared.share_len,
            shared.perm, shared.first, shared.count, q.stride(0), q.stride(1), *k_cache.stride()[:3],
            *v_cache.stride()[:3], block_tables.stride(0), T, Hq, n_rep, num_splits, sh_splits, sh_tokens,
            scale * LOG2E, PAGE=page, HEAD_DIM=dh, GROUP=group, BLOCK_M=sh_rows, BLOCK_N=KV_BLOCK,
            PREC=dot_precision(q), HANDOFF=handoff, MASKED=exact, FP8=fp8, **cfg)
    _paged_attn_kernel[(n_qblk * num_splits, Hkv, B)](
        q, k_cache, v_cache, kv_s, o, o_ws, lse_ws, l_ws, cu_seqlens_q, seq_lens, block_tables, sh_len, q.stride(0),
        q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], o.stride(0), o.stride(1),
        block_tables.stride(0), T, Hq, n_rep, num_splits, split_tokens, scale * LOG2E, PAGE=page, HEAD_DIM=dh,
        BLOCK_Q=block_q, GROUP=group, BLOCK_M=block_m, BLOCK_N=KV_BLOCK, SPLIT=split, PREC=dot_precision(q),
        ALL_MASKED=exact, CASCADE=shared is not None, FP8=fp8, **cfg)
    if split:
        # BLOCK_S fixed (masked past num_splits): one compile whatever the split count
        _paged_attn_combine_kernel[(T, Hq)](o, o_ws, lse_ws, o.stride(0), o.stride(1), T, Hq, slots,
                                            HEAD_DIM=dh, BLOCK_S=triton.next_power_of_2(_MAX_SPLITS), num_warps=2)
    return o
