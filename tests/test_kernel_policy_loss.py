"""Fused policy loss (Triton, interpreter on CPU) against its reference and hand-computed
cases; gradients against autograd of the reference in float64; `grpo_loss_from_hidden`
against the composition of the references.

    python -m pytest -q tests/test_kernel_policy_loss.py
"""

import math

import pytest
import torch

from rlfuse.kernels import use_backend
from rlfuse.kernels.loss.logprob import token_logprobs_ref
from rlfuse.kernels.loss.policy import grpo_loss_from_hidden, policy_loss, policy_loss_ref
from rlfuse.kernels.loss.triton_policy import policy_loss_triton

STATS = ("clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "kl")

# These cases build CPU tensors (fp64 among them) and run the Triton kernel under the CPU
# interpreter; on a CUDA machine the kernel is compared with the reference on the GPU by
# tests/test_gpu_logprob.py (every loss type and KL type) instead.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter cases; the GPU path is "
                                "checked by tests/test_gpu_logprob.py")


def _hand_batch(dtype=torch.float64):
    """2 sequences x 3 tokens, old_logp = 0 so r = exp(logp): r = (1, 1.5, 0.5) in both.
    seq 0: A = +1, all tokens in; seq 1: A = -1, its third token masked out."""
    logp = torch.tensor([1.0, 1.5, 0.5, 1.0, 1.5, 0.5], dtype=dtype).log().requires_grad_()
    zeros = torch.zeros(6, dtype=dtype)
    adv = torch.tensor([1.0, 1, 1, -1, -1, -1], dtype=dtype)
    mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool)
    seq = torch.tensor([0, 0, 0, 1, 1, 1])
    return logp, zeros, adv, mask, seq


# Per-token pg with clip 0.2 (pg = -min(r A, clip(r) A)):
#   seq 0 (A=+1): r=1 -> -1; r=1.5 -> -min(1.5, 1.2) = -1.2 (clipped); r=0.5 -> -min(0.5, 0.8) = -0.5
#   seq 1 (A=-1): r=1 -> 1;  r=1.5 -> -min(-1.5, -1.2) = 1.5 (not clipped); third token masked
# grpo: ((-1 - 1.2 - 0.5)/3 + (1 + 1.5)/2) / 2 = (-0.9 + 1.25)/2 = 0.175
# dapo: (-2.7 + 2.5) / 5 = -0.04; dr_grpo (max_tokens 4): -0.2 / (2*4) = -0.025
# dual clip c=1.4: seq 1 token 2 (A<0, pg=1.5 > 1.4) -> 1.4: grpo = (-0.9 + 1.2)/2 = 0.15
# k1 with ref = logp - 0.5, kl_coef 0.1: +0.05 on every token -> grpo 0.225, kl stat 0.5
# k2 same: kl = 0.5^2/2 = 0.125 -> grpo 0.175 + 0.0125 = 0.1875
# gspo: s_0 = exp(mean(0, ln 1.5, ln 0.5)) = 0.75^(1/3) ~ 0.9086 (inside [0.8, 1.2]) -> -s_0;
#       s_1 = exp(mean(0, ln 1.5)) = 1.5^(1/2) ~ 1.2247, A=-1 -> -min(-1.2247, -1.2) = 1.2247
#       loss = (-0.75^(1/3) + 1.5^(1/2)) / 2
# cispo: pg = -w A logp with logp = ln r, w = min(r, 1.2) (no lower bound): seq 0 -> 0, -1.2 ln 1.5,
#       -0.5 ln 0.5; seq 1 -> 0, +1.2 ln 1.5; token mean over 5: (-0.5 ln 0.5) / 5 = 0.1 ln 2
#       cispo_clip_low: w = clip(r, 0.8, 1.2), the 0.5 weighs 0.8: (-0.8 ln 0.5) / 5 = 0.16 ln 2
# kl_ratio with k1 as above: the KL term is r * 0.5 * 0.1: seq 0 mean(0.05, 0.075, 0.025) = 0.05,
#       seq 1 mean(0.05, 0.075) = 0.0625 -> grpo 0.175 + 0.05625 = 0.23125
HAND = [
    (dict(loss_type="grpo"), 0.175),
    (dict(loss_type="dapo"), -0.04),
    (dict(loss_type="dr_grpo", max_tokens=4), -0.025),
    (dict(loss_type="grpo", dual_clip=1.4), 0.15),
    (dict(loss_type="grpo", kl_coef=0.1, kl_type="k1", ref=0.5), 0.225),
    (dict(loss_type="grpo", kl_coef=0.1, kl_type="k2", ref=0.5), 0.1875),
    (dict(loss_type="gspo"), (-(0.75 ** (1 / 3)) + 1.5 ** 0.5) / 2),
    (dict(loss_type="cispo"), 0.1 * math.log(2)),
    (dict(loss_type="cispo", cispo_clip_low=True), 0.16 * math.log(2)),
    (dict(loss_type="grpo", kl_coef=0.1, kl_type="k1", ref=0.5, kl_ratio=True), 0.23125),
]


