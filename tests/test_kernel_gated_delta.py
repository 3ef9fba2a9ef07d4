"""The chunked gated delta rule (rlfuse.kernels.gated_delta.chunk): the chunked algorithm
against the token-by-token float64 oracle and transformers' torch functions, gradients
against float64, and the exactness contract (the engine's S_c + buffer procedure gives
the whole-sequence call's bits) on the torch exact reference and the Triton kernel
(interpreted on CPU).

    python -m pytest -q tests/test_kernel_gated_delta.py
"""

import random

import pytest
import torch

from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.gated_delta import (
                                        CHUNK,
                                        chunk_gated_delta_decode,
                                        chunk_gated_delta_rule,
                                        chunk_gated_delta_rule_ref,
                                        fused_recurrent_gated_delta_rule,
                                        recurrent_gated_delta_rule_ref,
)

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


@pytest.fixture
def split_wide(monkeypatch):
    """Wide heads through autograd take the Dk-split backward (off by default until it has run
    on a GPU: triton_chunk_bwd.SPLIT_WIDE_HEADS); the one-kernel form is compared with it in
    tests/test_kernel_gated_delta_bwd.py."""
    from rlfuse.kernels.gated_delta import triton_chunk_bwd
    monkeypatch.setattr(triton_chunk_bwd, "SPLIT_WIDE_HEADS", True)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _inputs(lens, *, Hk=2, Hv=4, Dk=16, Dv=8, dtype=torch.float32, seed=0, state=True):
    """Raw inputs as the layer makes them: q/k/v unnormalized, g = -exp(A) softplus(.) <= 0,
    beta = sigmoid(.) in v's dtype, an fp32 initial state."""
    gen = torch.Generator().manual_seed(seed)
    T, B = sum(lens), len(lens)
    q = torch.randn(T, Hk, Dk, generator=gen).to(dtype)
    k = torch.randn(T, Hk, Dk, generator=gen).to(dtype)
    v = torch.randn(T, Hv, Dv, generator=gen).to(dtype)
    g = -torch.rand(T, Hv, generator=gen) * 0.5
    beta = torch.rand(T, Hv, generator=gen).sigmoid().to(dtype)
    s0 = torch.randn(B, Hv, Dk, Dv, generator=gen) * 0.3 if state else None
    return q, k, v, g, beta, _cu(lens), s0


def _double(*ts):
    return [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in ts]


LENS = [70, 5, 130, 64, 1]


