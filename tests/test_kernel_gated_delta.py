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
                                        chunk_gated_delta_rule,
                                        chunk_gated_delta_rule_ref,
                                        recurrent_gated_delta_rule_ref,
)

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


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

def _other_batch(rng, dtype, Hk, Hv, Dk, Dv):
    """Random other sequences (0-3 of them, random lengths) to surround the target with."""
    lens = [rng.randint(1, 150) for _ in range(rng.randint(0, 3))]
    return lens, _inputs(lens, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, dtype=dtype, seed=rng.randint(0, 10 ** 6)) if lens \
        else None


def _call_in_batch(target, s0, rng, dtype, dims):
    """chunk_gated_delta_rule over [others before] + target + [others after]: the target's
    o and final state."""
    before, after = _other_batch(rng, dtype, *dims), _other_batch(rng, dtype, *dims)
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


def _engine_procedure(seq, s0, steps, rng, dtype, dims):
    """What the engine does: keep S_c (the state at the last chunk boundary) and the buffer
    of tokens since; each step is one call over [buffer + new tokens] from S_c."""
    n = seq[0].shape[0]
    S_c, buf, p, outs = s0, 0, 0, []
    for s in steps:
        o, S = _call_in_batch([x[buf:p + s] for x in seq], S_c, rng, dtype, dims)
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


def check_engine_procedure(backend, dtype, n=200, seed=0, dims=(2, 4, 16, 8)):
    rng = random.Random(seed)
    q, k, v, g, beta, _, s0 = _inputs([n], Hk=dims[0], Hv=dims[1], Dk=dims[2], Dv=dims[3], dtype=dtype,
                                      seed=seed)
    seq = [q, k, v, g, beta]
    with use_backend(backend), use_numerics("exact"):
        whole, _ = _call_in_batch(seq, s0[0], rng, dtype, dims)
        eng = _engine_procedure(seq, s0[0], _schedule(n, rng), rng, dtype, dims)
    assert eng.dtype == whole.dtype == dtype
    bad = (eng != whole).any(-1).any(-1).nonzero().flatten().tolist()
    assert not bad, f"tokens whose o differs bitwise: {bad[:10]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_engine_procedure_torch(dtype):
    check_engine_procedure("torch", dtype, n=150 if dtype == torch.bfloat16 else 200)
