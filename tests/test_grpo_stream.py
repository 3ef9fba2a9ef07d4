"""grpo.overlap stream against sync on the real engine (CPU, tiny model): completions stop
at lengths drawn per (prompt, sample) so groups finish out of order; the parameters after
a few steps equal sync mode's bitwise where the module docstring says they do
(rlfuse/train/grpo_stream.py), to fp32 rounding where a normalizer is known only at the
end; settings that need the whole batch are refused by name."""

import random

import pytest
import torch
from train_setup import one_thread, tiny_cfg

from rlfuse.data.prompts import PromptStream, build_prompts
from rlfuse.rollout import LengthsSampler
from rlfuse.train.grpo import GRPOStep
from rlfuse.train.grpo_stream import OrderedGradients, _Worker, overlap_fraction
from rlfuse.train.loop import make_optimizer
from rlfuse.train.session import open_session

STEPS = 3


def _lengths(i: int, k: int) -> int:
    """Mostly short, one in eight long: the group holding a long one finishes last. Prompt 1
    of each step: all 2 (equal rewards: a zero-variance group for dynamic sampling)."""
    if i == 1:
        return 2
    r = random.Random(1000 * i + k)
    return 8 if r.random() < 0.125 else r.randint(1, 3)


def _run(tmp_path, overlap: str, *overrides: str, threaded: bool | None = None, **sections):
    cfg = tiny_cfg(tmp_path / overlap, f"grpo.overlap={overlap}", "grpo.max_new_tokens=8", *overrides, **sections)
    ses = open_session(cfg)
    ses._sampler = LengthsSampler(ses.sampler.llm, ses.tokenizer, _lengths)
    prompts = build_prompts(ses.train_rows, ses.tokenizer, cfg.data)
    tr = GRPOStep(cfg, ses.model, ses.sampler, ses.rewards(), PromptStream(prompts, seed=0),
                     make_optimizer(ses.model, cfg))
    if threaded is not None:
        tr.streamer.threaded = threaded
    with one_thread():
        ms = [tr.step(s) for s in range(STEPS)]
    return {n: p.detach().clone() for n, p in ses.model.named_parameters()}, ms


@pytest.mark.parametrize("loss_type, dtype", [("grpo", "float32"), ("dr_grpo", "float32"), ("grpo", "bfloat16")])
def test_stream_equals_sync_bitwise(tmp_path, loss_type, dtype):
    """One sequence per micro-batch (sync's packing then cuts at group boundaries too): the
    same additions in the same order, whatever order the groups finish in (bf16: through
    the optimizer's fp32 gradient buffers)."""
    over = (f"grpo.loss_type={loss_type}", "grpo.micro_batch_tokens=1", f"model.dtype={dtype}")
    sync, ms_sync = _run(tmp_path, "sync", *over)
    stream, ms = _run(tmp_path, "stream", *over)
    assert max(float(m["stream/grad_slots_max"]) for m in ms) > 0, "no group finished out of order"
    assert all(0.0 < m["stream/overlap_frac"] <= 1.0 for m in ms)
    for n in sync:
        assert torch.equal(sync[n], stream[n]), n
    for a, b in zip(ms_sync, ms):
        assert float(a["loss"]) == float(b["loss"]) and float(a["reward/mean"]) == float(b["reward/mean"])
        # token-weighted statistics are summed unnormalized and divided once at the end
        assert float(a["entropy"]) == pytest.approx(float(b["entropy"]), rel=1e-6)


def test_stream_on_a_worker_thread_equals_sync_bitwise(tmp_path):
    """The CUDA design on CPU: groups train on a worker thread while the main thread steps
    the engine (really concurrent on the shared weights); still sync's parameters."""
    over = ("grpo.micro_batch_tokens=1", "grpo.kl_coef=0.05")  # and a reference model in the worker
    sync, _ = _run(tmp_path, "sync", *over)
    stream, ms = _run(tmp_path, "stream", *over, threaded=True)
    assert max(float(m["stream/grad_slots_max"]) for m in ms) > 0
    for n in sync:
        assert torch.equal(sync[n], stream[n]), n


@pytest.mark.parametrize("loss_type, extra", [("grpo", ()), ("cispo", ()), ("dapo", ("grpo.dynamic_sampling=true",
                                                                                       "grpo.mask_truncated=true"))])
