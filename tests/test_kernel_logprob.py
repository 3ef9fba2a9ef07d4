"""Fused linear log-prob (Triton, interpreter on CPU) against the float64 gold result
`token_logprobs_ref(h.double(), w.double(), ...)`: forward, entropy, both gradients, odd
sizes, strided inputs, per-row temperatures, poisoned buffers, batch invariance.

    python -m pytest -q tests/test_kernel_logprob.py

Tolerances (max abs error / max |gold|, or abs for the forward):
  forward  every dtype: the gold uses the same bf16/fp16 input values, products are exact
           in fp32 and only fp32 accumulation and exp/log rounding remain -> 2e-5 abs
           (|logp| <~ 10 here: ~20 fp32 ulps).
  grads    fp32 2e-5 relative; bf16 / fp16 8e-3 / 1.5e-3 relative (measured 2.7e-3 / 3e-4): dz is stored in the input
           dtype (2^-9 / 2^-12 relative per element, the interpreter truncates bf16
           instead of rounding) and dH / dW are rounded to it.
"""

import pytest
import torch

from rlfuse.kernels import use_backend
from rlfuse.kernels.loss.logprob import _inv_temperature, token_logprobs, token_logprobs_ref
from rlfuse.kernels.loss.triton_logprob import Tiles, token_logprobs_bwd_triton, token_logprobs_fwd_triton

_FWD_ATOL = 2e-5
_GRAD_RTOL = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1.5e-3}
_SMALL = Tiles(block_n=16, block_v=16, block_d=16, split_v=32, group=4, num_warps=4, num_stages=1)


def _inputs(N, D, V, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, D, generator=g) * scale).to(dtype)
    w = (torch.randn(V, D, generator=g) * (2.0 / D ** 0.5)).to(dtype)
    y = torch.randint(0, V, (N,), generator=g)
    return h, w, y


def _temps(kind, N):
    if kind == "float":
        return 0.7
    return 0.4 + torch.rand(N, generator=torch.Generator().manual_seed(N))  # per row in [0.4, 1.4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,D,V", [(1, 33, 97), (37, 80, 1031)])
@pytest.mark.parametrize("temp", ["float", "tensor"])
def test_forward_vs_gold(dtype, N, D, V, temp):
    h, w, y = _inputs(N, D, V, dtype, seed=N + V)
    T = _temps(temp, N)
    with use_backend("triton"):
        logp, ent = token_logprobs(h, w, y, T, return_entropy=True)
    gold_lp, gold_ent = token_logprobs_ref(h.double(), w.double(), y, T, return_entropy=True)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == (N,)
    assert (logp.double() - gold_lp).abs().max() < _FWD_ATOL
    assert (ent.double() - gold_ent).abs().max() < _FWD_ATOL
    with use_backend("triton"):
        assert torch.equal(token_logprobs(h, w, y, T), logp)  # without entropy: same log-probs


def test_fold_modes_bitwise_and_multi_split():
    """Many splits and groups (small tiles, last group partly past the vocab): one program
    per split (fold=1) and one per group (fold=group) give bitwise the same rows."""
    N, D, V = 21, 40, 301  # 10 splits of 32 -> 3 groups of 4; D not a multiple of 16
    h, w, y = _inputs(N, D, V, torch.float32, seed=3, scale=3.0)
    inv_t = _inv_temperature(_temps("tensor", N), N, h.device)
    a = token_logprobs_fwd_triton(h, w, y, inv_t, True, tiles=_SMALL, fold=1)
    b = token_logprobs_fwd_triton(h, w, y, inv_t, True, tiles=_SMALL, fold=_SMALL.group)
    for x, z in zip(a, b):
        assert torch.equal(x, z)
    gold_lp, gold_ent = token_logprobs_ref(h.double(), w.double(), y, _temps("tensor", N), True)
    assert (a[0].double() - gold_lp).abs().max() < 4 * _FWD_ATOL  # logits ~ 3x larger here
    assert (a[1].double() - gold_ent).abs().max() < 4 * _FWD_ATOL


@pytest.mark.parametrize("tiles", [None, _SMALL])
def test_batch_invariance(tiles):
    N, D, V = 40, 48, 301
    h, w, y = _inputs(N, D, V, torch.bfloat16, seed=5)
    T = _temps("tensor", N)
    full = token_logprobs_fwd_triton(h, w, y, T.reciprocal(), True, tiles=tiles)
    for k in (1, 7, 17, 33):
        part = token_logprobs_fwd_triton(h[:k], w, y[:k], T[:k].reciprocal(), True, tiles=tiles)
        assert torch.equal(full[0][:k], part[0]) and torch.equal(full[1][:k], part[1])


