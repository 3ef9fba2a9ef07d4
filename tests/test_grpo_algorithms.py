"""Advantage math (rlfuse.train.advantages) and policy-loss variants
(rlfuse.kernels.loss.policy) on hand-computed cases; the backend-picking `policy_loss`
against the reference; micro-batch accumulation equals the full-batch loss and gradient."""

import math

import pytest
import torch

from rlfuse.kernels import use_backend
from rlfuse.kernels.loss.policy import accumulation_weight, kl_term, policy_loss, policy_loss_ref
from rlfuse.train.advantages import group_advantages, zero_variance_groups

# ---------------------------------------------------------------- advantages


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0])  # three groups of G=2
    # group std (unbiased) of {1, 0} = sqrt(0.5); centred values +-0.5
    a = group_advantages(r, 2, "group", eps=1e-6)
    g = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(a, torch.tensor([g, -g, -g, g, 0.0, 0.0]), rtol=0, atol=1e-7)
    # batch std (unbiased) over all six: mean 4/3, sum sq dev = 1/9+16/9+16/9+1/9+25/9+25/9 = 84/9
    sb = math.sqrt(84 / 9 / 5)
    a = group_advantages(r, 2, "batch", eps=0.0)
    torch.testing.assert_close(a, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0]) / sb, rtol=0, atol=1e-7)
    a = group_advantages(r, 2, "none")
    torch.testing.assert_close(a, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))
    assert zero_variance_groups(r, 2).tolist() == [False, False, True]


def test_group_advantages_one_success_in_eight():
    r = torch.zeros(8)
    r[3] = 1.0
    a = group_advantages(r, 8, eps=0.0)
    std = math.sqrt((7 * (1 / 8) ** 2 + (7 / 8) ** 2) / 7)
    assert a[3].item() == pytest.approx((7 / 8) / std, rel=1e-6)
    assert a[0].item() == pytest.approx(-(1 / 8) / std, rel=1e-6)
    assert a.sum().abs().item() < 1e-6


def test_group_advantages_rejects_partial_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="adv_scale"):
        group_advantages(torch.zeros(4), 2, "rank")


def test_kl_estimators_hand_computed():
    lp, ref = torch.tensor([0.5, -1.0]), torch.tensor([0.0, 0.0])
    torch.testing.assert_close(kl_term(lp, ref, "k1"), torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(kl_term(lp, ref, "k2"), torch.tensor([0.125, 0.5]))
    torch.testing.assert_close(kl_term(lp, ref, "k3"), torch.tensor([math.exp(-0.5) - 0.5, math.exp(1) - 2]))


# ---------------------------------------------------------------- losses, hand-computed
def _case(dtype=torch.float64):
    """seq 0: ratios (1, 1.5, 0.5), A = +1; seq 1: ratios (1.1, 0.7) and a masked token
    with ratio 3, A = -2."""
    ratios = torch.tensor([1.0, 1.5, 0.5, 1.1, 0.7, 3.0], dtype=dtype)
    old = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.3, -2.5], dtype=dtype)
    logp = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0, -2.0], dtype=dtype)
    mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool)
    seq = torch.tensor([0, 0, 0, 1, 1, 1])
    return logp, old, adv, mask, seq


# per-token pg: seq0 -> -1, -min(1.5, 1.2) = -1.2, -min(0.5, 0.8) = -0.5  (sum -2.7, mean -0.9)
#               seq1 -> -min(-2.2, -2.2) = 2.2, -min(-1.4, -1.6) = 1.6   (sum 3.8, mean 1.9)
@pytest.mark.parametrize("loss_type,expected", [
    ("grpo", (-0.9 + 1.9) / 2),        # mean over sequences of token means
    ("dapo", (-2.7 + 3.8) / 5),        # token-level mean over the 5 live tokens
    ("dr_grpo", (-2.7 + 3.8) / (2 * 4)),  # / (num_seqs * max_tokens=4)
])
def test_loss_variants_hand_computed(loss_type, expected):
    logp, old, adv, mask, seq = _case()
    loss, st = policy_loss_ref(logp, old, adv, mask, seq, 2, loss_type=loss_type, max_tokens=4)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    # clipped branch taken by r=1.5 (A>0) and r=0.7 (A<0): 2 of 5 live tokens
    assert st["clip_frac"].item() == pytest.approx(0.4)
    assert st["clip_frac_low"].item() == pytest.approx(0.2)
    assert st["clip_frac_high"].item() == pytest.approx(0.2)
    assert st["ratio_mean"].item() == pytest.approx(4.8 / 5)
    assert st["kl"].item() == 0.0


