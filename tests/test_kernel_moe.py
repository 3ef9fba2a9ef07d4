"""MoE kernels (rlfuse.kernels.moe): routing, the token-to-expert sort, the grouped GEMM,
gather/combine and the whole experts MLP, on both backends (Triton under the CPU
interpreter) and both numerics, against float64 gold: forward, every gradient, odd
shapes (rows not a multiple of a tile, experts that receive no token), and batch
invariance in exact numerics (a token's output and its routing do not depend on the
rest of the batch).

    python -m pytest -q tests/test_kernel_moe.py
"""

import pytest
import torch
import torch.nn.functional as F

from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.linear import linear, linear_exact_ref
from rlfuse.kernels.linear.triton_gemm import linear_exact_triton
from rlfuse.kernels.moe import (
    Routing,
    combine,
    experts_mlp,
    gather_rows,
    grouped_linear,
    route,
    sort_by_expert,
    topk_softmax,
)
from rlfuse.kernels.moe.triton_grouped_gemm import tile_table

SETTINGS = [("torch", "fast"), ("torch", "exact"), ("triton", "fast"), ("triton", "exact")]
_TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _close(ours, gold, dtype, scale=1.0):
    err = (ours.double() - gold.double()).abs().max().item()
    ref = gold.abs().max().item()
    assert err <= _TOL[dtype] * scale * max(1.0, ref), (err, ref)


def _routing(experts: torch.Tensor, E: int, weights=None) -> Routing:
    order, offsets, slot_pos = sort_by_expert(experts, E)
    if weights is None:
        weights = torch.rand(experts.shape, generator=_g(99))
    return Routing(weights, experts, order, offsets, slot_pos)


# ------------------------------------------------------------------------------ routing

def _gold_routing(logits, experts, norm):
    p = torch.softmax(logits.double(), -1)
    v = p.gather(1, experts)
    return v / v.sum(-1, keepdim=True) if norm else v