@pytest.mark.parametrize("fn", [policy_loss_ref, policy_loss_triton])
@pytest.mark.parametrize("kw,expected", HAND)
def test_hand_computed(fn, kw, expected):
    logp, old, adv, mask, seq = _hand_batch()
    kw = dict(kw)
    if "ref" in kw:
        kw["ref_logp"] = logp.detach() - kw.pop("ref")
    loss, stats = fn(logp, old, adv, mask, seq, 2, **kw)
    assert math.isclose(loss.item(), expected, abs_tol=1e-12), (loss.item(), expected)
    if kw.get("loss_type") == "grpo" and len(kw) == 1:
        # clipped: seq 0 token 1 only (1 of 5 masked tokens); high: same; low: seq 1 token 2 is masked
        assert stats["clip_frac"].item() == pytest.approx(0.2) and stats["clip_frac_high"].item() == pytest.approx(0.2)
        assert stats["clip_frac_low"].item() == 0 and stats["ratio_mean"].item() == pytest.approx(5.5 / 5)
        assert stats["kl"].item() == 0
        loss.backward()
        # d loss / d logp = w_t * (-A r) unless clipped; w = 1/(3*2) in seq 0, 1/(2*2) in seq 1
        expect = torch.tensor([-1 / 6, 0.0, -0.5 / 6, 1 / 4, 1.5 / 4, 0.0], dtype=logp.dtype)
        assert torch.allclose(logp.grad, expect, atol=1e-12), logp.grad
    if "dual_clip" in kw:
        assert stats["clip_frac"].item() == pytest.approx(0.4)
    if kw.get("loss_type") == "cispo":
        # weights capped at r = 1.5 (twice), and with the lower bound at r = 0.5 too: 2 or 3 of 5
        # tokens; every live token has a gradient -w A / 5 (the bounds only act on the detached weight)
        low = kw.get("cispo_clip_low", False)
        assert stats["clip_frac"].item() == pytest.approx(0.6 if low else 0.4)
        loss.backward()
        expect = torch.tensor([-1.0, -1.2, -0.8 if low else -0.5, 1.0, 1.2, 0.0], dtype=logp.dtype) / 5
        assert torch.allclose(logp.grad, expect, atol=1e-12), logp.grad
    if kw.get("kl_type") == "k1":
        assert stats["kl"].item() == pytest.approx(0.5)  # the estimate itself, not the ratio-weighted term
    if kw.get("kl_ratio"):
        # d/d logp of 0.1 r kl1 = 0.1 r (1 + kl1) = 0.15 r, plus the pg gradient of the grpo case
        loss.backward()
        pg = torch.tensor([-1 / 6, 0.0, -0.5 / 6, 1 / 4, 1.5 / 4, 0.0], dtype=logp.dtype)
        r = torch.tensor([1.0, 1.5, 0.5, 1.0, 1.5, 0.0], dtype=logp.dtype)
        w = torch.tensor([1 / 6] * 3 + [1 / 4] * 3, dtype=logp.dtype)
        assert torch.allclose(logp.grad, pg + w * 0.15 * r, atol=1e-12), logp.grad


def _random_batch(N=300, B=7, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = torch.sort(torch.randint(0, B, (N,), generator=g)).values
    old = -torch.rand(N, generator=g, dtype=torch.float64) * 3
    logp = old + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)  # ratios both sides of the clip
    adv = torch.randn(B, generator=g, dtype=torch.float64)[seq]
    mask = torch.rand(N, generator=g) > 0.2
    ref = old + 0.2 * torch.randn(N, generator=g, dtype=torch.float64)
    return logp.to(dtype), old.float(), adv.float(), mask, seq, ref.float()