def test_dual_clip_caps_negative_advantage_loss():
    logp, old, adv, mask, seq = _case()
    with torch.no_grad():
        logp[4] = old[4] + math.log(4.0)  # ratio 4, A=-2: -min(-8, -2.4) = 8, capped at -c*A = 6
    base, _ = policy_loss_ref(logp, old, adv, mask, seq, 2, loss_type="dapo")
    capped, st = policy_loss_ref(logp, old, adv, mask, seq, 2, loss_type="dapo", dual_clip=3.0)
    assert base.item() == pytest.approx((-2.7 + 2.2 + 8.0) / 5, abs=1e-12)
    assert capped.item() == pytest.approx((-2.7 + 2.2 + 6.0) / 5, abs=1e-12)
    capped.backward()
    assert logp.grad[4].item() == 0.0  # the cap is a constant: no gradient


def test_gspo_hand_computed_value_and_gradient():
    logp, old, adv, mask, seq = _case()
    loss, _ = policy_loss_ref(logp, old, adv, mask, seq, 2, loss_type="gspo")
    s0, s1 = 0.75 ** (1 / 3), 0.77 ** 0.5  # geometric means of the live ratios
    assert loss.item() == pytest.approx((-s0 + 2 * s1) / 2, abs=1e-12)
    loss.backward()
    # d/dlogp_t = (1/B)(1/n_i)(-A_i s_i) for live tokens (sequence ratio inside the clip range)
    want = torch.tensor([-s0 / 6] * 3 + [2 * s1 / 4] * 2 + [0.0], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, want, rtol=1e-12, atol=1e-12)


def test_kl_term_added_per_token():
    logp, old, adv, mask, seq = _case()
    ref = logp.detach() - 0.5  # d = 0.5 on every token: k3 = exp(-0.5) + 0.5 - 1
    k3 = math.exp(-0.5) - 0.5
    base, _ = policy_loss_ref(logp, old, adv, mask, seq, 2, loss_type="grpo")
    loss, st = policy_loss_ref(logp, old, adv, mask, seq, 2, loss_type="grpo", ref_logp=ref, kl_coef=0.1)
    assert loss.item() == pytest.approx(base.item() + 0.1 * k3, abs=1e-12)
    assert st["kl"].item() == pytest.approx(k3, abs=1e-12)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_gradcheck_reference(loss_type):
    torch.manual_seed(0)
    N = 9
    old = torch.randn(N, dtype=torch.float64) - 1
    logp = (old + 0.05 * torch.randn(N, dtype=torch.float64)).requires_grad_(True)  # inside the clip range
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    adv = torch.randn(3, dtype=torch.float64)[seq]  # one advantage per sequence (GSPO needs it)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0, 1], dtype=torch.bool)
    ref = old + 0.1

    def f(lp):
        return policy_loss_ref(lp, old, adv, mask, seq, 3, loss_type=loss_type, max_tokens=5, ref_logp=ref,
                               kl_coef=0.05)[0]

    assert torch.autograd.gradcheck(f, (logp,))


def test_masked_tokens_get_zero_gradient():
    logp, old, adv, mask, seq = _case()
    for lt in ("grpo", "dapo", "dr_grpo", "gspo"):
        logp.grad = None
        policy_loss_ref(logp, old, adv, mask, seq, 2, loss_type=lt, max_tokens=4)[0].backward()
        assert logp.grad[5].item() == 0.0


