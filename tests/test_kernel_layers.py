"""RMSNorm, RoPE and SwiGLU Triton kernels (interpreter on CPU) against float64 gold and
the PyTorch references: forward, every gradient, odd shapes, strided inputs, batch
invariance.

    python -m pytest -q tests/test_kernel_layers.py

Tolerances: the kernel's error against the float64 gold result may be at most
`2 * (reference error) + atol[dtype]`, i.e. no worse than the reference in the same
dtype up to a rounding or two (atol: a few ulps at the tested magnitudes).
"""

import pytest
import torch

from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.activation.glu import swiglu, swiglu_ref
from rlfuse.kernels.backend import triton_ops
from rlfuse.kernels.norm.rms import offset_rmsnorm, offset_rmsnorm_ref, rmsnorm, rmsnorm_ref
from rlfuse.kernels.rope.rotary import rope, rope_inv_freq, rope_ref

_ATOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _no_worse(ours, ref, gold, dtype, scale=1.0):
    err = (ours.double() - gold).abs().max().item()
    err_ref = (ref.double() - gold).abs().max().item()
    assert err <= 2 * err_ref + _ATOL[dtype] * scale, (err, err_ref)


def _grads(fn, inputs, dy):
    """Gradients of <fn(*inputs), dy> w.r.t. the inputs that require grad."""
    out = fn(*inputs)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return out, torch.autograd.grad(out, leaves, dy.to(out.dtype))


def _gold_leaves(*ts):
    return [t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
            and t.is_floating_point() else t for t in ts]


# --------------------------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("D", [64, 100])
def test_rmsnorm_forward_backward(dtype, D):
    g = torch.Generator().manual_seed(D)
    # rows of a wider buffer: a non-unit row stride the kernel reads in place
    x = (torch.randn(3, 13, D + 3, generator=g) * 2)[..., :D].to(dtype).requires_grad_()
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(3, 13, D, generator=g)
    with use_backend("triton"):
        y, (dx, dw) = _grads(lambda a, b: rmsnorm(a, b, 1e-6), (x, w), dy)
    y_ref, (dx_ref, dw_ref) = _grads(lambda a, b: rmsnorm_ref(a, b, 1e-6), (x, w), dy)
    y_gold, (dx_gold, dw_gold) = _grads(lambda a, b: rmsnorm_ref(a, b, 1e-6), _gold_leaves(x, w), dy.double())
    assert y.dtype == y_ref.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    _no_worse(y, y_ref, y_gold, dtype, scale=4)
    _no_worse(dx, dx_ref, dx_gold, dtype, scale=4)
    _no_worse(dw, dw_ref, dw_gold, dtype, scale=40)  # dw sums 39 rows


@pytest.mark.parametrize("dtype", _DTYPES)
def test_rmsnorm_dw_sum_over_many_partials(dtype, monkeypatch):
    """The dw partials summed in several steps and column blocks (shrunk: the CPU run has
    at most 32 partials, under one step of the default 64), D not a multiple of a block."""
    from rlfuse.kernels.norm import triton_rms as R
    monkeypatch.setattr(R, "_DW_ROWS", 4)
    monkeypatch.setattr(R, "_DW_COLS", 16)
    g = torch.Generator().manual_seed(7)
    D = 40
    x = torch.randn(200, D, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(200, D, generator=g)
    with use_backend("triton"):
        _, (dx, dw) = _grads(lambda a, b: rmsnorm(a, b, 1e-6), (x, w), dy)
    _, (dx_ref, dw_ref) = _grads(lambda a, b: rmsnorm_ref(a, b, 1e-6), (x, w), dy)
    _, (dx_gold, dw_gold) = _grads(lambda a, b: rmsnorm_ref(a, b, 1e-6), _gold_leaves(x, w), dy.double())
    _no_worse(dw, dw_ref, dw_gold, dtype, scale=200)  # dw sums 200 rows
    _no_worse(dx, dx_ref, dx_gold, dtype, scale=4)


def test_rmsnorm_fp32_weight_bf16_input_and_exactness():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=g).bfloat16()
    w = 1 + 0.3 * torch.randn(96, generator=g)
    with use_backend("triton"):
        y = rmsnorm(x, w, 1e-5)
        y16 = rmsnorm(x, w.bfloat16(), 1e-5)
    assert y.dtype == torch.float32  # torch promotion of (fp32 weight, bf16 normalized row)
    torch.testing.assert_close(y, rmsnorm_ref(x, w, 1e-5), rtol=1e-6, atol=1e-6)
    # bf16 throughout: the same roundings as the reference; a flip needs an fp32 ulp tie
    assert (y16 != rmsnorm_ref(x, w.bfloat16(), 1e-5)).float().mean() < 0.01


