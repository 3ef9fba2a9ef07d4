"""Shared-prefix decode attention (`SharedPrefixDecode`): sequences whose prompts sit in the
same cache blocks read that K/V once per chunk.

Fast numerics: equal to the unshared decode within the split tolerance (state handoff to
an unsplit suffix, or split slots of its own). Exact numerics: bitwise the unshared decode (the prefix program hands
its online-softmax state to the suffix program). The plan builder groups by physical
blocks only. Triton under the CPU interpreter; the `gpu` case at Qwen3-0.6B's decode shape.
Run: python -m pytest -q tests/test_kernel_shared_prefix.py
"""

import numpy as np
import pytest
import torch

from rlfuse.engine.step.shared_prefix import plan_shared_prefix
from rlfuse.kernels.attention.paged import SharedPrefixDecode, paged_attention_ref, shared_prefix_members
from rlfuse.kernels.attention.triton_paged import paged_attention_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _group_case(groups, prompt, outs, page, hq, hkv, dh, dtype, seed=0):
    """len(groups) prompts of `prompt` tokens; prompt i has groups[i] sequences whose full
    prompt blocks are shared (the same block ids), each with its own tail block(s) and
    outs[b] generated tokens. Returns decode inputs (one query per sequence) and the keys
    (each sequence's prompt full blocks) the engine would pass to plan_shared_prefix."""
    g = torch.Generator().manual_seed(seed)
    n_full = prompt // page
    tables, keys, lens, nxt = [], [], [], 0
    b = 0
    for n in groups:
        shared = list(range(nxt, nxt + n_full))
        nxt += n_full
        for _ in range(n):
            L = prompt + outs[b]
            own = -(-L // page) - n_full
            tables.append(shared + list(range(nxt, nxt + own)))
            nxt += own
            keys.append(tuple(shared))
            lens.append(L)
            b += 1
    width = max(len(t) for t in tables) + 1
    perm = torch.randperm(nxt + 3, generator=g)  # scatter the blocks over the cache
    bt = torch.tensor([[perm[x].item() for x in t] + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    keys = [tuple(perm[x].item() for x in k) for k in keys]
    kc = torch.randn(nxt + 3, page, hkv, dh, generator=g).to(dtype)
    vc = torch.randn(nxt + 3, page, hkv, dh, generator=g).to(dtype)
    q = torch.randn(len(lens), hq, dh, generator=g).to(dtype)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEV) for t in (q, kc, vc, cu, sl, bt)], keys


def _plan(keys, page, members, max_chunks):
    share_len, perm, first, count, n = plan_shared_prefix(keys, page, members, max_chunks)
    t = [torch.from_numpy(a).to(DEV) for a in (share_len, perm, first, count)]
    return SharedPrefixDecode(*t, max_members=members), n


def test_plan_groups_by_physical_blocks():
    # 16-key pages: a KV_BLOCK is 4 pages; keys shorter than 4 pages share nothing
    keys = [(1, 2, 3, 4, 5), (1, 2, 3, 4, 5), (1, 2, 3, 4, 9), (7, 8, 9), (7, 8, 9), None, (1, 2, 3, 4)]
    share_len, perm, first, count, n = plan_shared_prefix(keys, 16, 8, 4)
    assert n == 1  # (1,2,3,4) x 4 sequences; (7,8,9) is < 64 keys
    assert count.tolist() == [4, 0, 0, 0] and sorted(perm[:4].tolist()) == [0, 1, 2, 6]
    assert share_len.tolist() == [64, 64, 64, 0, 0, 0, 64]
    # the blocks in common, whatever each key's own last blocks (a prompt whose last block
    # is not shared); fewer than 64 keys in common: nothing
    keys = [tuple(range(9)), tuple(range(8)) + (50,), tuple(range(10)), (0, 1, 2, 60, 4), (0, 1, 2, 61)]
    assert plan_shared_prefix(keys[:3], 16, 8, 2)[0].tolist() == [128, 128, 128]
    assert plan_shared_prefix(keys[3:], 16, 8, 2)[4] == 0
    # 3 prompts of 12 blocks x 3 completions, all starting with the same 4-block system
    # prompt: a group per prompt (192 keys), not one group sharing the system prompt (64)
    sys_ = (900, 901, 902, 903)
    keys = [sys_ + tuple(range(100 * p, 100 * p + 8)) for p in (1, 2, 3) for _ in range(3)][::-1]
    share_len, perm, first, count, n = plan_shared_prefix(keys, 16, 8, 8)
    assert n == 3 and share_len.tolist() == [192] * 9
    assert sorted(sorted(perm[f:f + k].tolist()) for f, k in zip(first[:n], count[:n])) == [[0, 1, 2], [3, 4, 5],
                                                                                          [6, 7, 8]]
    # distinct prompts behind one system prompt: one group sharing it
    keys = [sys_ + (100 * p,) for p in range(5)]
    share_len, _, _, count, n = plan_shared_prefix(keys, 16, 8, 8)
    assert n == 1 and count[0] == 5 and share_len.tolist() == [64] * 5
    # chunks of at most max_members; a lone leftover stays unshared; max_chunks caps
    share_len, perm, first, count, n = plan_shared_prefix([(1, 2, 3, 4)] * 5, 16, 2, 8)
    assert n == 2 and count[:3].tolist() == [2, 2, 0] and share_len.tolist() == [64, 64, 64, 64, 0]
    share_len, _, _, count, n = plan_shared_prefix([(1, 2, 3, 4)] * 6, 16, 2, 1)
    assert n == 1 and share_len.tolist() == [64, 64, 0, 0, 0, 0]
    assert np.array_equal(count, [2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_shared_prefix_decode_is_bitwise(dtype):
    # groups of 3, 1 and 2 sequences; prompts of 150 keys (128 shared: two KV blocks)
    hq, hkv, dh, page = 4, 2, 16, 16
    (q, kc, vc, cu, sl, bt), keys = _group_case([3, 1, 2], 150, [1, 40, 77, 5, 30, 64], page, hq, hkv, dh, dtype)
    members = shared_prefix_members(hq, hkv, exact=True, itemsize=q.element_size())
    plan, n = _plan(keys, page, members, max_chunks=3)
    assert n == 2 and plan.share_len.tolist() == [128, 128, 128, 0, 128, 128]
    plain = paged_attention_triton(q, kc, vc, cu, sl, bt, 1, exact=True)
    shared = paged_attention_triton(q, kc, vc, cu, sl, bt, 1, exact=True, shared=plan)
    assert torch.equal(plain, shared)
    # a plan that shares nothing changes nothing either
    none, _ = _plan([None] * 6, page, members, max_chunks=3)
    assert torch.equal(plain, paged_attention_triton(q, kc, vc, cu, sl, bt, 1, exact=True, shared=none))


@pytest.mark.parametrize("dtype,splits", [(torch.float32, None), (torch.bfloat16, 1), (torch.float32, 3)])
def test_fast_shared_prefix_decode_matches(dtype, splits):
    hq, hkv, dh, page = 4, 2, 16, 16
    (q, kc, vc, cu, sl, bt), keys = _group_case([4, 2], 200, [3, 60, 1, 20, 9, 100], page, hq, hkv, dh, dtype,
                                                seed=3)
    plan, n = _plan(keys, page, 4, max_chunks=3)
    assert n == 2
    gold = paged_attention_ref(q.double(), kc.double(), vc.double(), cu, sl, bt, 1)
    plain = paged_attention_triton(q, kc, vc, cu, sl, bt, 1, num_splits=splits)
    shared = paged_attention_triton(q, kc, vc, cu, sl, bt, 1, num_splits=splits, shared=plan)
    err_plain = (plain.double() - gold).abs().max().item()
    err = (shared.double() - gold).abs().max().item()
    u = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}[dtype]
    assert err <= 2 * err_plain + 4 * u * gold.abs().max().item(), (err, err_plain)


def test_chunk_too_large_for_the_tile_is_refused():
    (q, kc, vc, cu, sl, bt), keys = _group_case([2], 64, [1, 2], 16, 4, 2, 16, torch.float32)
    plan, _ = _plan(keys, 16, 64, max_chunks=1)
    with pytest.raises(ValueError, match="shared-prefix chunk"):
        paged_attention_triton(q, kc, vc, cu, sl, bt, 1, shared=plan)


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [False, True])
def test_cuda_qwen3_decode_shape(exact):
    # 32 prompts of 250 x 8 completions at ~100 generated tokens: the GRPO bench's shape
    hq, hkv, dh, page = 16, 8, 128, 16
    outs = [int(x) for x in torch.randint(1, 200, (256,), generator=torch.Generator().manual_seed(1))]
    (q, kc, vc, cu, sl, bt), keys = _group_case([8] * 32, 250, outs, page, hq, hkv, dh, torch.bfloat16, seed=2)
    members = shared_prefix_members(hq, hkv, exact=exact, itemsize=2)
    plan, n = _plan(keys, page, members, max_chunks=128)
    assert n == 32
    plain = paged_attention_triton(q, kc, vc, cu, sl, bt, 1, exact=exact)
    shared = paged_attention_triton(q, kc, vc, cu, sl, bt, 1, exact=exact, shared=plan)
    if exact:
        assert torch.equal(plain, shared)
    else:
        gold = paged_attention_ref(q.double(), kc.double(), vc.double(), cu, sl, bt, 1)
        err_plain = (plain.double() - gold).abs().max().item()
        err = (shared.double() - gold).abs().max().item()
        assert err <= 2 * err_plain + 4 * 2.0**-8 * gold.abs().max().item(), (err, err_plain)


def test_sharing_pays_when_it_fills_the_gpu_or_outgrows_l2(monkeypatch):
    import types

    import rlfuse.engine.step.shared_prefix as pa
    monkeypatch.setattr(pa, "num_sms", lambda d: 132)  # an H100's
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(L2_cache_size=50 << 20))
    cuda, kv = torch.device("cuda"), 2 * 8 * 128 * 2  # Qwen3-0.6B: one layer's K/V of a key
    assert not pa.shared_prefix_pays(8, 8 * 128, 8, kv, cuda)  # the GRPO step bench: 8 prompts of 128
    assert pa.shared_prefix_pays(32, 32 * 192, 8, kv, cuda)  # 32 prompts x 8: 256 programs
    assert pa.shared_prefix_pays(8, 8 * 2048, 8, kv, cuda)  # 8 prompts of 2048: 64 MiB > L2
    assert pa.shared_prefix_pays(1, 64, 8, kv, torch.device("cpu")) and not pa.shared_prefix_pays(0, 0, 8, kv, cuda)