@pytest.mark.parametrize("exact", [False, True])
def test_chunked_equals_recurrent_float64(exact):
    q, k, v, g, beta, cu, s0 = _double(*_inputs(LENS))
    o_gold, _ = recurrent_gated_delta_rule_ref(q, k, v, g, beta, cu, initial_state=s0)
    o, S = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu, initial_state=s0, output_final_state=True,
                                      exact=exact)
    assert o.dtype == torch.float64
    torch.testing.assert_close(o, o_gold, rtol=0, atol=1e-12)
    cul = cu.tolist()
    for b, n in enumerate(LENS):  # the state after the last FULL chunk
        m = CHUNK * (n // CHUNK)
        sl = slice(cul[b], cul[b] + m)
        _, S_gold = recurrent_gated_delta_rule_ref(q[sl], k[sl], v[sl], g[sl], beta[sl], _cu([m]),
                                                   initial_state=s0[b:b + 1])
        torch.testing.assert_close(S[b], S_gold[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_per_sequence(dtype):
    q, k, v, g, beta, cu, s0 = _inputs(LENS, dtype=dtype, seed=1)
    o, S = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu, initial_state=s0, output_final_state=True,
                                      exact=False)
    cul = cu.tolist()
    tol = dict(rtol=0, atol=2e-5) if dtype == torch.float32 else dict(rtol=0, atol=3e-2)
    for b, n in enumerate(LENS):
        sl = slice(cul[b], cul[b + 1])
        args = [x[sl][None] for x in (q, k, v, g, beta)]
        for fn in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
            o_hf, S_hf = fn(*args, initial_state=s0[b:b + 1], output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
            assert o_hf.dtype == o.dtype
            torch.testing.assert_close(o[sl].float(), o_hf[0].float(), **tol)
            if n % CHUNK == 0:  # HF's final state is after the last token: equal to ours here
                torch.testing.assert_close(S[b], S_hf[0].float(), rtol=0, atol=2e-5)


def test_grouped_heads_and_scale_and_no_initial_state():
    q, k, v, g, beta, cu, _ = _double(*_inputs([90, 3], Hk=1, Hv=3, Dk=8, Dv=5, seed=2, state=False))
    o_gold, _ = recurrent_gated_delta_rule_ref(q, k, v, g, beta, cu, scale=0.7)
    with use_backend("torch"):
        o, S = chunk_gated_delta_rule(q, k, v, g, beta, cu, scale=0.7, output_final_state=True)
    torch.testing.assert_close(o, o_gold, rtol=0, atol=1e-12)
    _, S_gold = recurrent_gated_delta_rule_ref(q[:64], k[:64], v[:64], g[:64], beta[:64], _cu([64]), scale=0.7)
    torch.testing.assert_close(S[0], S_gold[0], rtol=0, atol=1e-12)
    assert torch.equal(S[1], torch.zeros_like(S[1]))  # 3 tokens: no full chunk, the zero start state


@pytest.mark.parametrize("exact", [False, True])
def test_gradients_against_float64(exact):
    lens = [67, 9]
    leaves = [t.requires_grad_() for t in _inputs(lens, Dk=8, Dv=4, seed=3)[:5]]
    cu, s0 = _cu(lens), _inputs(lens, Dk=8, Dv=4, seed=3)[6].requires_grad_()
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(sum(lens), 4, 4, generator=gen)
    dS = torch.randn(2, 4, 8, 4, generator=gen)

    def grads(args, fn):
        o, S = fn(*args)
        return torch.autograd.grad((o * do.to(o.dtype)).sum() + (S * dS.to(S.dtype)).sum(), args)

    ours = grads(leaves + [s0], lambda q, k, v, g, b, s: chunk_gated_delta_rule_ref(
        q, k, v, g, b, cu, initial_state=s, output_final_state=True, exact=exact))
    gold_leaves = [t.detach().double().requires_grad_() for t in leaves + [s0]]
    gold = grads(gold_leaves, lambda q, k, v, g, b, s: chunk_gated_delta_rule_ref(
        q, k, v, g, b, cu, initial_state=s, output_final_state=True, exact=False))
    for name, a, b in zip("q k v g beta s0".split(), ours, gold):
        assert a.dtype == torch.float32, name
        err = (a.double() - b).abs().max().item()
        assert err <= 1e-4 * (1 + b.abs().max().item()), (name, err)


def test_bad_shapes_are_value_errors():
    q, k, v, g, beta, cu, s0 = _inputs([5])
    with pytest.raises(ValueError, match="multiple of q/k heads"):
        chunk_gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3], cu)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu, initial_state=s0[:, :2])


# ------------------------------------------------------------------------------ exactness

def _other_batch(rng, dtype, Hk, Hv, Dk, Dv, max_len=150):
    """Random other sequences (0-2 of them, random lengths) to surround the target with."""
    lens = [rng.randint(1, max_len) for _ in range(rng.randint(0, 2))]
    return lens, _inputs(lens, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, dtype=dtype, seed=rng.randint(0, 10 ** 6)) if lens \
        else None


