"""MasterAdamW vs torch.optim.AdamW, in-place write-back, bf16 masters, schedule, clipping."""

import math

import pytest
import torch

from rlfuse.run.optim import MasterAdamW, NonFiniteError, NonFiniteGuard, clip_grad_norm_, lr_at, nonfinite_tensors


def _params(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in [(7, 5), (5,), (3, 4, 2)]]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_torch_adamw_fp32_bitwise(wd):
    ours, ref = _params(0), _params(0)
    kw = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    opt = MasterAdamW(ours, lr=1e-2, **kw)
    topt = torch.optim.AdamW(ref, lr=1e-2, foreach=False, **kw)
    for step in range(6):
        lr = 1e-2 * (step + 1) / 6
        _grads(ours, step)
        _grads(ref, step)
        opt.step(lr)
        for group in topt.param_groups:
            group["lr"] = lr
        topt.step()
        for a, b in zip(ours, ref):
            assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max()}"


@pytest.mark.parametrize("dtype,wd", [(torch.float32, 0.0), (torch.float32, 0.1), (torch.bfloat16, 0.1)])
def test_update_ratio_is_the_relative_size_of_the_step(dtype, wd):
    """pop_update_ratio() == ||w_new - w_old|| / ||w_old|| over the fp32 masters, the largest
    of the steps since the last pop; None before any step."""
    ps = _params(3, dtype)
    opt = MasterAdamW(ps, lr=1e-2, weight_decay=wd)
    assert opt.pop_update_ratio() is None
    want = []
    for step in range(3):
        before = [w.detach().double().clone() for w in opt.master]
        _grads(ps, step)
        opt.step(1e-2 * (step + 1))
        delta = torch.cat([(w.double() - b).flatten() for w, b in zip(opt.master, before)])
        want.append(float(delta.norm() / torch.cat([b.flatten() for b in before]).norm()))
        if step == 0:
            got = opt.pop_update_ratio()
            assert got.dtype == torch.float32 and got.dim() == 0
            assert float(got) == pytest.approx(want[0], rel=1e-4)
    assert float(opt.pop_update_ratio()) == pytest.approx(max(want[1:]), rel=1e-4)
    assert opt.pop_update_ratio() is None and 1e-4 < max(want) < 1.0


def test_updates_in_place_and_keeps_parameter_objects():
    ps = _params(1, torch.bfloat16)
    ptrs = [p.data_ptr() for p in ps]
    ids = [id(p) for p in ps]
    opt = MasterAdamW(ps, lr=1e-1)
    before = [p.detach().clone() for p in ps]
    _grads(ps, 0)
    opt.step()
    assert [p.data_ptr() for p in ps] == ptrs and [id(p) for p in ps] == ids
    assert all(not torch.equal(a, b) for a, b in zip(ps, before))


def test_bf16_params_follow_fp32_masters():
    """bf16 params get round(master); the master accumulates updates a bf16 weight would lose."""
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    ref = torch.nn.Parameter(torch.ones(4))
    opt = MasterAdamW([p], lr=1e-4)
    topt = torch.optim.AdamW([ref], lr=1e-4, foreach=False, weight_decay=0.0)
    for _ in range(20):  # 1e-4 steps vanish against bf16's 2^-8 spacing at 1.0 ...
        p.grad = torch.ones(4, dtype=torch.bfloat16)
        ref.grad = torch.ones(4)
        opt.step()
        topt.step()
    torch.testing.assert_close(opt.master[0], ref.detach(), rtol=0, atol=1e-7)  # ... but not in the master
    assert torch.equal(p.detach(), ref.detach().to(torch.bfloat16))


def test_fp32_master_is_the_parameter():
    ps = _params(2)
    opt = MasterAdamW(ps)
    assert all(m is p for m, p in zip(opt.master, ps))