CASES = [dict(loss_type=lt, dual_clip=dc) for lt in ("grpo", "dapo", "dr_grpo", "gspo") for dc in (None, 1.3)] + \
    [dict(loss_type="cispo", dual_clip=None), dict(loss_type="cispo", dual_clip=None, cispo_clip_low=True),
     dict(loss_type="dapo", dual_clip=1.3, kl_ratio=True), dict(loss_type="cispo", dual_clip=None, kl_ratio=True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("kl_type", [None, "k1", "k2", "k3"])
def test_triton_vs_ref(case, kl_type):
    logp, old, adv, mask, seq, ref = _random_batch(seed=len(str(case)) + len(str(kl_type)))
    kw = dict(case, clip_low=0.2, clip_high=0.28, max_tokens=64)
    if case["loss_type"] == "gspo":
        kw.update(clip_low=3e-3, clip_high=4e-3)  # sequence ratios are close to 1: tight ranges clip some
    if kl_type:
        kw.update(ref_logp=ref, kl_coef=0.05, kl_type=kl_type)
    # fp32: values; fp64: values and gradients against autograd of the reference
    l32, s32 = policy_loss_triton(logp, old, adv, mask, seq, 7, **kw)
    r32, rs32 = policy_loss_ref(logp, old, adv, mask, seq, 7, **kw)
    assert torch.allclose(l32, r32, rtol=1e-5, atol=1e-6)
    assert 0 < s32["clip_frac"] < 1  # both branches exercised
    # the dual-clip cap binds somewhere: clip_frac exceeds the plain clipped share
    # (not for gspo: its s_i ~ 1 never reaches 1.3)
    if case["dual_clip"] and case["loss_type"] != "gspo":
        assert s32["clip_frac"] > s32["clip_frac_high"] + s32["clip_frac_low"]
    for k in STATS:
        assert torch.allclose(s32[k], rs32[k], rtol=1e-5, atol=1e-6), k
    lp_t = logp.double().requires_grad_()
    lp_r = logp.double().requires_grad_()
    kw64 = dict(kw, ref_logp=ref.double()) if kl_type else kw
    l64, _ = policy_loss_triton(lp_t, old, adv, mask, seq, 7, **kw64)
    r64, _ = policy_loss_ref(lp_r, old, adv, mask, seq, 7, **kw64)
    assert l64.dtype == torch.float64 and torch.allclose(l64, r64, rtol=1e-6, atol=1e-8)  # fp32 clip constants
    l64.backward()
    r64.backward()
    assert torch.allclose(lp_t.grad, lp_r.grad, rtol=1e-10, atol=1e-13)
    assert (lp_t.grad[~mask] == 0).all()


def test_masked_tokens_inert():
    """Non-finite inputs at masked tokens change nothing (select, not multiply)."""
    logp, old, adv, mask, seq, _ = _random_batch(seed=4)
    bad = logp.clone()
    bad[~mask] = float("nan")
    a, sa = policy_loss_triton(logp, old, adv, mask, seq, 7)
    lp = bad.clone().requires_grad_()
    b, sb = policy_loss_triton(lp, old, adv, mask, seq, 7)
    b.backward()
    assert torch.equal(a, b.detach()) and all(torch.equal(sa[k], sb[k]) for k in STATS)
    assert torch.isfinite(lp.grad).all() and (lp.grad[~mask] == 0).all()


def test_backend_switch_and_errors():
    logp, old, adv, mask, seq, _ = _random_batch(N=20, seed=5)
    with use_backend("torch"):
        a, _ = policy_loss(logp, old, adv, mask, seq, 7)
    with use_backend("triton"):
        b, _ = policy_loss(logp, old, adv, mask, seq, 7)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    for bad, msg in [(dict(loss_type="ppo"), "loss_type"), (dict(loss_type="dr_grpo"), "max_tokens"),
                     (dict(dual_clip=1.0), "dual_clip"), (dict(kl_type="k4"), "kl_type"),
                     (dict(loss_type="cispo", dual_clip=2.0), "cispo"),
                     (dict(loss_type="gspo", kl_ratio=True), "kl_ratio"),
                     (dict(loss_type="grpo", cispo_clip_low=True), "cispo_clip_low")]:
        with pytest.raises(ValueError, match=msg):
            policy_loss_triton(logp, old, adv, mask, seq, 7, **bad)


@pytest.mark.parametrize("loss_type", ["grpo", "gspo", "cispo"])
def test_grpo_loss_from_hidden(loss_type):
    N, D, V, B = 29, 24, 203, 4
    g = torch.Generator().manual_seed(9)
    h = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.4
    y = torch.randint(0, V, (N,), generator=g)
    seq = torch.sort(torch.randint(0, B, (N,), generator=g)).values
    T = 0.4 + torch.rand(N, generator=g)
    with torch.no_grad():
        old = token_logprobs_ref(h, w, y, T) + 0.2 * torch.randn(N, generator=g)
    adv = torch.randn(B, generator=g)[seq]
    mask = torch.rand(N, generator=g) > 0.15
    kw = dict(loss_type=loss_type, clip_low=0.1, clip_high=0.1) if loss_type == "gspo" else {}
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with use_backend("triton"):
        loss, stats, logp = grpo_loss_from_hidden(hh, ww, y, T, old, adv, mask, seq, B, with_entropy=True, **kw)
    loss.backward()
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    lpd, entd = token_logprobs_ref(hd, wd, y, T, return_entropy=True)
    gold, _ = policy_loss_ref(lpd, old, adv, mask, seq, B, **kw)
    gold.backward()
    assert not logp.requires_grad and torch.allclose(logp.double(), lpd.detach(), atol=2e-5)
    assert abs(loss.item() - gold.item()) < 1e-5
    assert (hh.grad.double() - hd.grad).abs().max() < 1e-5 * hd.grad.abs().max()
    assert (ww.grad.double() - wd.grad).abs().max() < 1e-5 * wd.grad.abs().max()
    m = mask.double()
    assert abs(stats["entropy"].item() - ((entd.detach() * m).sum() / m.sum()).item()) < 2e-5