def _call_in_batch(target, s0, rng, dtype, dims, max_len=150):
    """chunk_gated_delta_rule over [others before] + target + [others after]: the target's
    o and final state."""
    before, after = _other_batch(rng, dtype, *dims, max_len), _other_batch(rng, dtype, *dims, max_len)
    parts, states, lens = [], [], []
    for lens_x, x in (before, (None, None), after):
        if lens_x is None and x is None:
            parts.append(target)
            states.append(s0[None])
            lens.append(target[0].shape[0])
        elif x is not None:
            parts.append(x[:5])
            states.append(x[6])
            lens += lens_x
    cat = [torch.cat([p[i] for p in parts]) for i in range(5)]
    o, S = chunk_gated_delta_rule(*cat, _cu(lens), initial_state=torch.cat(states), output_final_state=True)
    t0 = sum(lens[:len(before[0])])
    return o[t0:t0 + target[0].shape[0]], S[len(before[0])]


def _engine_procedure(seq, s0, steps, rng, dtype, dims, max_len):
    """What the engine does: keep S_c (the state at the last chunk boundary) and the buffer
    of tokens since; each step is one call over [buffer + new tokens] from S_c."""
    n = seq[0].shape[0]
    S_c, buf, p, outs = s0, 0, 0, []
    for s in steps:
        o, S = _call_in_batch([x[buf:p + s] for x in seq], S_c, rng, dtype, dims, max_len)
        outs.append(o[p - buf:])
        if (p + s - buf) // CHUNK:
            S_c, buf = S, buf + CHUNK * ((p + s - buf) // CHUNK)
        p += s
    assert p == n
    return torch.cat(outs)


def _schedule(n, rng):
    """Uneven prefill chunks then one-token decode steps, crossing chunk boundaries both ways."""
    steps, p = [], 0
    for s in (37, 50, 1, 1, 29):
        steps.append(s)
        p += s
    while p < n:
        s = 1 if rng.random() < 0.7 else rng.randint(2, 40)
        s = min(s, n - p)
        steps.append(s)
        p += s
    return steps


def check_engine_procedure(backend, dtype, n=200, seed=0, dims=(2, 4, 16, 8), steps=None, max_len=150):
    rng = random.Random(seed)
    q, k, v, g, beta, _, s0 = _inputs([n], Hk=dims[0], Hv=dims[1], Dk=dims[2], Dv=dims[3], dtype=dtype,
                                      seed=seed)
    seq = [q, k, v, g, beta]
    with use_backend(backend), use_numerics("exact"):
        whole, _ = _call_in_batch(seq, s0[0], rng, dtype, dims, max_len)
        eng = _engine_procedure(seq, s0[0], steps or _schedule(n, rng), rng, dtype, dims, max_len)
    assert eng.dtype == whole.dtype == dtype
    bad = (eng != whole).any(-1).any(-1).nonzero().flatten().tolist()
    assert not bad, f"tokens whose o differs bitwise: {bad[:10]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_engine_procedure_torch(dtype):
    check_engine_procedure("torch", dtype, n=150 if dtype == torch.bfloat16 else 200)


# a prefill piece ending on the chunk boundary at 64, single tokens, a piece straddling
# 128 (its state after the full chunk only must carry on), then tokens after it; the
# interpreter is slow: few calls
TRITON_STEPS = [37, 27, 1, 1, 9, 60, 1, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_engine_procedure_triton(dtype):
    check_engine_procedure("triton", dtype, n=sum(TRITON_STEPS), dims=(1, 2, 16, 8), steps=TRITON_STEPS,
                           max_len=70)


# ------------------------------------------------------------------------ the Triton kernel

_ATOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


def _no_worse(ours, ref, gold, dtype):
    err = (ours.double() - gold).abs().max().item()
    err_ref = (ref.double() - gold).abs().max().item()
    assert err <= 2 * err_ref + _ATOL[dtype], (err, err_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numerics", ["fast", "exact"])
@pytest.mark.parametrize("dims,lens,state", [((2, 4, 16, 8), [70, 5, 64], True),
                                             ((1, 3, 12, 10), [1, 66], False)])
def test_triton_forward_against_float64(dtype, numerics, dims, lens, state):
    Hk, Hv, Dk, Dv = dims
    q, k, v, g, beta, cu, s0 = _inputs(lens, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, dtype=dtype, seed=5, state=state)
    kw = dict(initial_state=s0, output_final_state=True)
    with use_numerics(numerics):
        with use_backend("triton"):
            o, S = chunk_gated_delta_rule(q, k, v, g, beta, cu, **kw)
        o_ref, S_ref = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu, **kw)
    gold = chunk_gated_delta_rule_ref(*_double(q, k, v, g, beta, cu), initial_state=None if s0 is None
                                      else s0.double(), output_final_state=True, exact=False)
    assert o.dtype == dtype and S.dtype == torch.float32 and S.shape == (len(lens), Hv, Dk, Dv)
    _no_worse(o, o_ref, gold[0], dtype)
    _no_worse(S, S_ref, gold[1], torch.float32)


@pytest.mark.parametrize("dims,lens,state,final", [((1, 2, 8, 4), [66, 4], True, True),
                                                   ((2, 4, 12, 40), [130, 64, 3], False, False),
                                                   ((1, 3, 16, 8), [64, 1], True, False),
                                                   ((1, 2, 8, 4), [5, 0, 66], True, True),  # an empty sequence
                                                   ((1, 2, 80, 72), [70, 3], True, True)])  # wide: split over Dk
def test_triton_backward_against_float64(dims, lens, state, final, split_wide):
    """The Triton backward (dq, dk, dv, dg, dbeta, d initial state) against float64
    gradients of the reference: no worse than the fp32 reference's own error. Heads over 64
    wide take the Dk-split kernels (tests/test_kernel_gated_delta_bwd.py), the others one."""
    Hk, Hv, Dk, Dv = dims
    q, k, v, g, beta, cu, s0 = _inputs(lens, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, seed=6, state=state)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)] + ([s0.requires_grad_()] if state else [])
    gen = torch.Generator().manual_seed(7)
    do, dS = torch.randn(sum(lens), Hv, Dv, generator=gen), torch.randn(len(lens), Hv, Dk, Dv, generator=gen)

    def grads(fn, xs):
        o, S = fn(*xs[:5], cu, initial_state=xs[5] if state else None, output_final_state=final)
        loss = (o * do.to(o.dtype)).sum() + ((S * dS.to(S.dtype)).sum() if final else 0)
        return torch.autograd.grad(loss, xs)

    with use_backend("triton"):
        ours = grads(chunk_gated_delta_rule, leaves)
    ref = grads(lambda *a, **kw: chunk_gated_delta_rule_ref(*a, **kw, exact=False), leaves)
    gold = grads(lambda *a, **kw: chunk_gated_delta_rule_ref(*a, **kw, exact=False),
                 [t.detach().double().requires_grad_() for t in leaves])
    for name, a, r, gd in zip("q k v g beta s0".split(), ours, ref, gold):
        assert a.dtype == r.dtype, name
        err = (a.double() - gd).abs().max().item()
        err_ref = (r.double() - gd).abs().max().item()
        assert err <= 4 * err_ref + 1e-5 * (1 + gd.abs().max().item()), (name, err, err_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("Dk,Dv", [(16, 8), (80, 72)])  # one kernel; split over Dk (wide)
def test_triton_backward_bf16(dtype, Dk, Dv, split_wide):
    lens = [70, 9]
    q, k, v, g, beta, cu, s0 = _inputs(lens, Hk=1, Hv=2, Dk=Dk, Dv=Dv, dtype=dtype, seed=8)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta, s0)]
    do = torch.randn(sum(lens), 2, Dv, generator=torch.Generator().manual_seed(9)).to(dtype)
    out = {}
    for backend in ("triton", "torch"):
        with use_backend(backend):
            o, _ = chunk_gated_delta_rule(*leaves[:5], cu, initial_state=leaves[5])
        out[backend] = torch.autograd.grad((o * do).sum(), leaves)
    gold = [t.detach().double().requires_grad_() for t in leaves]
    o, _ = chunk_gated_delta_rule_ref(*gold[:5], cu, initial_state=gold[5], exact=False)
    gold = torch.autograd.grad((o * do.double()).sum(), gold)
    for name, a, r, gd in zip("q k v g beta s0".split(), out["triton"], out["torch"], gold):
        assert a.dtype == r.dtype, name
        err = (a.double() - gd).abs().max().item()
        err_ref = (r.double() - gd).abs().max().item()
        assert err <= 2 * err_ref + 1e-2 * (1 + gd.abs().max().item()), (name, err, err_ref)