def test_state_dict_round_trip_continues_identically():
    a, b = _params(3, torch.bfloat16), _params(3, torch.bfloat16)
    oa = MasterAdamW(a, lr=1e-2, weight_decay=0.01)
    for s in range(3):
        _grads(a, s)
        oa.step()
    sd = oa.state_dict()
    ob = MasterAdamW(b, lr=1e-2, weight_decay=0.01)
    ob.load_state_dict(sd)
    for p, q in zip(a, b):
        assert torch.equal(p, q)  # params re-derived from the loaded masters
    for s in range(3, 5):
        _grads(a, s)
        _grads(b, s)
        oa.step()
        ob.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_clip_grad_norm():
    ps = _params(4)
    _grads(ps, 0)
    total = math.sqrt(sum(float((p.grad ** 2).sum()) for p in ps))
    ref = [p.grad.clone() for p in ps]
    norm = clip_grad_norm_([p.grad for p in ps], 1.0)
    assert norm.item() == pytest.approx(total, rel=1e-5)
    for p, g in zip(ps, ref):
        torch.testing.assert_close(p.grad, g * (1.0 / (total + 1e-6)))
    _grads(ps, 0)
    clip_grad_norm_([p.grad for p in ps], 1e9)  # far below the limit: coefficient clamps to exactly 1
    assert all(torch.equal(p.grad, g) for p, g in zip(ps, ref))


def test_lr_schedule():
    kw = dict(lr=1.0, total_steps=11, warmup_steps=2)
    assert lr_at(0, **kw) == 0.5 and lr_at(1, **kw) == 1.0
    assert lr_at(2, **kw) == pytest.approx(1.0)              # cosine starts at the peak
    assert lr_at(10, **kw) == pytest.approx(0.0, abs=1e-12)  # ... and ends at min_lr_ratio * lr
    assert lr_at(6, **kw) == pytest.approx(0.5)               # half way: cos(pi/2)
    assert lr_at(10, **kw, min_lr_ratio=0.1) == pytest.approx(0.1)
    assert lr_at(6, lr=1.0, total_steps=11, warmup_steps=2, schedule="linear") == pytest.approx(0.5)
    assert lr_at(9, lr=2.0, total_steps=11, schedule="constant") == 2.0
    with pytest.raises(ValueError, match="schedule"):
        lr_at(3, lr=1.0, total_steps=5, schedule="step")


def test_bf16_grads_accumulate_in_fp32():
    """Two backward passes into a bf16 param: the optimizer sees the fp32 sum, not bf16 rounding."""
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    opt = MasterAdamW([p], lr=1.0)
    x1 = torch.tensor([1.0, 1.0, 1.0])
    x2 = torch.tensor([1e-3, 2e-3, 3e-3])  # far below bf16 resolution at 1.0
    (p.float() * x1).sum().backward()
    (p.float() * x2).sum().backward()
    assert p.grad is None  # moved into the fp32 buffer
    (g,) = opt.grads()
    assert g.dtype == torch.float32
    torch.testing.assert_close(g, (x1.to(torch.bfloat16).float() + x2.to(torch.bfloat16).float()))
    assert not torch.equal(g.to(torch.bfloat16).float(), g)  # bf16 accumulation would have lost it
    opt.step()
    opt.zero_grad()
    assert opt.grads() == []