@pytest.mark.parametrize("numerics", ["exact", "fast"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [40, 100])  # a per-head width below 128 (q/k norm) and a wide tile
def test_offset_rmsnorm_one_kernel_equals_the_composition_bitwise(numerics, dtype, D):
    """Qwen3.5's offset RMSNorm without a gradient (the engine's step): one Triton kernel,
    with and without the residual add, gives the composition's bits (rmsnorm kernel on
    x.float() with weight 1 + w.float(), cast to x.dtype; h + x in x.dtype), in both
    numerics, on strided rows; within rounding of float64. With a gradient the op takes
    the composition (its autograd)."""
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(3, 7, D + 3, generator=g) * 2)[..., :D].to(dtype)  # non-unit row stride
    h = torch.randn(3, 7, D, generator=g).to(dtype)
    w = (0.3 * torch.randn(D, generator=g)).to(dtype)
    one = triton_ops("norm.triton_rms").offset_rmsnorm  # the op runs it in fast numerics only (yet)
    with use_backend("triton"), use_numerics(numerics), torch.no_grad():
        y = one(x, w, 1e-6, None)
        s, y_add = one(x, w, 1e-6, h)
        assert torch.equal(offset_rmsnorm(x, w, 1e-6), y)  # the op: the kernel (fast) or the composition
        y_ref = offset_rmsnorm_ref(x, w, 1e-6)
        s_ref = h + x
        y_add_ref = offset_rmsnorm_ref(s_ref, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape and torch.equal(y, y_ref)
    assert torch.equal(s, s_ref) and torch.equal(y_add, y_add_ref)
    gold = offset_rmsnorm_ref(x.double(), w.double(), 1e-6)
    torch.testing.assert_close(y.double(), gold, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
    wg = w.clone().requires_grad_()
    with use_backend("triton"), use_numerics(numerics):
        yg = offset_rmsnorm(x, wg, 1e-6)
        assert yg.grad_fn is not None and torch.equal(yg.detach(), y_ref)


def test_rmsnorm_batch_invariant():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(45, 128, generator=g).bfloat16()  # q_norm shape: several rows a program
    w = torch.randn(128, generator=g).bfloat16()
    with use_backend("triton"):
        full = rmsnorm(x, w, 1e-6)
        for k in (1, 7, 33):
            assert torch.equal(full[:k], rmsnorm(x[:k], w, 1e-6))


# ------------------------------------------------------------------------------------ RoPE

def _rope_gold(x, positions, inv_freq):
    """float64 rotation by the contract's fp32 angles."""
    ang = (positions.float()[:, None] * inv_freq.float()[None, :]).double()
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("Dh,scaling", [(64, None), (32, {"rope_type": "llama3", "factor": 8.0,
                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64})])
def test_rope_forward_backward(dtype, Dh, scaling):
    g = torch.Generator().manual_seed(Dh)
    T, H = 21, 3
    inv_freq = rope_inv_freq(Dh, 10000.0, scaling)
    positions = torch.randint(0, 100000, (T,), generator=g)  # large angles too
    # a (T, H, Dh) view of a fused projection output: strided over tokens
    x = torch.randn(T, 2 * H * Dh, generator=g)[:, : H * Dh].view(T, H, Dh).to(dtype).requires_grad_()
    dy = torch.randn(T, H, Dh, generator=g)
    with use_backend("triton"):
        y, (dx,) = _grads(lambda a: rope(a, positions, inv_freq), (x,), dy)
    y_ref, (dx_ref,) = _grads(lambda a: rope_ref(a, positions, inv_freq), (x,), dy)
    y_gold, (dx_gold,) = _grads(lambda a: _rope_gold(a, positions, inv_freq), _gold_leaves(x), dy.double())
    assert y.dtype == dtype and dx.dtype == dtype and y.shape == x.shape
    _no_worse(y, y_ref, y_gold, dtype, scale=4)
    _no_worse(dx, dx_ref, dx_gold, dtype, scale=4)


def test_rope_batch_invariant_and_int32_positions():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 4, 64, generator=g).bfloat16()
    pos = torch.randint(0, 5000, (37,), generator=g)
    inv = rope_inv_freq(64, 1e6)
    with use_backend("triton"):
        full = rope(x, pos, inv)
        assert torch.equal(full, rope(x, pos.int(), inv))
        for k in (1, 16, 20):
            assert torch.equal(full[:k], rope(x[:k], pos[:k], inv))


# ---------------------------------------------------------------------------------- SwiGLU

@pytest.mark.parametrize("dtype", _DTYPES)
def test_swiglu_forward_backward(dtype):
    g = torch.Generator().manual_seed(3)
    gate = (torch.randn(37, 129, generator=g) * 3).to(dtype).requires_grad_()
    up = torch.randn(37, 129, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(37, 129, generator=g)
    with use_backend("triton"):
        y, (dg, du) = _grads(swiglu, (gate, up), dy)
    y_ref, (dg_ref, du_ref) = _grads(swiglu_ref, (gate, up), dy)
    y_gold, (dg_gold, du_gold) = _grads(swiglu_ref, _gold_leaves(gate, up), dy.double())
    assert y.dtype == dg.dtype == du.dtype == dtype
    _no_worse(y, y_ref, y_gold, dtype, scale=8)
    _no_worse(dg, dg_ref, dg_gold, dtype, scale=8)
    _no_worse(du, du_ref, du_gold, dtype, scale=8)
    if dtype != torch.float32:  # same roundings as eager PyTorch
        assert (y != y_ref).float().mean() < 0.01


def test_swiglu_batch_invariant_and_shape_check():
    g = torch.Generator().manual_seed(4)
    gate, up = torch.randn(2, 50, 96, generator=g).bfloat16().unbind(0)
    with use_backend("triton"):
        full = swiglu(gate, up)
        assert torch.equal(full[:13], swiglu(gate[:13], up[:13]))
        with pytest.raises(ValueError, match="shape"):
            swiglu(gate, up[:, :10])


@pytest.mark.gpu
@pytest.mark.parametrize("numerics", ["exact", "fast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_offset_rmsnorm_one_kernel_equals_the_composition_bitwise(numerics, dtype):
    """Qwen3.5-2B widths (hidden 2048, attention head 256, linear-attention head 128), 256
    rows (a decode batch) and 4099: the one-kernel offset RMSNorm (with and without the
    residual add) is bitwise the composition the trainer runs (the exact engine's rollouts
    equal the trainer's only if it is)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    for D in (2048, 256, 128):
        for N in (256, 4099):
            x = (torch.randn(N, D, device="cuda", generator=g) * 3).to(dtype)
            h = torch.randn(N, D, device="cuda", generator=g).to(dtype)
            w = (0.3 * torch.randn(D, device="cuda", generator=g)).to(dtype)
            one = triton_ops("norm.triton_rms").offset_rmsnorm  # the kernel itself, also in exact
            with use_backend("triton"), use_numerics(numerics), torch.no_grad():
                y, (s, y_add) = one(x, w, 1e-6, None), one(x, w, 1e-6, h)
                assert torch.equal(y, offset_rmsnorm_ref(x, w, 1e-6)), (D, N)
                assert torch.equal(s, h + x) and torch.equal(y_add, offset_rmsnorm_ref(h + x, w, 1e-6)), (D, N)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_qwen3_shapes(dtype):
    """Qwen3-0.6B sizes on the GPU: forward and gradients no worse than eager."""
    g = torch.Generator(device="cuda").manual_seed(0)
    T = 1024
    x = (torch.randn(T, 1024, device="cuda", generator=g) * 3).to(dtype).requires_grad_()
    w = (1 + 0.2 * torch.randn(1024, device="cuda", generator=g)).to(dtype).requires_grad_()
    q = torch.randn(T, 16, 128, device="cuda", generator=g).to(dtype).requires_grad_()
    gate = (torch.randn(T, 3072, device="cuda", generator=g) * 3).to(dtype).requires_grad_()
    up = torch.randn(T, 3072, device="cuda", generator=g).to(dtype).requires_grad_()
    pos = torch.randint(0, 100000, (T,), device="cuda", generator=g)
    inv = rope_inv_freq(128, 1e6).cuda()
    rms_ref = lambda a, b: rmsnorm_ref(a, b, 1e-6)  # noqa: E731
    cases = [(lambda a, b: rmsnorm(a, b, 1e-6), rms_ref, rms_ref, (x, w), 32),  # dw ~ sqrt(T)
             (lambda a: rope(a, pos, inv), lambda a: rope_ref(a, pos, inv),
              lambda a: _rope_gold(a, pos, inv), (q,), 4),
             (swiglu, swiglu_ref, swiglu_ref, (gate, up), 8)]
    for op, ref, gold_fn, inputs, scale in cases:
        dy = torch.randn(ref(*inputs).shape, device="cuda", generator=g)
        with use_backend("triton"):
            y, grads = _grads(op, inputs, dy)
        y_ref, grads_ref = _grads(ref, inputs, dy)
        y_gold, grads_gold = _grads(gold_fn, _gold_leaves(*inputs), dy.double())
        for a, b, c in zip([y, *grads], [y_ref, *grads_ref], [y_gold, *grads_gold]):
            _no_worse(a, b, c, dtype, scale=scale)
