"""Gated DeltaNet's causal conv1d (prefill + decode update) and gated RMSNorm
(rlfuse.kernels.gated_delta.conv / gated_norm), both backends (Triton interpreted on
CPU): against transformers' functions, float64 gold and gradients; prefill vs update
bitwise; batch invariance.

    python -m pytest -q tests/test_kernel_gated_delta_layers.py
"""

import pytest
import torch

from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.gated_delta import causal_conv1d, causal_conv1d_ref, causal_conv1d_update, gated_rmsnorm

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

BACKENDS = ("torch", "triton")


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _conv_inputs(lens, C=12, W=4, dtype=torch.float32, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), C, generator=gen).to(dtype)
    w = (torch.randn(C, W, generator=gen) * 0.5).to(dtype)
    b = (torch.randn(C, generator=gen) * 0.1).to(dtype) if bias else None
    s0 = torch.randn(len(lens), C, W - 1, generator=gen).to(dtype)
    return x, w, b, s0


LENS = [7, 1, 2, 20, 3]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_prefill_matches_transformers(backend, dtype, activation):
    x, w, _, _ = _conv_inputs(LENS, dtype=dtype)
    with use_backend(backend):
        y, state = causal_conv1d(x, w, None, _cu(LENS), activation=activation)
    assert y.dtype == dtype and state.shape == (len(LENS), 12, 3) and state.is_contiguous()  # updated in place later
    cu = _cu(LENS).tolist()
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for b, n in enumerate(LENS):
        xs = x[cu[b]:cu[b + 1]].T[None]  # (1, C, n)
        y_hf = hf.causal_conv1d_fn(xs, w, None, activation=activation)
        torch.testing.assert_close(y[cu[b]:cu[b + 1]], y_hf[0].T, **tol)
        # the conv state: the last W-1 inputs, zero-padded on the left (no initial state)
        want = torch.nn.functional.pad(xs[0], (max(0, 3 - n), 0))[:, -3:]
        assert torch.equal(state[b], want)