def test_stream_equals_sync_to_rounding(tmp_path, loss_type, extra):
    """Micro-batches of several sequences (sync's span groups), or a normalizer known only at
    the end (token-level means, dynamic sampling): equal up to fp32 rounding of the
    gradients, which AdamW's 1 / sqrt(v) amplifies where a gradient element is near 0
    (seen: 1.5e-5 of a tensor's largest entry after 3 steps at lr 1e-2)."""
    over = (f"grpo.loss_type={loss_type}", "grpo.micro_batch_tokens=40", *extra)
    sync, ms_sync = _run(tmp_path, "sync", *over)
    stream, ms = _run(tmp_path, "stream", *over)
    assert [float(m["groups/kept"]) for m in ms] == [float(m["groups/kept"]) for m in ms_sync]
    if extra:
        assert min(float(m["groups/kept"]) for m in ms) < 4, "no group dropped: the rescale is untested"
    for n in sync:
        scale = float(sync[n].abs().max())
        torch.testing.assert_close(stream[n], sync[n], rtol=0, atol=1e-4 * scale, msg=n)


def test_ordered_gradients_sum_in_group_order_whatever_the_finishing_order():
    """The sum of per-micro-batch gradients taken in any group order is bitwise the
    in-order sum (plain backward accumulation), with held slots released."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64))
    xs = [[torch.randn(5, 64) * 10 ** k for _ in range(2)] for k in range(-3, 3)]  # 6 groups of 2

    class Opt:  # the take/put/add contract of MasterAdamW on one fp32 parameter
        def take_grads(self):
            g, w.grad = w.grad, None
            return [g]

        def put_grads(self, gs):
            w.grad = gs[0]

        def add_grads(self, gs):
            w.grad = gs[0] if w.grad is None else w.grad.add_(gs[0])

    def backward(x):
        return lambda: (x @ w).square().sum().backward()

    for group in xs:
        for x in group:
            backward(x)()
    want, w.grad = w.grad, None
    acc = OrderedGradients(Opt(), len(xs))
    for i in (3, 0, 5, 1, 4, 2):
        acc.run_group(i, [backward(x) for x in xs[i]])
    assert torch.equal(w.grad, want) and acc.held == 0 and acc.peak_held > 0
    assert overlap_fraction([(0.0, 1.0), (1.0, 3.0)], 0.0, 2.0) == pytest.approx(2 / 3)


def test_worker_runs_jobs_in_order_and_raises_the_first_error_on_the_main_thread():
    w = _Worker(torch.device("cpu"))
    seen = []
    w.submit(lambda: seen.append(1))
    w.submit(lambda: (_ for _ in ()).throw(ValueError("boom")))
    w.submit(lambda: seen.append(3))  # skipped after the error
    with pytest.raises(ValueError, match="boom"):
        w.finish()
    assert seen == [1] and not w.thread.is_alive() and len(w.spans) == 2


@pytest.mark.parametrize("setting", ["grpo.mu=2", "grpo.mini_batches=2", "grpo.adv_scale=batch",
                                     "grpo.advantage=reinforce_pp", "rollout.tools=[calculator]"])
def test_stream_refuses_settings_that_need_the_whole_batch(tmp_path, setting):
    key = setting.split("=")[0].split(".")[1]
    with pytest.raises(ValueError, match=rf"grpo\.overlap stream: .*{key}"):
        tiny_cfg(tmp_path, "grpo.overlap=stream", setting)
    with pytest.raises(ValueError, match=r"grpo\.overlap must be one of"):
        tiny_cfg(tmp_path, "grpo.overlap=async")


@pytest.mark.gpu
def test_stream_equals_sync_bitwise_on_cuda_side_stream(tmp_path):
    """On CUDA the groups train on a worker thread's side stream while the engine decodes:
    in exact numerics the parameters still equal sync mode's bit for bit."""
    from test_grpo_gpu import MODEL

    over = ("model.device=cuda", "model.dtype=bfloat16", "model.kernel_backend=auto", "engine.numerics=exact",
            "grpo.micro_batch_tokens=1")
    sections = {"model": {"random_init": MODEL}, "engine": {"gpu_memory_fraction": 0.5, "max_num_seqs": 64}}
    sync, _ = _run(tmp_path, "sync", *over, **sections)
    again, _ = _run(tmp_path / "again", "sync", *over, **sections)
    assert all(torch.equal(sync[n], again[n]) for n in sync), "sync mode itself is not deterministic here"
    stream, ms = _run(tmp_path, "stream", *over, **sections)
    assert max(float(m["stream/grad_slots_max"]) for m in ms) > 0
    assert all(m["memory/kv_pool_mb"] > 0 and m["memory/train_headroom_mb"] > 0 for m in ms)
    for n in sync:
        assert torch.equal(sync[n], stream[n]), n
