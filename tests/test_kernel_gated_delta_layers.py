"""Gated DeltaNet's causal conv1d (prefill + decode update) and gated RMSNorm
(rlfuse.kernels.gated_delta.conv / gated_norm), both backends (Triton interpreted on
CPU): against transformers' functions, float64 gold and gradients; prefill vs update
bitwise; batch invariance.

    python -m pytest -q tests/test_kernel_gated_delta_layers.py
"""

import pytest
import torch

from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.gated_delta import (
    causal_conv1d,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
    gated_rmsnorm,
)

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
def test_gated_rmsnorm_reads_a_strided_z_without_a_copy_bitwise(backend):
    """z (T, H, D) as a column slice of a wider row (a fused in_proj GEMM's output): the
    same bits as a contiguous z, forward and gradients."""
    gen = torch.Generator().manual_seed(9)
    T, H, D = 7, 3, 20
    x = torch.randn(T, H, D, generator=gen).to(torch.bfloat16).requires_grad_()
    wide = torch.randn(T, 5 + H * D + 4, generator=gen).to(torch.bfloat16).requires_grad_()
    z_view = wide[:, 5:5 + H * D].view(T, H, D)  # row stride 5 + H D + 4, head stride D
    z = z_view.detach().contiguous().requires_grad_()
    w = (1 + 0.2 * torch.randn(D, generator=gen)).to(torch.bfloat16)
    dy = torch.randn(T, H, D, generator=gen).to(torch.bfloat16)
    with use_backend(backend), use_numerics("exact"):
        y_view, y = gated_rmsnorm(x, z_view, w, 1e-6), gated_rmsnorm(x, z, w, 1e-6)
        (dz_view,), (dz,) = torch.autograd.grad(y_view, [wide], dy), torch.autograd.grad(y, [z], dy)
    assert torch.equal(y_view, y)
    assert torch.equal(dz_view[:, 5:5 + H * D].view(T, H, D), dz) and not dz_view[:, :5].any()


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


# ------------------------------------------------------------ the decode update on a slot pool

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("numerics", ["exact", "fast"])
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("slots", [[2], [4, 0, 2, 6, 6]])  # B = 1; out of order, 2 padding rows on scratch 6
def test_conv_update_state_slots_update_the_pool_in_place(backend, numerics, dtype, pool_dtype, slots):
    """`state_slots`: each row shifts its slot of the pool in place. The real rows' outputs
    and slots are bitwise the update on the gathered states (the static decode step's
    former index_select / update / index_copy_), the other slots untouched, and the outputs
    against float64. Rows sharing the scratch slot are padding: not compared."""
    C, W, N = 13, 4, 7
    gen = torch.Generator().manual_seed(20 + len(slots))
    x = torch.randn(len(slots), C, generator=gen).to(dtype)
    w = (torch.randn(C, W, generator=gen) * 0.5).to(dtype)
    bias = (torch.randn(C, generator=gen) * 0.1).to(dtype)
    pool = torch.randn(N, C, W - 1, generator=gen).to(dtype).to(pool_dtype)  # values the update writes: x.dtype's
    before = pool.clone()
    real = [i for i, s in enumerate(slots) if slots.count(s) == 1]
    slot_t = torch.tensor(slots)
    with use_backend(backend), use_numerics(numerics):
        gathered = before[slot_t].to(dtype)
        y_ref = causal_conv1d_update(x, gathered, w, bias)
        y = causal_conv1d_update(x, pool, w, bias, state_slots=slot_t)
    assert y.dtype == dtype and torch.equal(y[real], y_ref[real])
    assert torch.equal(pool[slot_t[real]], gathered[real].to(pool_dtype))
    untouched = [s for s in range(N) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched])
    y64 = causal_conv1d_update_ref(x.double(), before[slot_t].double(), w.double(), bias.double(), exact=False)
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y[real].double(), y64[real], **tol)


def test_conv_update_state_slots_refuse_a_wrong_pool():
    x, w = torch.randn(2, 12), torch.randn(12, 4)
    with pytest.raises(ValueError, match=r"a pool \(N, C, W-1\) with \(C, W-1\) = \(12, 3\)"):
        causal_conv1d_update(x, torch.zeros(5, 12, 4), w, None, state_slots=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"state_slots must be \(B,\) = \(2,\) int64"):
        causal_conv1d_update(x, torch.zeros(5, 12, 3), w, None, state_slots=torch.tensor([0, 1], dtype=torch.int32))


@pytest.mark.gpu
def test_gpu_qwen35_2b_conv_update_state_slots():
    """Qwen3.5-2B widths (conv dim 2 * 16 * 128 + 16 * 128 = 6144, W = 4), bf16, 64 rows on
    out-of-order slots of a 80-slot pool: bitwise the gathered update, against float64."""
    C, W, N, B = 6144, 4, 80, 64
    gen = torch.Generator(device="cuda").manual_seed(21)
    x = torch.randn(B, C, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(C, W, device="cuda", generator=gen) * 0.5).bfloat16()
    pool = torch.randn(N, C, W - 1, device="cuda", generator=gen).bfloat16()
    slots = torch.randperm(N - 1, device="cuda", generator=gen)[:B]
    before = pool.clone()
    with use_backend("triton"), use_numerics("fast"):
        gathered = before[slots]
        y_ref = causal_conv1d_update(x, gathered, w, None)
        y = causal_conv1d_update(x, pool, w, None, state_slots=slots)
    assert torch.equal(y, y_ref) and torch.equal(pool[slots], gathered)
    keep = torch.ones(N, dtype=torch.bool, device="cuda")
    keep[slots] = False
    assert torch.equal(pool[keep], before[keep])
    y64 = causal_conv1d_update_ref(x.double(), before[slots].double(), w.double(), None, exact=False)
    torch.testing.assert_close(y.double(), y64, rtol=1e-2, atol=1e-2)