# torch's fast CPU silu rounds a tensor's SIMD tail differently: fast torch is not bitwise
@pytest.mark.parametrize("backend,exact", [("torch", "exact"), ("triton", "exact"), ("triton", "fast")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_equals_update_bitwise(backend, exact, dtype):
    """The engine prefills part of a sequence, then decodes token by token with the
    update: every token's y equals the one-call prefill's, bitwise; so does the state."""
    x, w, bias, s0 = _conv_inputs(LENS, dtype=dtype, seed=1)
    cu = _cu(LENS).tolist()
    with use_backend(backend), use_numerics(exact):
        y, state = causal_conv1d(x, w, bias, _cu(LENS), initial_state=s0)
        for b, n in enumerate(LENS):
            p = n // 2  # prefill p tokens of sequence b alone, then decode the rest
            y_p, st = causal_conv1d(x[cu[b]:cu[b] + p], w, bias, _cu([p]), initial_state=s0[b:b + 1])
            assert torch.equal(y_p, y[cu[b]:cu[b] + p])
            st = st.clone()
            for t in range(cu[b] + p, cu[b + 1]):
                # decode in a batch of 3 rows (the target in the middle) to check row independence
                rows = torch.stack([x[t] * 0.5, x[t], x[t] + 1])
                sts = torch.cat([st * 2, st, st - 1])
                y_t = causal_conv1d_update(rows, sts, w, bias)
                assert torch.equal(y_t[1], y[t]), (b, t)
                st = sts[1:2].clone()
            assert torch.equal(st[0], state[b])


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_update_matches_transformers(backend):
    x, w, bias, s0 = _conv_inputs([1, 1, 1], seed=2)
    st, st_hf = s0.clone(), s0.clone()
    with use_backend(backend):
        y = causal_conv1d_update(x, st, w, bias)
    y_hf = hf.causal_conv1d_update(x[:, :, None], st_hf, w, bias, "silu")[..., 0]
    torch.testing.assert_close(y, y_hf, rtol=0, atol=1e-6)
    assert torch.equal(st, st_hf)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation,bias", [("silu", True), (None, False)])
def test_conv_gradients_against_float64(backend, activation, bias):
    """dx, dweight, dbias, d initial_state, with a gradient on the returned conv state too
    (sequences shorter than W - 1 included)."""
    x, w, b, s0 = _conv_inputs(LENS, seed=3, bias=bias)
    leaves = [t.requires_grad_() for t in (x, w, b, s0) if t is not None]
    cu = _cu(LENS)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    ds = torch.randn(s0.shape, generator=torch.Generator().manual_seed(6))

    def grads(args, fn):
        xx, ww, *rest = args
        y, st = fn(xx, ww, rest[0] if bias else None, rest[-1])
        return torch.autograd.grad((y * dy.to(y.dtype)).sum() + (st * ds.to(st.dtype)).sum(), args)

    with use_backend(backend):
        ours = grads(leaves, lambda a, b_, c, d: causal_conv1d(a, b_, c, cu, initial_state=d, activation=activation))
    gold = grads([t.detach().double().requires_grad_() for t in leaves],
                 lambda a, b_, c, d: causal_conv1d_ref(a, b_, c, cu, initial_state=d, activation=activation))
    for name, a, g in zip(["x", "w", "bias", "s0"] if bias else ["x", "w", "s0"], ours, gold):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), g, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rmsnorm_matches_transformers(backend, dtype):
    gen = torch.Generator().manual_seed(7)
    D = 24
    x = (torch.randn(5, 3, D, generator=gen) * 3).to(dtype)
    z = torch.randn(5, 3, D, generator=gen).to(dtype)
    m = hf.Qwen3_5RMSNormGated(D, eps=1e-6).to(dtype)
    with torch.no_grad():
        m.weight.copy_(1 + 0.2 * torch.randn(D, generator=gen))
    with use_backend(backend):
        y = gated_rmsnorm(x, z, m.weight, 1e-6)
    y_hf = m(x, z)
    assert y.dtype == y_hf.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y, y_hf, rtol=0, atol=2e-6)
    else:  # at most one bf16 rounding apart
        torch.testing.assert_close(y.float(), y_hf.float(), rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gated_rmsnorm_gradients_and_batch_invariance(backend):
    gen = torch.Generator().manual_seed(8)
    D = 20
    N = 300  # more rows than one backward program's dw partial covers
    x = torch.randn(N, D, generator=gen).requires_grad_()
    z = torch.randn(N, D, generator=gen).requires_grad_()
    w = (1 + 0.2 * torch.randn(D, generator=gen)).requires_grad_()
    dy = torch.randn(N, D, generator=gen)
    with use_backend(backend), use_numerics("exact"):
        y = gated_rmsnorm(x, z, w, 1e-6)
        for k in (1, 4):
            assert torch.equal(gated_rmsnorm(x[:k], z[:k], w, 1e-6), y[:k])
        ours = torch.autograd.grad((y * dy).sum(), (x, z, w))
    gl = [t.detach().double().requires_grad_() for t in (x, z)]
    m = hf.Qwen3_5RMSNormGated(D, eps=1e-6).double()
    with torch.no_grad():
        m.weight.copy_(w.detach())
    gold = torch.autograd.grad((m(gl[0], gl[1]) * dy.double()).sum(), (gl[0], gl[1], m.weight))
    for name, a, b in zip(["x", "z", "w"], ours, gold):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_qwen35_conv_and_norm(dtype):
    """Qwen3.5 sizes on the GPU (conv channels 2 * 16 * 128 + 32 * 128, W = 4; norm D = 128):
    conv prefill == decode update bitwise, both against the references; gradients."""
    lens = [300, 1, 77]
    x, w, _, s0 = _conv_inputs(lens, C=8192, dtype=dtype, seed=10, bias=False)
    x, w, s0 = x.cuda(), w.cuda(), s0.cuda()
    cu = _cu(lens).cuda()
    with use_backend("triton"), use_numerics("exact"):
        y, st = causal_conv1d(x, w, None, cu, initial_state=s0)
        y_p, st_p = causal_conv1d(x[:299], w, None, _cu([299]).cuda(), initial_state=s0[:1])
        y_t = causal_conv1d_update(x[299:300], st_p.clone(), w, None)
    assert torch.equal(y_p, y[:299]) and torch.equal(y_t[0], y[299])
    y_ref, st_ref = causal_conv1d_ref(x, w, None, cu, initial_state=s0, exact=False)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(st, st_ref)
    xs = torch.randn(4096, 32, 128, device="cuda").to(dtype).requires_grad_()
    zs = torch.randn(4096, 32, 128, device="cuda").to(dtype).requires_grad_()
    ws = (1 + 0.1 * torch.randn(128, device="cuda")).to(dtype).requires_grad_()
    with use_backend("triton"):
        yn = gated_rmsnorm(xs, zs, ws, 1e-6)
        for k in (1, 5):
            assert torch.equal(gated_rmsnorm(xs[:k], zs[:k], ws, 1e-6), yn[:k])
    m = hf.Qwen3_5RMSNormGated(128, eps=1e-6).to(device="cuda", dtype=dtype)
    with torch.no_grad():
        m.weight.copy_(ws)
    tol = dict(rtol=1.6e-2, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1.3e-6, atol=2e-6)  # a few fp32 ulps: HF sums the square in another order
    torch.testing.assert_close(yn.float(), m(xs, zs).float(), **tol)
