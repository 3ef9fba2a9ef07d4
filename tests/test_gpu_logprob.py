"""GPU correctness of the fused linear log-prob and the fused policy loss at real sizes.

token_logprobs (V = 151936, D = 1024, N = 4096; bf16 and fp32; per-row temperatures in
[0.5, 1.5), entropy on): forward log-probs / entropy and dH / dW of <g, logp> + <ge, ent>
against a float64 gold computed on the GPU. Pass: forward max abs error <= max(2 x eager
reference error, 5e-5); gradients max error / max |gold| <= max(GRAD_RTOL[dtype], 2 x eager) (bf16: dz is
stored in bf16, ~2^-9 relative, so ~4e-3 is expected), and reported next to the eager
reference's. Also: batch invariance (logp of rows[:k] bitwise equal to the full batch's,
k in 1, 3, 8, 100, 1000: the small k run with one program per vocab split (fold=1), the
full batch with fold=group, so this also checks the two fold modes agree bitwise on
sm_90), forced fold modes bitwise, per-row temperature tensor == float temperature
bitwise, backward bitwise reproducible, several dz row chunks vs gold, CUDA graph capture
of the N=8 forward (fails on any host sync).
policy_loss (N = 65536 tokens in 256 sequences; every loss_type x kl_type, dual clip on
and off): Triton vs reference loss / stats (rtol 1e-5) and d loss / d logp (rtol 1e-5
of max). grpo_loss_from_hidden vs float64 composition of the references.

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_logprob.py
"""

from __future__ import annotations

import functools

import pytest
import torch
from gpu_checks import assert_all_pass, fresh_rows, record_into

from rlfuse.kernels import use_backend
from rlfuse.kernels.loss.logprob import _inv_temperature, token_logprobs, token_logprobs_ref
from rlfuse.kernels.loss.policy import LOSS_TYPES, grpo_loss_from_hidden, policy_loss_ref
from rlfuse.kernels.loss.triton_logprob import _FWD_TILES, token_logprobs_bwd_triton, token_logprobs_fwd_triton
from rlfuse.kernels.loss.triton_policy import policy_loss_triton

GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
results: list[dict] = []


pytestmark = pytest.mark.gpu


_fresh_rows = fresh_rows(results)


record = functools.partial(record_into, results)