def test_second_optimizer_on_the_same_bf16_params_owns_the_gradients():
    """SFT's optimizer, then GRPO's on the same weights (the demo does this): the newer one
    gets the fp32 gradients, the older one none, and nothing crashes (the first GPU demo run
    died here: the first optimizer's hook cleared .grad before the second's ran)."""
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    first = MasterAdamW([p], lr=1.0)
    (p.float() * 2).sum().backward()
    assert len(first.grads()) == 1
    first.zero_grad()
    second = MasterAdamW([p], lr=1.0)
    (p.float() * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert first.grads() == [] and p.grad is None
    (g,) = second.grads()
    torch.testing.assert_close(g, torch.tensor([1.0, 2.0, 3.0]))
    del first, second  # no owner left: gradients accumulate in .grad as usual
    (p.float() * 3).sum().backward()
    assert p.grad is not None


def _snapshot(opt):
    sd = opt.state_dict()
    return [p.detach().clone() for p in opt.params], sd["step"], \
        [t.clone() for t in sd["exp_avg"] + sd["exp_avg_sq"] + [m for m in sd["master"] if m is not None]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", ["loss_nan", "norm_inf"])
def test_non_finite_step_is_skipped_and_leaves_weights_and_state_unchanged(dtype, bad):
    ours, ref = _params(0, dtype), _params(0, dtype)
    opt, ropt = MasterAdamW(ours, lr=1e-2), MasterAdamW(ref, lr=1e-2)
    guard = NonFiniteGuard(max_consecutive=3)
    # one good step on both
    for params, o in ((ours, opt), (ref, ropt)):
        _grads(params, 0)
        assert guard.step(o, 1e-2, loss=torch.tensor(1.0), grad_norm=clip_grad_norm_(o.grads(), 1.0))
        o.zero_grad()
    before = _snapshot(opt)
    # a poisoned step on ours only: the gradients carry the NaN, as a real one would
    _grads(ours, 1)
    ours[0].grad[0, 0] = float("nan") if bad == "loss_nan" else float("inf")
    loss = torch.tensor(float("nan") if bad == "loss_nan" else 2.0)
    norm = clip_grad_norm_(opt.grads(), 1.0)
    assert not guard.step(opt, 1e-2, loss=loss, grad_norm=norm)
    opt.zero_grad()
    after = _snapshot(opt)
    assert after[1] == before[1]
    for a, b in zip(before[0] + before[2], after[0] + after[2]):
        assert torch.equal(a, b)
    assert guard.pop_skipped() == 1.0 and guard.pop_skipped() == 0.0
    # the next good step equals that of a run that never saw the bad one (bias correction included)
    for params, o in ((ours, opt), (ref, ropt)):
        _grads(params, 2)
        assert guard.step(o, 1e-2, loss=torch.tensor(1.0), grad_norm=clip_grad_norm_(o.grads(), 1.0))
        o.zero_grad()
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    assert guard.consecutive == 0 and guard.total_skipped == 1


def test_consecutive_non_finite_steps_stop_the_run_with_a_clear_error():
    params = _params(0)
    opt = MasterAdamW(params, lr=1e-2)
    guard = NonFiniteGuard(max_consecutive=2)
    nan = torch.tensor(float("nan"))
    assert not guard.step(opt, loss=nan, grad_norm=torch.tensor(1.0), where="step 7")
    with pytest.raises(NonFiniteError, match=r"step 8: 2 optimizer steps in a row had a non-finite loss or gradient "
                                             r"norm \(last: loss 1.0, grad norm inf\); stopping \(the limit is 2\)"):
        guard.step(opt, loss=torch.tensor(1.0), grad_norm=torch.tensor(float("inf")), where="step 8")
    assert opt.step_count == 0
    never = NonFiniteGuard(max_consecutive=0)
    assert not any(never.finite(nan, nan) for _ in range(10)) and never.total_skipped == 10
    with pytest.raises(ValueError, match="max_consecutive must be >= 0"):
        NonFiniteGuard(max_consecutive=-1)
    resumed = NonFiniteGuard(max_consecutive=2)
    resumed.load_state_dict({"consecutive": 1, "total_skipped": 4})
    with pytest.raises(NonFiniteError):
        resumed.finite(nan, 1.0)


def test_nonfinite_tensors_names_them():
    named = [("a", torch.zeros(3)), ("b", torch.tensor([1.0, float("inf")])), ("i", torch.arange(3)),
             ("c", torch.tensor([float("nan")], dtype=torch.bfloat16))]
    assert nonfinite_tensors(named) == ["b", "c"]
    assert nonfinite_tensors([]) == []