def test_strided_inputs_bitwise():
    """A transposed hidden (copied to unit element stride) and a column slice of a wider
    weight (read in place, row stride D + 5) give bitwise the contiguous results."""
    N, D, V = 19, 72, 517
    h, w, y = _inputs(N, D, V, torch.float32, seed=7)
    h_t = h.t().contiguous().t()  # (N, D) with strides (1, N)
    w_s = torch.cat([w, torch.randn(V, 5)], 1)[:, :D]
    assert not h_t.is_contiguous() and not w_s.is_contiguous()
    with use_backend("triton"):
        a = token_logprobs(h, w, y, 1.3, True)
        b = token_logprobs(h_t, w_s, y, 1.3, True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _grad_case(dtype, N, D, V, temp, use_logp=True, use_ent=True, chunk_rows=None, slice_v=None, strided=False,
               seed=11):
    h, w, y = _inputs(N, D, V, dtype, seed=seed)
    if strided:
        h = h.t().contiguous().t()
    T = _temps(temp, N)
    g = torch.Generator().manual_seed(seed + 1)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)

    def run(fn, hh, ww):
        hh, ww = hh.detach().requires_grad_(), ww.detach().requires_grad_()
        lp, ent = fn(hh, ww)
        loss = (lp * g_lp.to(lp.dtype)).sum() * use_logp + (ent * g_ent.to(ent.dtype)).sum() * use_ent
        loss.backward()
        return hh.grad, ww.grad

    if chunk_rows is None and slice_v is None:
        with use_backend("triton"):
            dh, dw = run(lambda a, b: token_logprobs(a, b, y, T, True), h, w)
    else:  # drive the backward directly to force several row chunks / vocab slices
        inv_t = _inv_temperature(T, N, h.device)
        _, ent, lse = token_logprobs_fwd_triton(h, w, y, inv_t, True)
        dh, dw = token_logprobs_bwd_triton(g_lp if use_logp else None, g_ent if use_ent else None, h, w, y,
                                           inv_t, lse, ent, chunk_rows=chunk_rows,
                                           slice_v=slice_v)
    gh, gw = run(lambda a, b: token_logprobs_ref(a, b, y, T, True), h.double(), w.double())
    assert dh.dtype == h.dtype and dw.dtype == w.dtype
    for ours, gold in ((dh, gh), (dw, gw)):
        rel = (ours.double() - gold).abs().max() / gold.abs().max()
        assert rel < _GRAD_RTOL[dtype], rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grads_vs_gold(dtype):
    _grad_case(dtype, 37, 80, 1031, "tensor")


@pytest.mark.parametrize("use_logp,use_ent", [(True, False), (False, True)])
def test_grads_one_output(use_logp, use_ent):
    _grad_case(torch.float32, 9, 33, 257, "float", use_logp=use_logp, use_ent=use_ent)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grads_row_chunks_strided(dtype):
    _grad_case(dtype, 45, 40, 301, "tensor", chunk_rows=16, strided=True)  # 3 chunks, last partial


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grads_vocab_slices_and_row_chunks(dtype):
    # 3 slices of 128 columns (last partial) x 3 row chunks (last partial): dW in fp32 per slice,
    # dH in fp32 across slices
    _grad_case(dtype, 45, 40, 301, "tensor", chunk_rows=16, slice_v=128)


def test_poisoned_buffers():
    N, D, V = 23, 40, 301
    h, w, y = _inputs(N, D, V, torch.float32, seed=13)
    inv_t = _inv_temperature(0.9, N, h.device)
    out = tuple(torch.full((N,), float("nan")) for _ in range(3))
    logp, ent, lse = token_logprobs_fwd_triton(h, w, y, inv_t, True, out=out)
    assert all(t is o for t, o in zip((logp, ent, lse), out))
    gold_lp, gold_ent = token_logprobs_ref(h.double(), w.double(), y, 0.9, True)
    assert (logp.double() - gold_lp).abs().max() < _FWD_ATOL and (ent.double() - gold_ent).abs().max() < _FWD_ATOL
    assert torch.allclose(lse.double(), torch.logsumexp(h.double() @ w.double().t() * float(inv_t), 1), atol=_FWD_ATOL)

    def nan_alloc(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    g = torch.randn(N)
    dh, dw = token_logprobs_bwd_triton(g, g, h, w, y, inv_t, lse, ent, chunk_rows=16, slice_v=128, alloc=nan_alloc)
    clean = token_logprobs_bwd_triton(g, g, h, w, y, inv_t, lse, ent, chunk_rows=16, slice_v=128)
    assert torch.equal(dh, clean[0]) and torch.equal(dw, clean[1])


def test_backend_switch_and_errors():
    h, w, y = _inputs(4, 16, 50, torch.float32)
    with use_backend("torch"):
        assert torch.equal(token_logprobs(h, w, y, 0.5), token_logprobs_ref(h, w, y, 0.5))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(h, w, y, 0.0)
    with use_backend("triton"), pytest.raises(ValueError, match="share a dtype"):
        token_logprobs(h.double(), w, y)
    with pytest.raises(ValueError, match="temperature tensor shape"):
        token_logprobs(h, w, y, torch.ones(3))
    with use_backend("triton"):
        assert token_logprobs(h[:0], w, y[:0]).shape == (0,)


def test_reference_temperature_is_fp32_reciprocal():
    """The reference multiplies by fp32(1/fp32(T)), exactly what the kernel uses."""
    h, w, y = _inputs(3, 16, 50, torch.float32)
    inv = torch.tensor(0.7, dtype=torch.float32).reciprocal()
    manual = torch.log_softmax(h @ w.t() * inv, -1).gather(1, y[:, None]).squeeze(1)
    assert torch.equal(token_logprobs_ref(h, w, y, 0.7), manual)
    assert torch.equal(token_logprobs_ref(h, w, y, torch.full((3,), 0.7)), manual)


@pytest.mark.gpu
def test_cuda_graph_capture_small_batch():
    h, w, y = (t.cuda() for t in _inputs(8, 256, 4099, torch.bfloat16))
    T = _temps("tensor", 8).cuda()
    ref = token_logprobs(h, w, y, T)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        token_logprobs(h, w, y, T)  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = token_logprobs(h, w, y, T)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