def inputs(N, D, V, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(N, D, device="cuda", generator=g).to(dtype)
    w = (torch.randn(V, D, device="cuda", generator=g) * (2.0 / D ** 0.5)).to(dtype)
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    T = 0.5 + torch.rand(N, device="cuda", generator=g)
    return h, w, y, T


def fwd_bwd(fn, h, w, y, T, g_lp, g_ent):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    lp, ent = fn(h, w, y, T, True)
    dh, dw = torch.autograd.grad((lp * g_lp.to(lp.dtype)).sum() + (ent * g_ent.to(ent.dtype)).sum(), (h, w))
    return lp.detach(), ent.detach(), dh, dw


def triton_fn(*a):
    with use_backend("triton"):
        return token_logprobs(*a)


def check_logprob(dtype, N=4096, D=1024, V=151936):
    name = f"logprob {str(dtype)[6:]} N={N} D={D} V={V}"
    h, w, y, T = inputs(N, D, V, dtype)
    g_lp, g_ent = torch.randn(N, device="cuda"), torch.randn(N, device="cuda")
    ours = fwd_bwd(triton_fn, h, w, y, T, g_lp, g_ent)
    eager = fwd_bwd(token_logprobs_ref, h, w, y, T, g_lp, g_ent)
    gold = fwd_bwd(token_logprobs_ref, h.double(), w.double(), y, T, g_lp.double(), g_ent.double())
    for i, what in enumerate(["logp", "entropy", "dH", "dW"]):
        err = (ours[i].double() - gold[i]).abs().max().item()
        err_ref = (eager[i].double() - gold[i]).abs().max().item()
        if i < 2:
            ok = err <= max(2 * err_ref, 5e-5)
        else:
            scale = gold[i].abs().max().item()
            err, err_ref = err / scale, err_ref / scale
            # the eager fp32 reference itself lands at 0.7-1.06e-5 at these sizes (H100,
            # commits 3e0bc0a, 86b28b4: ours 1.03-1.19e-5, 1.06-1.51x it), so the 1e-5 table
            # value is below fp32 noise: also accept "no worse than 2x the reference in the
            # same dtype", the forward's rule
            ok = err <= max(GRAD_RTOL[dtype], 2 * err_ref) and ours[i].dtype == dtype
        record(f"{name} {what} vs float64", ok, err=f"{err:.3g}", eager_err=f"{err_ref:.3g}")
    del eager, gold
    torch.cuda.empty_cache()

    # batch invariance across k (fold=1 for small k, fold=group for the full batch)
    full = token_logprobs_fwd_triton(h, w, y, T.reciprocal(), True)
    ok = True
    for k in (1, 3, 8, 100, 1000):
        part = token_logprobs_fwd_triton(h[:k], w, y[:k], T[:k].reciprocal(), True)
        ok &= torch.equal(part[0], full[0][:k]) and torch.equal(part[1], full[1][:k])
    record(f"{name} batch invariance f(h)[:k] == f(h[:k])", ok)
    tiles = _FWD_TILES[dtype]
    # fold=1 (one program per row block per vocab split) is the small-batch path: slow at
    # N=4096 (the first GPU run timed out here), so compare the two modes on 256 rows
    m = 256
    a = token_logprobs_fwd_triton(h[:m], w, y[:m], T[:m].reciprocal(), True, fold=1)
    b = token_logprobs_fwd_triton(h[:m], w, y[:m], T[:m].reciprocal(), True, fold=tiles.group)
    record(f"{name} fold=1 == fold=group bitwise", all(torch.equal(x, z) for x, z in zip(a, b)))
    with use_backend("triton"):
        t_float = token_logprobs(h, w, y, 0.7)
        t_tensor = token_logprobs(h, w, y, torch.full((N,), 0.7, device="cuda"))
    record(f"{name} temperature float == tensor bitwise", torch.equal(t_float, t_tensor))

    # backward: bitwise reproducible; several row chunks vs gold
    inv_t = _inv_temperature(T, N, h.device)
    lp, ent, lse = token_logprobs_fwd_triton(h, w, y, inv_t, True)
    d1 = token_logprobs_bwd_triton(g_lp, g_ent, h, w, y, inv_t, lse, ent)
    d2 = token_logprobs_bwd_triton(g_lp, g_ent, h, w, y, inv_t, lse, ent)
    record(f"{name} backward bitwise reproducible", torch.equal(d1[0], d2[0]) and torch.equal(d1[1], d2[1]))
    d3 = token_logprobs_bwd_triton(g_lp, g_ent, h, w, y, inv_t, lse, ent, chunk_rows=1024)
    for what, x, z in (("dH", d3[0], d1[0]), ("dW", d3[1], d1[1])):
        rel = (x.double() - z.double()).abs().max().item() / z.double().abs().max().item()
        record(f"{name} {what} 4 row chunks vs 1", rel <= GRAD_RTOL[dtype], rel=f"{rel:.3g}")
    del d1, d2, d3
    torch.cuda.empty_cache()


def check_cuda_graph(dtype, D=1024, V=151936, B=8):
    h, w, y, T = inputs(B, D, V, dtype, seed=1)
    ref = triton_fn(h, w, y, T)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        triton_fn(h, w, y, T)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_fn(h, w, y, T)
    graph.replay()
    torch.cuda.synchronize()
    record(f"logprob {str(dtype)[6:]} B={B} CUDA graph capture + replay", torch.equal(out, ref))


def check_policy_loss(N=65536, B=256):
    g = torch.Generator(device="cuda").manual_seed(2)
    seq = torch.sort(torch.randint(0, B, (N,), device="cuda", generator=g)).values
    old = -torch.rand(N, device="cuda", generator=g) * 3
    logp = old + 0.3 * torch.randn(N, device="cuda", generator=g)
    adv = torch.randn(B, device="cuda", generator=g)[seq]
    mask = torch.rand(N, device="cuda", generator=g) > 0.2
    ref = old + 0.2 * torch.randn(N, device="cuda", generator=g)
    for lt in LOSS_TYPES:
        for kl in (None, "k1", "k2", "k3"):
            for dual in ((None,) if lt == "cispo" else (None, 1.3)):  # cispo has no dual clip
                kw = dict(loss_type=lt, dual_clip=dual, max_tokens=512, clip_high=0.28)
                if lt == "gspo":
                    kw.update(clip_low=3e-3, clip_high=4e-3)
                if kl:
                    # kl_ratio (the ratio-weighted KL) on k3, the estimator it is used with
                    kw.update(ref_logp=ref, kl_coef=0.05, kl_type=kl, kl_ratio=kl == "k3" and lt != "gspo")
                a, b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
                la, sa = policy_loss_triton(a, old, adv, mask, seq, B, **kw)
                lb, sb = policy_loss_ref(b, old, adv, mask, seq, B, **kw)
                la.backward()
                lb.backward()
                ok = torch.allclose(la, lb, rtol=1e-5, atol=1e-6)
                ok &= all(torch.allclose(sa[k], sb[k], rtol=1e-5, atol=1e-6) for k in sb)
                gerr = (a.grad - b.grad).abs().max().item() / max(b.grad.abs().max().item(), 1e-30)
                ok &= gerr <= 1e-5
                record(f"policy_loss {lt} kl={kl} dual={dual}", ok, loss=f"{la.item():.6g}",
                       ref=f"{lb.item():.6g}", grad_rel=f"{gerr:.2g}")


def check_grpo_from_hidden(dtype=torch.bfloat16, N=2048, D=1024, V=151936, B=16):
    h, w, y, T = inputs(N, D, V, dtype, seed=3)
    g = torch.Generator(device="cuda").manual_seed(4)
    seq = torch.sort(torch.randint(0, B, (N,), device="cuda", generator=g)).values
    with torch.no_grad():
        old = token_logprobs_ref(h, w, y, T) + 0.2 * torch.randn(N, device="cuda", generator=g)
    adv = torch.randn(B, device="cuda", generator=g)[seq]
    mask = torch.rand(N, device="cuda", generator=g) > 0.1
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with use_backend("triton"):
        loss, stats, _ = grpo_loss_from_hidden(hh, ww, y, T, old, adv, mask, seq, B, with_entropy=True)
    loss.backward()
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    gold, _ = policy_loss_ref(token_logprobs_ref(hd, wd, y, T), old, adv, mask, seq, B)
    gold.backward()
    eh = (hh.grad.double() - hd.grad).abs().max().item() / hd.grad.abs().max().item()
    ew = (ww.grad.double() - wd.grad).abs().max().item() / wd.grad.abs().max().item()
    ok = abs(loss.item() - gold.item()) < 1e-4 and eh <= GRAD_RTOL[dtype] and ew <= GRAD_RTOL[dtype]
    record(f"grpo_loss_from_hidden {str(dtype)[6:]} N={N} vs float64", ok, loss=f"{loss.item():.6g}",
           gold=f"{gold.item():.6g}", dH_rel=f"{eh:.3g}", dW_rel=f"{ew:.3g}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_logprob_against_float64(dtype):
    # fp32 at N=1024: the IEEE-fp32 dots are slow (N=4096 did not finish in 150 s with compiles)
    check_logprob(dtype, N=4096 if dtype == torch.bfloat16 else 1024)
    check_cuda_graph(dtype)
    assert_all_pass(results)


def test_policy_loss_against_float64():
    check_policy_loss()
    assert_all_pass(results)


def test_grpo_loss_from_hidden_against_float64():
    check_grpo_from_hidden()
    assert_all_pass(results)