def _qwen35_inputs(lens, dtype, device):
    q, k, v, g, beta, cu, s0 = _inputs(lens, Hk=16, Hv=32, Dk=128, Dv=128, dtype=dtype, seed=9)
    return [x.to(device) for x in (q, k, v, g, beta, cu, s0)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_qwen35_shapes(dtype):
    """Qwen3.5 linear-attention shapes on the GPU: forward against float64, gradients."""
    lens = [1000, 37, 600]
    q, k, v, g, beta, cu, s0 = _qwen35_inputs(lens, dtype, "cuda")
    for numerics in ("fast", "exact"):
        with use_numerics(numerics), use_backend("triton"):
            o, S = chunk_gated_delta_rule(q, k, v, g, beta, cu, initial_state=s0, output_final_state=True)
        o_ref, S_ref = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu, initial_state=s0, output_final_state=True,
                                                  exact=False)
        gold = chunk_gated_delta_rule_ref(*_double(q, k, v, g, beta, cu), initial_state=s0.double(),
                                          output_final_state=True, exact=False)
        _no_worse(o, o_ref, gold[0], dtype)
        _no_worse(S, S_ref, gold[1], torch.bfloat16)  # tf32 dots for bf16 inputs, ieee for fp32


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_qwen35_backward_and_decode(dtype):
    """The Triton backward at Qwen3.5 shapes against float64 gradients (no worse than the
    reference in the same dtype, up to a small margin), and the recurrent decode step."""
    lens = [300, 64, 5]
    q, k, v, g, beta, cu, s0 = _qwen35_inputs(lens, dtype, "cuda")
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta, s0)]
    gen = torch.Generator(device="cuda").manual_seed(3)
    do = torch.randn(v.shape, device="cuda", generator=gen)
    dS = torch.randn(s0.shape, device="cuda", generator=gen)

    def grads(fn, xs):
        o, S = fn(*xs[:5], cu, initial_state=xs[5], output_final_state=True)
        return torch.autograd.grad((o * do.to(o.dtype)).sum() + (S * dS).sum(), xs)

    with use_backend("triton"):
        ours = grads(chunk_gated_delta_rule, leaves)
    ref = grads(lambda *a, **kw: chunk_gated_delta_rule_ref(*a, **kw, exact=False), leaves)
    gold = grads(lambda *a, **kw: chunk_gated_delta_rule_ref(*a, **kw, exact=False),
                 [t.detach().double().requires_grad_() for t in leaves])
    for name, a, r, gd in zip("q k v g beta s0".split(), ours, ref, gold):
        err = (a.double() - gd).abs().max().item()
        err_ref = (r.double() - gd).abs().max().item()
        assert err <= 4 * err_ref + 1e-2 * gd.abs().max().item(), (name, err, err_ref)
    # decode: one token per sequence from the states, in place
    q1, k1, v1, g1, b1, cu1, _ = _qwen35_inputs([1] * 3, dtype, "cuda")
    st = s0.detach().clone()
    with use_backend("triton"):
        o1, _ = fused_recurrent_gated_delta_rule(q1, k1, v1, g1, b1, cu1, initial_state=st, state_out=st)
    o_gold, S_gold = recurrent_gated_delta_rule_ref(*_double(q1, k1, v1, g1, b1, cu1), initial_state=s0.double())
    o_ref, _ = recurrent_gated_delta_rule_ref(q1, k1, v1, g1, b1, cu1, initial_state=s0.detach())
    _no_worse(o1, o_ref, o_gold, dtype)
    torch.testing.assert_close(st.double(), S_gold, rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_exact_engine_procedure(dtype):
    check_engine_procedure_gpu(dtype)


def check_engine_procedure_gpu(dtype):
    """The engine procedure at Qwen3.5 head shapes on the GPU (compiled kernels)."""
    n = 300
    q, k, v, g, beta, _, s0 = _qwen35_inputs([n], dtype, "cuda")
    seq = [q, k, v, g, beta]
    others = _qwen35_inputs([77, 130], dtype, "cuda")

    def call(x, s):  # the target between two other sequences whose lengths vary per call
        m = x[0].shape[0]
        cut = [len(x[0]) % 50 + 1, 130]
        parts = [[o[:cut[0]] for o in others[:5]], x, [o[77:77 + cut[1]] for o in others[:5]]]
        cat = [torch.cat([p[i] for p in parts]) for i in range(5)]
        cu = _cu([cut[0], m, cut[1]]).cuda()
        st = torch.stack([others[6][0], s, others[6][1]])
        o, S = chunk_gated_delta_rule(*cat, cu, initial_state=st, output_final_state=True)
        return o[cut[0]:cut[0] + m], S[1]

    with use_backend("triton"), use_numerics("exact"):
        whole, _ = call(seq, s0[0])
        S_c, buf, p, outs = s0[0], 0, 0, []
        for s in [100, 28, 1, 1, 1, 60, 45, 1, 1, 62]:
            o, S = call([x[buf:p + s] for x in seq], S_c)
            outs.append(o[p - buf:])
            if (p + s - buf) // CHUNK:
                S_c, buf = S, buf + CHUNK * ((p + s - buf) // CHUNK)
            p += s
    assert p == n
    assert torch.equal(torch.cat(outs), whole)


def check_decode_slots(backend, numerics, dims=(1, 2, 16, 8), device="cpu", dtype=torch.float32):
    """`chunk_gated_delta_decode` (the engine's exact decode step: the tails and S_c read in
    their slots, S_c written back in place only where the token completes the chunk) against
    the gather / mask / chunk call / select / scatter it replaces: the same outputs and the
    same pool, bitwise; the slots not stepped are untouched."""
    Hk, Hv, Dk, Dv = dims
    tails = torch.tensor([63, 10, 0, 62], device=device)  # rows before the token; 63: it completes the chunk
    slots = torch.tensor([4, 0, 2, 5], device=device)
    N = 6
    q, k, v, g, beta, _, _ = _inputs([CHUNK] * N, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, dtype=dtype, seed=21)
    tail = [x.reshape(N, CHUNK, *x.shape[1:]).to(device).contiguous() for x in (q, k, v, g, beta)]
    pool = (torch.randn(N, Hv, Dk, Dv, generator=torch.Generator().manual_seed(4)) * 0.3).to(device)
    B = len(slots)
    with use_backend(backend), use_numerics(numerics):
        valid = torch.arange(CHUNK, device=device)[None, :] <= tails[:, None]
        rows = [torch.where(valid.view(B, CHUNK, *[1] * (x.dim() - 2)), x[slots], 0.0).flatten(0, 1) for x in tail]
        o_all, s_full = chunk_gated_delta_rule(*rows, _cu([CHUNK] * B).to(device), initial_state=pool[slots],
                                               output_final_state=True)
        o_want = o_all.view(B, CHUNK, Hv, Dv)[torch.arange(B, device=device), tails]
        want = pool.clone()
        want[slots] = torch.where((tails == CHUNK - 1).view(-1, 1, 1, 1), s_full, pool[slots])
        got = pool.clone()
        o = chunk_gated_delta_decode(tail, got, slots, tails)
    assert torch.equal(o, o_want) and torch.equal(got, want)
    assert not torch.equal(got[4], pool[4]) and torch.equal(got[0], pool[0]) and torch.equal(got[1], pool[1])


@pytest.mark.parametrize("backend,numerics", [("torch", "exact"), ("triton", "exact"), ("triton", "fast")])
def test_decode_state_slots_equal_the_gathered_call_bitwise(backend, numerics):
    check_decode_slots(backend, numerics)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_decode_state_slots_equal_the_gathered_call_bitwise(dtype):
    check_decode_slots("triton", "exact", dims=(16, 32, 128, 128), device="cuda", dtype=dtype)


# ------------------------------------------------------------ the fast-numerics decode path

@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_decode_against_float64(backend, dtype):
    lens = [3, 1, 9]
    q, k, v, g, beta, cu, s0 = _inputs(lens, Hk=1, Hv=3, Dk=12, Dv=40, dtype=dtype, seed=11)
    o_gold, S_gold = recurrent_gated_delta_rule_ref(*_double(q, k, v, g, beta, cu), initial_state=s0.double())
    o_ref, S_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, cu, initial_state=s0)
    state = s0.clone()
    with use_backend(backend):
        o, S = fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu, initial_state=state, state_out=state)
    assert S is state and o.dtype == dtype  # the in-place decode step
    _no_worse(o, o_ref, o_gold, dtype)
    _no_worse(S, S_ref.float(), S_gold, torch.float32)
    # one token per sequence from the returned state continues the recurrence
    q2, k2, v2, g2, beta2, _, _ = _inputs([1, 1, 1], Hk=1, Hv=3, Dk=12, Dv=40, dtype=dtype, seed=12)
    with use_backend(backend):
        o2, _ = fused_recurrent_gated_delta_rule(q2, k2, v2, g2, beta2, _cu([1, 1, 1]), initial_state=S.clone())
    both = [torch.cat([p for b in range(3) for p in (x.split(lens)[b], y[b:b + 1])]) for x, y in
            zip((q, k, v, g, beta), (q2, k2, v2, g2, beta2))]
    o_all, _ = recurrent_gated_delta_rule_ref(*_double(*both), _cu([n + 1 for n in lens]), initial_state=s0.double())
    last = torch.tensor([n for n in torch.tensor([n + 1 for n in lens]).cumsum(0) - 1])
    torch.testing.assert_close(o2.double(), o_all[last], rtol=0, atol=2e-6 if dtype == torch.float32 else 2e-2)