def test_argument_errors():
    logp, old, adv, mask, seq = _case()
    with pytest.raises(ValueError, match="max_tokens"):
        policy_loss_ref(logp, old, adv, mask, seq, 2, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss_ref(logp, old, adv, mask, seq, 2, loss_type="ppo")


# ---------------------------------------------------------------- accumulation
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_micro_batch_accumulation_equals_full_batch(loss_type):
    torch.manual_seed(1)
    lens = [3, 5, 2, 4, 1]
    N = sum(lens)
    seq = torch.repeat_interleave(torch.arange(5), torch.tensor(lens))
    old = torch.randn(N, dtype=torch.float64) - 1
    logp = (old + 0.3 * torch.randn(N, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(5, dtype=torch.float64)[seq]
    mask = torch.rand(N) > 0.2
    kw = dict(loss_type=loss_type, max_tokens=6)
    full, _ = policy_loss_ref(logp, old, adv, mask, seq, 5, **kw)
    g_full, = torch.autograd.grad(full, logp)
    total_tokens = float(mask.sum())
    acc = 0.0
    grads = torch.zeros_like(logp)
    for group in ([0, 1], [2], [3, 4]):  # micro-batches of whole sequences
        idx = torch.cat([(seq == s).nonzero().squeeze(1) for s in group])
        sid = torch.cat([torch.full((lens[s],), k) for k, s in enumerate(group)])
        lp = logp.detach()[idx].requires_grad_(True)
        l, _ = policy_loss_ref(lp, old[idx], adv[idx], mask[idx], sid, len(group), **kw)
        w = accumulation_weight(loss_type, len(group), float(mask[idx].sum()), 5, total_tokens)
        (l * w).backward()
        acc += (l * w).item()
        grads[idx] += lp.grad
    assert acc == pytest.approx(full.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(grads, g_full, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- the fused kernel vs the reference
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
@pytest.mark.parametrize("extras", [{}, {"dual_clip": 3.0}, {"kl_coef": 0.1, "kl_type": "k3"},
                                    {"kl_coef": 0.1, "kl_type": "k2", "clip_high": 0.28}])
def test_kernel_policy_loss_matches_reference(backend, loss_type, extras):
    """The public function the trainer calls, on each backend (Triton under the interpreter
    on CPU), against the reference."""
    torch.manual_seed(2)
    lens = [4, 7, 1, 5]
    N = sum(lens)
    seq = torch.repeat_interleave(torch.arange(4), torch.tensor(lens))
    old = torch.randn(N) - 1
    base = old + 0.4 * torch.randn(N)
    adv = torch.randn(4)[seq]
    mask = torch.rand(N) > 0.25
    ref_lp = old + 0.2 * torch.randn(N)
    kw = dict(loss_type=loss_type, max_tokens=8, ref_logp=ref_lp if "kl_coef" in extras else None, **extras)
    lp1, lp2 = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    if loss_type == "cispo" and "dual_clip" in extras:  # no dual clip on a detached weight
        with use_backend(backend), pytest.raises(ValueError, match="cispo"):
            policy_loss(lp1, old, adv, mask, seq, 4, **kw)
        return
    with use_backend(backend):
        l1, s1 = policy_loss(lp1, old, adv, mask, seq, 4, **kw)
    l2, s2 = policy_loss_ref(lp2, old, adv, mask, seq, 4, **kw)
    l1.backward()
    l2.backward()
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-5, atol=1e-6)
    for k in ("clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "kl"):
        torch.testing.assert_close(s1[k].float(), s2[k].float(), rtol=1e-5, atol=1e-6)


def test_off_policy_corrections_on_hand_computed_cases():
    from rlfuse.train.grpo_update import off_policy_corrections

    # two sequences: tokens 0-2 (seq 0), 3-4 (seq 1); ratios e^d
    d = torch.log(torch.tensor([1.0, 2.0, 0.5, 4.0, 4.0]))
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0])
    mask = torch.ones(5)
    seq = torch.tensor([0, 0, 0, 1, 1])
    a, m, st = off_policy_corrections(d, adv, mask, seq, 2, tis_cap=3.0)
    torch.testing.assert_close(a, torch.tensor([1.0, 2.0, 0.5, -6.0, -6.0]))
    assert torch.equal(m, mask)
    assert float(st["offpolicy/tis_capped_frac"]) == pytest.approx(2 / 5)
    # IcePop [0.6, 3]: drops the 0.5 and both 4.0 tokens
    _, m, st = off_policy_corrections(d, adv, mask, seq, 2, icepop_bounds=(0.6, 3.0))
    assert m.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert float(st["offpolicy/icepop_masked_frac"]) == pytest.approx(3 / 5)
    # MIS [0.5, 2]: seq 0 geometric mean (1 * 2 * 0.5)^(1/3) = 1 kept; seq 1 = 4 dropped
    _, m, st = off_policy_corrections(d, adv, mask, seq, 2, mis_bounds=(0.5, 2.0))
    assert m.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    # an already-masked token stays masked and does not count
    _, m, st = off_policy_corrections(d, adv, torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0]), seq, 2,
                                      icepop_bounds=(0.6, 3.0))
    assert m.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert float(st["offpolicy/icepop_masked_frac"]) == pytest.approx(2 / 4)