@pytest.mark.parametrize("backend,numerics", SETTINGS)
@pytest.mark.parametrize("E,k,norm", [(7, 3, True), (8, 2, False), (5, 5, True), (16, 4, True)])
def test_routing_topk_softmax_and_gradient(backend, numerics, E, k, norm):
    g = _g(E * 10 + k)
    logits = (torch.randn(11, E, generator=g) * 2).requires_grad_()
    dw = torch.randn(11, k, generator=g)
    with use_backend(backend), use_numerics(numerics):
        w, experts = topk_softmax(logits, k, norm)
    assert w.dtype == torch.float32 and experts.dtype == torch.int64 and w.shape == experts.shape == (11, k)
    gold_idx = torch.sort(logits.detach().double(), dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(experts, gold_idx)
    gl = logits.detach().double().requires_grad_()
    gold = _gold_routing(gl, gold_idx, norm)
    torch.testing.assert_close(w.double(), gold, rtol=1e-6, atol=1e-7)
    (dl,) = torch.autograd.grad(w, logits, dw)
    (dl_gold,) = torch.autograd.grad(gold, gl, dw.double())
    torch.testing.assert_close(dl.double(), dl_gold, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend,numerics", SETTINGS)
def test_routing_ties_go_to_the_lower_expert(backend, numerics):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0], [0.0, -1.0, 5.0, -1.0, 5.0]])
    with use_backend(backend), use_numerics(numerics):
        _, experts = topk_softmax(logits, 2, True)
    assert experts.tolist() == [[1, 2], [0, 1], [2, 4]]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_routing_bf16_logits(backend):
    logits = torch.randn(9, 12, generator=_g(3)).bfloat16()
    with use_backend(backend), use_numerics("exact"):
        w, experts = topk_softmax(logits, 4, True)
    gold = _gold_routing(logits, experts, True)
    torch.testing.assert_close(w.double(), gold, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("k", [0, 6, True, 2.0])
def test_routing_rejects_a_bad_top_k(k):
    with pytest.raises(ValueError, match=r"top-k must be an integer in \[1, num_experts = 5\]"):
        topk_softmax(torch.randn(3, 5), k, True)


def test_sort_by_expert_is_stable_and_skips_empty_experts():
    experts = torch.tensor([[3, 0], [0, 5], [3, 1], [5, 0]])
    order, offsets, slot_pos = sort_by_expert(experts, 7)
    # pairs t*k + j grouped by expert, in pair order within an expert
    assert order.tolist() == [1, 2, 7, 5, 0, 4, 3, 6]
    assert offsets.tolist() == [0, 3, 4, 4, 6, 6, 8, 8]  # experts 2, 4 and 6 get no token
    assert torch.equal(order[slot_pos.view(-1)], torch.arange(8))
    assert torch.equal(experts.view(-1)[order], torch.tensor([0, 0, 0, 1, 3, 3, 5, 5]))


def test_tile_table_covers_every_row_once():
    offsets = torch.tensor([0, 5, 5, 40, 41, 41])  # experts 1 and 4 empty
    tile_e, row0 = tile_table(offsets, 41, 16)
    seen = []
    for e, r in zip(tile_e.tolist(), row0.tolist()):
        if e >= 0:
            seen += [(e, row) for row in range(r, min(r + 16, offsets[e + 1].item()))]
    assert sorted(seen) == [(e, row) for e in range(5) for row in range(offsets[e], offsets[e + 1])]


# -------------------------------------------------------------------------- grouped GEMM

def _grouped_gold(x, w, offsets):
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    for e in range(w.shape[0]):
        a, b = offsets[e].item(), offsets[e + 1].item()
        y[a:b] = x[a:b] @ w[e].t()
    return y


@pytest.mark.parametrize("backend,numerics", SETTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_forward_backward(backend, numerics, dtype):
    g = _g(5)
    E, N, K = 5, 45, 70
    counts = torch.tensor([7, 0, 33, 1, 0])  # 41 rows: not a tile multiple; experts 1 and 4 empty
    offsets = F.pad(counts.cumsum(0), (1, 0))
    x = torch.randn(41, K, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(E, N, K, generator=g) * 0.2).to(dtype).requires_grad_()
    dy = torch.randn(41, N, generator=g).to(dtype)
    with use_backend(backend), use_numerics(numerics):
        y = grouped_linear(x, w, offsets)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    gx, gw = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    gy = _grouped_gold(gx, gw, offsets)
    gdx, gdw = torch.autograd.grad(gy, (gx, gw), dy.double())
    _close(y, gy, dtype)
    _close(dx, gdx, dtype)
    _close(dw, gdw, dtype, scale=4)  # dW sums up to 33 rows
    assert torch.equal(dw[1], torch.zeros_like(dw[1])) and torch.equal(dw[4], torch.zeros_like(dw[4]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_exact_equals_the_exact_linear_per_expert(backend, dtype):
    """Exact numerics: each expert's rows carry the bits of `linear(rows, W[e])`, however many
    rows the expert has and wherever they sit."""
    g = _g(6)
    E, N, K = 3, 37, 600  # K over one 512-column chunk: the chunked order is exercised
    offsets = torch.tensor([0, 9, 9, 22])
    x = torch.randn(22, K, generator=g).to(dtype)
    w = (torch.randn(E, N, K, generator=g) * 0.1).to(dtype)
    dense = linear_exact_triton if backend == "triton" else linear_exact_ref
    with use_backend(backend), use_numerics("exact"):
        y = grouped_linear(x, w, offsets)
        for e in range(E):
            a, b = offsets[e].item(), offsets[e + 1].item()
            assert torch.equal(y[a:b], dense(x[a:b], w[e]))
            for r in range(a, b, 4):  # one row alone in its expert
                assert torch.equal(grouped_linear(x[r:r + 1], w, torch.tensor([0] * (e + 1) + [1] * (E - e))),
                                   y[r:r + 1])


def test_grouped_linear_rejects_bad_shapes():
    x, w = torch.randn(4, 8), torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="offsets must be int64"):
        grouped_linear(x, w, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"expected x \(M, K\) and weight \(E, N, K\)"):
        grouped_linear(x, torch.randn(2, 5, 9), torch.tensor([0, 1, 4]))


# ------------------------------------------------------------------------ gather/combine

@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_combine_forward_backward(backend, dtype):
    g = _g(8)
    T, k, E, D = 10, 3, 6, 33
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g).requires_grad_()
    r = _routing(experts, E, weights)
    x = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    scale = (1 + torch.arange(T * k, dtype=torch.float32)[:, None] / 7).to(dtype)  # rows differ per slot
    dout = torch.randn(T, D, generator=g).to(dtype)
    with use_backend(backend):
        xs = gather_rows(x, r)
        out = combine(xs * scale, r)
        dx, dwt = torch.autograd.grad(out, (x, weights), dout)
    assert torch.equal(xs, x[r.order // k])
    gx, gwt = x.detach().double().requires_grad_(), weights.detach().double().requires_grad_()
    ys = gx[r.order // k] * scale.double()
    gold = (gwt[:, :, None] * ys[r.slot_pos]).sum(1)
    gdx, gdwt = torch.autograd.grad(gold, (gx, gwt), dout.double())
    _close(out, gold, dtype, scale=2)
    _close(dx, gdx, dtype, scale=4)
    _close(dwt, gdwt, dtype, scale=4)


def test_combine_rejects_a_wrong_row_count():
    r = _routing(torch.tensor([[0, 1], [1, 2]]), 3)
    with pytest.raises(ValueError, match=r"ys must be \(T k, N\) with T k = 4 rows"):
        combine(torch.randn(3, 5), r)


# --------------------------------------------------------------------------- experts MLP

def _moe(x, router, gate_up, down, k):
    r = route(linear(x, router), k, True)
    return experts_mlp(x, gate_up, down, r), r


def _moe_gold(x, router, gate_up, down, experts):
    """float64, every expert on every token, the routed ones kept (experts fixed: the routing's)."""
    logits = x @ router.t()
    w = _gold_routing(logits, experts, True)
    I = down.shape[2]
    h = torch.einsum("td,end->ten", x, gate_up)
    a = F.silu(h[..., :I]) * h[..., I:]
    y = torch.einsum("tei,edi->ted", a, down)  # (T, E, D)
    return (w[:, :, None] * y.gather(1, experts[:, :, None].expand(-1, -1, y.shape[2]))).sum(1)


def _weights(g, E, D, I, dtype):
    router = torch.randn(E, D, generator=g) * 0.5
    gate_up = torch.randn(E, 2 * I, D, generator=g) * 0.15
    down = torch.randn(E, D, I, generator=g) * 0.15
    return [t.to(dtype).requires_grad_() for t in (router, gate_up, down)]


@pytest.mark.parametrize("backend,numerics", SETTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_mlp_against_float64_gold_with_gradients(backend, numerics, dtype):
    g = _g(11)
    T, D, I, E, k = 19, 48, 40, 7, 3
    x = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    params = _weights(g, E, D, I, dtype)
    dout = torch.randn(T, D, generator=g).to(dtype)
    with use_backend(backend), use_numerics(numerics):
        out, r = _moe(x, *params, k)
        grads = torch.autograd.grad(out, [x, *params], dout)
    gold_in = [t.detach().double().requires_grad_() for t in (x, *params)]
    gold = _moe_gold(*gold_in, r.experts)
    gold_grads = torch.autograd.grad(gold, gold_in, dout.double())
    _close(out, gold, dtype, scale=2)
    for ours, ref in zip(grads, gold_grads):
        _close(ours, ref, dtype, scale=8)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_mlp_is_batch_invariant_in_exact_numerics(backend, dtype):
    """A token's output and routing depend on the token alone: a prefix of the batch, a
    permutation of it and a batch of other tokens around it give the same bits."""
    g = _g(12)
    T, D, I, E, k = 21, 40, 24, 6, 2
    x = torch.randn(T, D, generator=g).to(dtype)
    params = [p.detach() for p in _weights(g, E, D, I, dtype)]
    other = torch.randn(9, D, generator=g).to(dtype)
    perm = torch.randperm(T, generator=g)
    with use_backend(backend), use_numerics("exact"):
        full, r = _moe(x, *params, k)
        for n in (1, 5, 16):
            part, rp = _moe(x[:n], *params, k)
            assert torch.equal(part, full[:n]) and torch.equal(rp.experts, r.experts[:n])
        assert torch.equal(_moe(x[perm], *params, k)[0], full[perm])
        mixed, _ = _moe(torch.cat([other, x[3:8], other[:2]]), *params, k)
        assert torch.equal(mixed[9:14], full[3:8])


def test_grouped_linear_tile_family_keeps_the_bits():
    """bf16: a batch whose experts average over 256 rows runs the wide tile family; its
    rows still carry the bits of the narrow family (a few rows alone)."""
    g = _g(13)
    x = torch.randn(300, 64, generator=g).bfloat16()
    w = (torch.randn(1, 40, 64, generator=g) * 0.1).bfloat16()
    with use_backend("triton"), use_numerics("exact"):
        wide = grouped_linear(x, w, torch.tensor([0, 300]))
        for r in (0, 131, 299):
            assert torch.equal(grouped_linear(x[r:r + 1], w, torch.tensor([0, 1])), wide[r:r + 1])