def test_recurrent_decode_refuses_exact_numerics():
    q, k, v, g, beta, cu, s0 = _inputs([2])
    with use_numerics("exact"), pytest.raises(ValueError, match="fast-numerics decode path"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu, initial_state=s0)


@pytest.mark.parametrize("Dk,Dv", [(16, 8), (80, 72)])  # the one-kernel backward; the Dk-split one
def test_triton_strided_views_as_the_layer_passes_them(Dk, Dv, split_wide):
    """q, k, v as views of one projection output (the layer splits in_proj_qkv's columns):
    the same forward bits as contiguous copies, and the same gradients."""
    Hk, Hv, lens = 1, 2, [70, 3]
    T = sum(lens)
    gen = torch.Generator().manual_seed(13)
    mixed = torch.randn(T, 2 * Hk * Dk + Hv * Dv, generator=gen).requires_grad_()
    _, _, _, g, beta, cu, s0 = _inputs(lens, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, seed=13)
    do = torch.randn(T, Hv, Dv, generator=gen)

    def run(split):
        q, k, v = split(mixed)
        with use_backend("triton"):
            o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu, initial_state=s0)
        return o, torch.autograd.grad((o * do).sum(), mixed)[0]

    views = lambda m: [x.reshape(T, -1, d) for x, d in zip(m.split([Hk * Dk, Hk * Dk, Hv * Dv], -1),  # noqa: E731
                                                            (Dk, Dk, Dv))]
    o_v, g_v = run(views)
    assert not views(mixed)[0].is_contiguous()
    o_c, g_c = run(lambda m: [x.contiguous() for x in views(m)])
    assert torch.equal(o_v, o_c)
    torch.testing.assert_close(g_v, g_c, rtol=1e-6, atol=1e-6)
