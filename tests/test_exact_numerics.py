"""Exact numerics: every op of the forward gives a row the same bits whatever the batch.

Kernel level (both backends: the exact PyTorch references, and the Triton kernels under
the CPU interpreter): batch invariance `op(x)[:k] == op(x[:k])`, the two launch plans of
the exact linear, paged (decode and chunked prefill) == varlen attention bitwise, and
closeness to float64 gold (exact mode must still compute the right function).
Engine level: tests/test_exact_engine.py.
Run: python -m pytest -q tests/test_exact_numerics.py
"""

import pytest
import torch
import torch.nn.functional as F

from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.activation.glu import swiglu
from rlfuse.kernels.attention.paged import paged_attention
from rlfuse.kernels.attention.varlen import attend_exact_ref, varlen_attention
from rlfuse.kernels.invariant import matmul_nt, pairwise_sum, pointwise
from rlfuse.kernels.linear.gemm import linear, linear_exact_ref
from rlfuse.kernels.linear.triton_gemm import linear_exact_triton
from rlfuse.kernels.loss.logprob import token_logprobs
from rlfuse.kernels.norm.rms import rmsnorm
from rlfuse.kernels.rope.rotary import rope, rope_inv_freq

BACKENDS = ("torch", "triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs interpreted on CPU


def _g(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ invariant helpers
def test_pairwise_sum_ignores_trailing_zero_padding():
    x = torch.randn(7, 37, generator=_g(0))
    a = pairwise_sum(x, -1)
    for extra in (1, 27, 91):  # padded to 64, 64, 128 entries
        b = pairwise_sum(torch.cat([x, torch.zeros(7, extra)], -1), -1)
        assert torch.equal(a, b)
    torch.testing.assert_close(a.double(), x.double().sum(-1), rtol=1e-6, atol=1e-5)


def test_pointwise_result_depends_on_the_element_only():
    x = torch.randn(1003, generator=_g(1)) * 8
    for fn in (torch.exp2, torch.sigmoid, F.silu, torch.exp, torch.cos):
        full = pointwise(fn, x)
        for off, n in ((0, 1), (3, 17), (5, 100), (64, 33), (999, 4)):
            assert torch.equal(pointwise(fn, x[off:off + n]), full[off:off + n]), fn
        torch.testing.assert_close(full, fn(x), rtol=2e-7, atol=0)


def test_matmul_nt_rows_do_not_depend_on_the_batch():
    a, b = torch.randn(50, 72, generator=_g(2)), torch.randn(33, 72, generator=_g(3))
    full = matmul_nt(a, b)
    for k in (1, 2, 3, 17):
        assert torch.equal(matmul_nt(a[:k], b), full[:k])
        assert torch.equal(matmul_nt(a[k:k + 1], b), full[k:k + 1])
    torch.testing.assert_close(full.double(), a.double() @ b.double().t(), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ linear
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_exact_linear_triton_plans_agree_and_are_batch_invariant(dtype, bias):
    M, K, N = 70, 600, 48  # K spans 3 chunks of 256 (fp32) / 2 of 512 (16-bit), with a ragged tail
    x = torch.randn(M, K, generator=_g(4)).to(DEV, dtype)
    w = (torch.randn(N, K, generator=_g(5)) / K**0.5).to(DEV, dtype)
    b = torch.randn(N, generator=_g(6)).to(DEV, dtype) if bias else None
    fused = linear_exact_triton(x, w, b, plan="fused")
    assert torch.equal(linear_exact_triton(x, w, b, plan="split"), fused)
    assert torch.equal(linear_exact_triton(x, w, b, plan="split_last"), fused)
    for k in (1, 5, 33):
        assert torch.equal(linear_exact_triton(x[:k], w, b, plan="split"), fused[:k])
        assert torch.equal(linear_exact_triton(x[:k], w, b, plan="split_last"), fused[:k])
        assert torch.equal(linear_exact_triton(x[k:], w, b, plan="fused"), fused[k:])
    gold = F.linear(x.double(), w.double(), None if b is None else b.double())
    err = (fused.double() - gold).abs().max().item()
    ref_err = (F.linear(x, w, b).double() - gold).abs().max().item()
    assert err <= 2 * ref_err + 1e-6, (err, ref_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_linear_tile_families_agree_bitwise(dtype):
    """The 16-bit path picks its tile family from M (narrow for decode, wide for training);
    that is exact only if a tile's height and width leave an element's accumulation order
    alone: the families must agree bitwise, in both plans, across the M threshold."""
    from rlfuse.kernels.linear.triton_gemm import DECODE_ROWS, EXACT_BLOCK_K, EXACT_CHUNK_K

    narrow = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=EXACT_BLOCK_K, CHUNK_K=EXACT_CHUNK_K, num_warps=4, num_stages=3)
    wide = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=EXACT_BLOCK_K, CHUNK_K=EXACT_CHUNK_K, num_warps=8, num_stages=3)
    M, N, K = DECODE_ROWS + 44, 200, 1100  # ragged in every dimension
    x = torch.randn(M, K, generator=_g(20)).to(DEV, dtype)
    w = (torch.randn(N, K, generator=_g(21)) / K**0.5).to(DEV, dtype)
    a = linear_exact_triton(x, w, tiles=wide, plan="fused")
    assert torch.equal(linear_exact_triton(x, w, tiles=narrow, plan="fused"), a)
    assert torch.equal(linear_exact_triton(x, w, tiles=narrow, plan="split"), a)
    assert torch.equal(linear_exact_triton(x, w, tiles=narrow, plan="split_last"), a)
    if dtype == torch.bfloat16:  # the automatic choice on both sides of the threshold
        for k in (1, 64, DECODE_ROWS, DECODE_ROWS + 1):
            assert torch.equal(linear_exact_triton(x[:k], w), a[:k])


def test_exact_linear_reference_is_batch_invariant_and_close():
    x, w, b = torch.randn(40, 96, generator=_g(7)), torch.randn(24, 96, generator=_g(8)), torch.randn(24)
    full = linear_exact_ref(x, w, b)
    for k in (1, 2, 7):
        assert torch.equal(linear_exact_ref(x[:k], w, b), full[:k])
    torch.testing.assert_close(full, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_linear_gradients_are_torch_linear_gradients(backend):
    dev = DEV if backend == "triton" else "cpu"
    x = torch.randn(9, 64, generator=_g(9)).to(dev).requires_grad_()
    w = torch.randn(16, 64, generator=_g(10)).to(dev).requires_grad_()
    b = torch.randn(16, generator=_g(11)).to(dev).requires_grad_()
    dy = torch.randn(9, 16, generator=_g(12)).to(dev)
    with use_backend(backend), use_numerics("exact"):
        y = linear(x, w, b)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    y_ref = F.linear(x, w, b)
    ref = torch.autograd.grad(y_ref, (x, w, b), dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ attention
def _paged_from_dense(k, v, page=16, extra=5, seed=13):
    """Scatter one sequence's dense K/V (L, Hkv, Dh) into a shuffled paged cache."""
    L = k.shape[0]
    n = (L + page - 1) // page
    blocks = torch.randperm(n + extra, generator=_g(seed))[:n]
    kc = torch.full((n + extra, page, *k.shape[1:]), float("nan"), dtype=k.dtype)
    vc = kc.clone()
    for i in range(L):
        kc[blocks[i // page], i % page] = k[i]
        vc[blocks[i // page], i % page] = v[i]
    return kc, vc, blocks.to(torch.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_paged_attention_equals_varlen_bitwise(backend, dtype):
    """Decode (one query), chunked prefill (a few queries at the end) and a second sequence
    in the batch: every query row equals the packed varlen forward's row bitwise."""
    L, hq, hkv, dh = 150, 4, 2, 16  # keys span 3 KV tiles of 64
    g = _g(14)
    q = torch.randn(L, hq, dh, generator=g).to(dtype)
    k = torch.randn(L, hkv, dh, generator=g).to(dtype)
    v = torch.randn(L, hkv, dh, generator=g).to(dtype)
    q2, k2, v2 = (t[:40].flip(0).contiguous() for t in (q, k, v))  # another sequence (40 tokens)
    kc, vc, blocks = _paged_from_dense(k, v)
    kc2, vc2, blocks2 = _paged_from_dense(k2, v2, seed=15)
    # both sequences' pages in one cache
    dev = DEV if backend == "triton" else "cpu"
    q, k, v, q2, k2, v2, kc, vc, kc2, vc2 = (t.to(dev) for t in (q, k, v, q2, k2, v2, kc, vc, kc2, vc2))
    kc_all, vc_all = torch.cat([kc, kc2]), torch.cat([vc, vc2])
    tables = torch.full((2, blocks.numel()), 0, dtype=torch.int32)
    tables[0] = blocks
    tables[1, :blocks2.numel()] = blocks2 + kc.shape[0]
    tables = tables.to(dev)
    with use_backend(backend), use_numerics("exact"):
        packed = varlen_attention(torch.cat([q, q2]), torch.cat([k, k2]), torch.cat([v, v2]),
                                  torch.tensor([0, L, L + 40], dtype=torch.int32, device=dev), L)
        for q_len in (1, 7, 64):  # decode; a chunk of 7; a chunk of 64 (a whole query tile)
            for pos_end in (L, 129, 64):  # the sequence's cache length at this step
                qs = torch.cat([q[pos_end - q_len:pos_end], q2[-1:]])
                cu = torch.tensor([0, q_len, q_len + 1], dtype=torch.int32, device=dev)
                seq_lens = torch.tensor([pos_end, 40], dtype=torch.int32, device=dev)
                out = paged_attention(qs, kc_all, vc_all, cu, seq_lens, tables, q_len)
                assert torch.equal(out[:q_len], packed[pos_end - q_len:pos_end]), (q_len, pos_end)
                assert torch.equal(out[q_len:], packed[L + 39:L + 40])
    if backend == "torch":  # the reference computes attention itself: check it against gold once
        gold = attend_exact_ref(q.double(), k.double(), v.double(), torch.arange(L), dh ** -0.5)[0]
        ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
                                             v.repeat_interleave(2, 1).transpose(0, 1), is_causal=True)
        err = (packed[:L].double() - gold).abs().max().item()
        assert err <= 2 * (ref.transpose(0, 1).double() - gold).abs().max().item() + 1e-6


# ------------------------------------------------------------------ the other ops
@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_row_ops_are_batch_invariant(backend):
    dev = DEV if backend == "triton" else "cpu"
    g = _g(16)
    T, D, V = 37, 64, 100
    x = torch.randn(T, D, generator=g)
    w = torch.rand(D, generator=g) + 0.5
    qk = torch.randn(T, 2, 16, generator=g)
    pos = torch.randint(0, 300, (T,), generator=g)
    inv = rope_inv_freq(16, 10000.0)
    gate, up = torch.randn(T, 96, generator=g) * 4, torch.randn(T, 96, generator=g)
    W = torch.randn(V, D, generator=g) / 8
    tgt = torch.randint(0, V, (T,), generator=g)
    x, w, qk, pos, inv, gate, up, W, tgt = (t.to(dev) for t in (x, w, qk, pos, inv, gate, up, W, tgt))
    ops = [lambda s: rmsnorm(x[s], w, 1e-6), lambda s: rope(qk[s], pos[s], inv),
           lambda s: swiglu(gate[s], up[s]), lambda s: token_logprobs(x[s], W, tgt[s], 0.7)]
    with use_backend(backend), use_numerics("exact"):
        for op in ops:
            full = op(slice(None))
            for s in (slice(0, 1), slice(3, 4), slice(5, 22), slice(30, None)):
                assert torch.equal(op(s), full[s])
    with use_backend("torch"):  # exact mode computes the same functions as fast mode
        with use_numerics("exact"):
            exact = [op(slice(None)) for op in ops]
        for e, f in zip(exact, [op(slice(None)) for op in ops]):
            torch.testing.assert_close(e, f, rtol=2e-5, atol=2e-5)


def test_exact_refuses_a_gqa_group_larger_than_its_tile():
    """Issue 32: exact numerics refuses at engine start a shape it cannot keep bitwise (a GQA
    group of query heads taller than the exact attention tile), naming the fields; the torch
    backend (exact at any group) and fast numerics take it."""
    from rlfuse.engine import LLM, EngineConfig
    from rlfuse.model import CausalLM, ModelConfig

    cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=64, num_key_value_heads=1, head_dim=16, qk_norm=True,
                      max_position_embeddings=64)
    model = CausalLM(cfg)
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
    with use_backend("triton"), pytest.raises(ValueError, match="num_attention_heads 64 over num_key_value_heads 1"):
        LLM(model, config=EngineConfig(numerics="exact", max_num_seqs=2))
    with use_backend("torch"):
        LLM(model, config=EngineConfig(numerics="exact", max_num_seqs=2))
    with use_backend("triton"):
        LLM(model, config=EngineConfig(numerics="fast", max_num_seqs=2, enforce_eager=True))
