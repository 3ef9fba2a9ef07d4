"""PPO's estimators (rlfuse/train/ppo_math.py) on hand-computed cases.
Run: python -m pytest -q tests/test_ppo_math.py"""

import math

import pytest
import torch

from rlfuse.train.ppo_math import RunningMoments, adaptive_kl_coef, explained_variance, gae, value_loss, whiten


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_gae_gamma_lambda_one_is_return_minus_value():
    # r = [0, 0, 1], V = [.5, .2, .4]: A_t = sum_{u >= t} r_u - V_t, R_t = 1
    adv, ret = gae(_t([0, 0, 1.0]), _t([0.5, 0.2, 0.4]), _t([1, 1, 1.0]), 1.0, 1.0)
    assert adv.tolist()[0] == pytest.approx([0.5, 0.8, 0.6])
    assert ret.tolist()[0] == pytest.approx([1.0, 1.0, 1.0])


def test_gae_discounted_by_hand():
    # gamma = lam = 0.5: delta = [0 + .5*.2 - .5, 0 + .5*.4 - .2, 1 - .4] = [-.4, 0, .6]
    # A_2 = .6, A_1 = 0 + .25 * .6 = .15, A_0 = -.4 + .25 * .15 = -.3625; R = A + V
    adv, ret = gae(_t([0, 0, 1.0]), _t([0.5, 0.2, 0.4]), _t([1, 1, 1.0]), 0.5, 0.5)
    assert adv.tolist()[0] == pytest.approx([-0.3625, 0.15, 0.6])
    assert ret.tolist()[0] == pytest.approx([0.1375, 0.35, 1.0])


def test_gae_ragged_batch_ignores_padding():
    # second sequence has 2 tokens; its padded value (9) and reward (5) must not leak in
    r = _t([0, 0, 1.0], [0.3, -1.0, 5.0])
    v = _t([0.5, 0.2, 0.4], [0.1, 0.2, 9.0])
    m = _t([1, 1, 1.0], [1, 1, 0.0])
    adv, ret = gae(r, v, m, 1.0, 1.0)
    assert adv.tolist()[1] == pytest.approx([-0.8, -1.2, 0.0])  # (.3 - 1) - .1, -1 - .2
    assert ret.tolist()[1] == pytest.approx([-0.7, -1.0, 0.0])
    assert adv.tolist()[0] == pytest.approx([0.5, 0.8, 0.6])
    # lam = 0: one-step TD errors
    adv0, _ = gae(r, v, m, 1.0, 0.0)
    assert adv0.tolist()[1] == pytest.approx([0.3 + 0.2 - 0.1, -1.0 - 0.2, 0.0])


def test_whiten_over_masked_tokens():
    x, m = _t([1, 2, 3, 100.0]), _t([1, 1, 1, 0.0])
    s = math.sqrt(2 / 3)
    assert whiten(x, m, eps=0.0).tolist()[0] == pytest.approx([-1 / s, 0.0, 1 / s, 0.0])


def test_value_loss_clipping_by_hand():
    # token 0: plain (1 - 2)^2 = 1, clipped V = .5 + .2 = .7, (.7 - 2)^2 = 1.69 -> max 1.69
    # token 1: plain 0, clipped .5 - .2 = .3 -> .09; token 2 within the clip: plain (.6-2)^2 = 1.96
    # token 3: masked
    v, old, ret = _t(1.0, 0.0, 0.6, 7.0), _t(0.5, 0.5, 0.5, 0.0), _t(2.0, 0.0, 2.0, 0.0)
    m = _t(1, 1, 1, 0.0)
    loss, frac = value_loss(v, old, ret, m, 0.2)
    assert loss.tolist() == pytest.approx([0.845, 0.045, 0.98, 0.0])
    assert float(frac) == pytest.approx(2 / 3)
    plain, frac0 = value_loss(v, old, ret, m, None)
    assert plain.tolist() == pytest.approx([0.5, 0.0, 0.98, 0.0]) and float(frac0) == 0.0


def test_value_loss_gradient_flows_through_the_larger_term():
    v = torch.tensor([1.0, 0.6], requires_grad=True)
    loss, _ = value_loss(v, _t(0.5, 0.5), _t(2.0, 2.0), _t(1, 1.0), 0.2)
    loss.sum().backward()
    # token 0: clipped branch active and V outside the clip range: no gradient; token 1: V - R
    assert v.grad.tolist() == pytest.approx([0.0, -1.4])


def test_explained_variance():
    ret, m = _t(1, 2, 3, 50.0), _t(1, 1, 1, 0.0)
    assert float(explained_variance(ret, ret, m)) == pytest.approx(1.0)
    assert float(explained_variance(torch.zeros(4), ret, m)) == pytest.approx(0.0)
    # V = R - [1, 0, -1]: Var(residual) = 2/3 = Var(R) -> 0; half the residual -> 1 - 1/4
    assert float(explained_variance(ret - 0.5 * _t(1, 0, -1, 0.0), ret, m)) == pytest.approx(0.75)


def test_adaptive_kl_coef_by_hand():
    # KL 12 vs target 6: error 1, clipped to .2 -> beta * (1 + .2 * 100 / 1e4)
    assert adaptive_kl_coef(0.1, 12.0, 6.0, 10000, 100) == pytest.approx(0.1 * 1.002)
    assert adaptive_kl_coef(0.1, 6.6, 6.0, 10000, 100) == pytest.approx(0.1 * 1.001)
    assert adaptive_kl_coef(0.1, 0.0, 6.0, 10000, 100) == pytest.approx(0.1 * 0.998)
    assert adaptive_kl_coef(0.1, 6.0, 6.0, 10000, 100) == pytest.approx(0.1)


def test_running_moments_merge_equals_whole():
    rm = RunningMoments()
    rm.update(_t(1, 2, 3.0))
    assert (rm.mean, rm.var) == pytest.approx((2.0, 2 / 3))
    rm.update(_t(4, 5.0))
    assert (rm.count, rm.mean, rm.var) == pytest.approx((5, 3.0, 2.0))  # of [1..5]
    assert rm.normalize(_t(3.0, 5.0), eps=0.0).tolist() == pytest.approx([0.0, 2 / math.sqrt(2)])
    copy = RunningMoments()
    copy.load_state_dict(rm.state_dict())
    assert copy == rm
