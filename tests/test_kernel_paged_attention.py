"""paged_attention and store_kvcache (Triton) vs float64 gold, and vs varlen_attention.

Tolerance rule as in tests/test_kernel_attention.py: err(triton) <= 4 * err(reference in
the same dtype) + 4 * u * max|gold| (u the dtype's unit roundoff; the kernel rounds P to
the input dtype before P @ V and rounds the output once).
Block tables are random permutations of the cache blocks (non-contiguous pages).
Run: python -m pytest -q tests/test_kernel_paged_attention.py
"""

import pytest
import torch

from rlfuse.kernels import use_backend
from rlfuse.kernels.attention.paged import paged_attention, paged_attention_ref, store_kvcache, store_kvcache_ref
from rlfuse.kernels.attention.triton_paged import paged_attention_triton
from rlfuse.kernels.attention.triton_varlen import varlen_fwd

U = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _i32(xs):
    return torch.tensor(xs, dtype=torch.int32, device=DEV)


def _case(q_lens, kv_lens, page, hq, hkv, dh, dtype, seed=0, extra_blocks=3):
    """Random cache and queries; block tables are random disjoint pages of the cache."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + page - 1) // page for n in kv_lens]
    width = max(need) + 1  # a static width larger than any sequence needs
    n_blocks = sum(need) + extra_blocks
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in need:  # unused entries hold -1 garbage: the kernel must never read them
        tables.append(perm[used:used + n] + [-1] * (width - n))
        used += n
    kc = torch.randn(n_blocks, page, hkv, dh, generator=g).to(dtype).to(DEV)
    vc = torch.randn(n_blocks, page, hkv, dh, generator=g).to(dtype).to(DEV)
    q = torch.randn(sum(q_lens), hq, dh, generator=g).to(dtype).to(DEV)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32).to(DEV)
    return q, kc, vc, cu, _i32(kv_lens), _i32(tables)


def _check(q, kc, vc, cu, sl, bt, max_q, dtype, **kw):
    gold = paged_attention_ref(q.double(), kc.double(), vc.double(), cu, sl, bt, max_q)
    ref = paged_attention_ref(q, kc, vc, cu, sl, bt, max_q)
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, kc, vc, cu, sl, bt, max_q, out=out, **kw)
    assert torch.isfinite(out).all(), f"non-finite output {kw}"
    err = (out.double() - gold).abs().max().item()
    tol = 4 * (ref.double() - gold).abs().max().item() + 4 * U[dtype] * gold.abs().max().item()
    assert err <= tol, f"{kw}: max err {err:.3e} > tol {tol:.3e}"
    return out


@pytest.mark.parametrize("page,dtype,hq,hkv,dh", [
    (16, torch.float32, 4, 2, 32), (32, torch.bfloat16, 4, 2, 32), (16, torch.float16, 4, 4, 16),
    (32, torch.float32, 4, 1, 64),
])
def test_decode_vs_gold(page, dtype, hq, hkv, dh):
    # decode: q_len 1; contexts 1, block-unaligned, > 2 KV blocks, and a padding row (0)
    kv_lens = [1, 70, 131, 0, 33]
    q, kc, vc, cu, sl, bt = _case([1] * 5, kv_lens, page, hq, hkv, dh, dtype)
    outs = [_check(q, kc, vc, cu, sl, bt, 1, dtype, num_splits=n) for n in (1, 3, None)]
    assert torch.equal(outs[1][3], torch.zeros_like(outs[1][3]))  # padding row: zeros


@pytest.mark.parametrize("page,dtype", [(16, torch.float32), (32, torch.bfloat16)])
def test_prefill_with_prefix_vs_gold(page, dtype):
    # chunks of 5 (no prefix), 1, 17 and 3 new tokens after cached prefixes of 0, 99, 50, 197
    q_lens, kv_lens = [5, 1, 17, 3], [5, 100, 67, 200]
    q, kc, vc, cu, sl, bt = _case(q_lens, kv_lens, page, 4, 2, 32, dtype, seed=1)
    # BLOCK_M=4: 2 query tokens x GROUP 2 fill 4 of the 16 rows tl.dot needs; the rest are masked
    for kw in (dict(num_splits=1), dict(num_splits=2), dict(num_splits=1, config=dict(BLOCK_M=4))):
        _check(q, kc, vc, cu, sl, bt, max(q_lens), dtype, **kw)


def test_split_combine_with_large_logits():
    # scores of order 1e3: the split partials must be combined relative to their max lse
    q, kc, vc, cu, sl, bt = _case([1, 1], [200, 150], 16, 2, 1, 16, torch.float32, seed=7)
    q = q * 200.0
    _check(q, kc, vc, cu, sl, bt, 1, torch.float32, num_splits=4)


def test_store_kvcache_skips_padding_slots():
    page, hkv, dh, T = 16, 3, 16, 6  # Hkv not a power of two: the head tile is masked
    g = torch.Generator().manual_seed(2)
    fused = torch.randn(T, 2 * hkv + 1, dh, generator=g).to(DEV)
    k, v = fused[:, :hkv], fused[:, hkv:2 * hkv]  # non-contiguous views, like a fused qkv split
    slots = torch.tensor([5, -1, 40, 17, -1, 63], dtype=torch.int64, device=DEV)
    kc0 = torch.randn(4, page, hkv, dh, generator=g).to(DEV)
    vc0 = torch.randn(4, page, hkv, dh, generator=g).to(DEV)
    kc, vc, kr, vr = kc0.clone(), vc0.clone(), kc0.clone(), vc0.clone()
    with use_backend("triton"):
        store_kvcache(k, v, kc, vc, slots)
    store_kvcache_ref(k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    written = torch.zeros(4 * page, dtype=torch.bool, device=DEV)
    written[slots[slots >= 0]] = True
    assert torch.equal(kc.view(-1, hkv, dh)[~written], kc0.view(-1, hkv, dh)[~written])  # untouched
    assert torch.equal(kc.view(-1, hkv, dh)[40], k[2]) and torch.equal(vc.view(-1, hkv, dh)[63], v[5])


def test_varlen_equals_paged_prefill_of_the_same_tokens():
    # one sequence: varlen over all L tokens == K/V written into a paged cache with
    # store_kvcache, then (a) one prefill of all L queries and (b) two chunks with a prefix
    L, hq, hkv, dh, page = 45, 4, 2, 32, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(L, h, dh, generator=g).to(DEV) for h in (hq, hkv, hkv))
    o_var, _ = varlen_fwd(q, k, v, torch.tensor([0, L], dtype=torch.int32, device=DEV), L, dh**-0.5)
    n_pages = (L + page - 1) // page
    table = torch.randperm(8, generator=g)[:n_pages].to(torch.int32).to(DEV)
    slots = (table.long()[torch.arange(L, device=DEV) // page] * page + torch.arange(L, device=DEV) % page)
    kc = torch.full((8, page, hkv, dh), float("nan"), device=DEV)
    vc = torch.full((8, page, hkv, dh), float("nan"), device=DEV)
    with use_backend("triton"):
        store_kvcache(k, v, kc, vc, slots)
        whole = paged_attention(q, kc, vc, _i32([0, L]), _i32([L]), table[None], L)
        first = paged_attention(q[:20], kc, vc, _i32([0, 20]), _i32([20]), table[None], 20)
        rest = paged_attention(q[20:], kc, vc, _i32([0, L - 20]), _i32([L]), table[None], L - 20)
    torch.testing.assert_close(whole, o_var, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(torch.cat([first, rest]), o_var, atol=2e-6, rtol=2e-6)


def test_graph_padding_batch_is_finite():
    # a decode batch padded like a CUDA-graph bucket: padding rows have slot -1,
    # seq_len 0 and an all -1 block-table row; split and unsplit paths
    page, hq, hkv, dh = 16, 4, 2, 16
    q, kc, vc, cu, sl, bt = _case([1] * 4, [20, 0, 9, 0], page, hq, hkv, dh, torch.float32, seed=4)
    bt[1] = -1
    bt[3] = -1
    for n in (1, 2):
        out = _check(q, kc, vc, cu, sl, bt, 1, torch.float32, num_splits=n)
        assert (out[1] == 0).all() and (out[3] == 0).all()


def test_decode_batch_invariant_at_fixed_split_count():
    # with the split count pinned, a sequence's decode output does not depend on the
    # rest of the batch (bitwise); the automatic count depends on the batch size
    q, kc, vc, cu, sl, bt = _case([1] * 4, [90, 3, 150, 64], 16, 4, 2, 16, torch.bfloat16, seed=8)
    for n in (1, 3):
        full = paged_attention_triton(q, kc, vc, cu, sl, bt, 1, num_splits=n)
        head = paged_attention_triton(q[:2], kc, vc, cu[:3], sl[:2], bt[:2], 1, num_splits=n)
        assert torch.equal(full[:2], head)


def test_rejects_bad_block_size():
    q = torch.randn(1, 2, 16, device=DEV)
    kc = torch.randn(2, 8, 2, 16, device=DEV)
    with use_backend("triton"), pytest.raises(ValueError, match="block_size"):
        paged_attention(q, kc, kc, _i32([0, 1]), _i32([1]), _i32([[0]]), 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dh", [64, 128])
def test_cuda_bf16_real_sizes(dh):
    q, kc, vc, cu, sl, bt = _case([1] * 8, [1, 4000, 513, 0, 2048, 17, 1024, 3000], 16, 16, 8, dh,
                                  torch.bfloat16, seed=5)
    for n in (1, None):
        _check(q, kc, vc, cu, sl, bt, 1, torch.bfloat16, num_splits=n)
    q, kc, vc, cu, sl, bt = _case([300, 1, 64], [1000, 1, 64], 32, 16, 8, dh, torch.bfloat16, seed=6)
    _check(q, kc, vc, cu, sl, bt, 300, torch.bfloat16)
