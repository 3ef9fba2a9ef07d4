"""The kernel warm-up (rlfuse/train/warm.py): its forward and backward run the update's
ops on a dummy batch without touching the weights or their .grad, for full models and
LoRA adapters, in both numerics; on CPU the trainer starts no workers. The dry run and the
worker compile need CUDA: tests/test_gpu_warm.py. (What it saves, the first step's compile
time, is a GPU number: benchmarks/bench_grpo_step.py --warm-kernels.)
Run: python -m pytest -q tests/test_warm.py
"""

import pytest
import torch
from train_setup import one_thread, tiny_cfg, tiny_session

from rlfuse.kernels.backend import use_numerics
from rlfuse.model.lora import has_lora
from rlfuse.train.grpo import GRPOStep
from rlfuse.train.loop import make_optimizer
from rlfuse.train.warm import KernelWarmup, policy_head


@pytest.mark.parametrize("numerics", ["fast", "exact"])
@pytest.mark.parametrize("lora", [False, True])
def test_warmup_runs_the_update_ops_and_leaves_weights_and_grads_alone(tmp_path, numerics, lora):
    over = [f"engine.numerics={numerics}", "grpo.log_entropy=true"]
    if lora:
        over.append("model.lora={rank: 4, alpha: 8}")
    cfg = tiny_cfg(tmp_path, *over)
    with one_thread():
        ses = tiny_session(cfg)
        model = ses.model
        assert has_lora(model) == lora
        trainer = GRPOStep(cfg, model, ses.sampler, ses.rewards(), None, make_optimizer(model, cfg))
        assert trainer.update.warm.workers == []  # CPU: no compiler to warm, no workers
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        heads = []

        def head(h, batch):
            loss = policy_head(trainer.update, h, batch)
            heads.append(loss.detach())
            return loss

        w = KernelWarmup(model, head, numerics=numerics, enabled=False)
        w.lengths = ((40, 8), (30, 8))  # CPU-sized (the GPU's exact dummy is a 4096-token micro-batch)
        with use_numerics(numerics):
            w._forward_backward()
        assert len(heads) == 1 and torch.isfinite(heads[0])
        assert all(p.grad is None for p in model.parameters())
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_compile_worker_reports_each_request():
    """The worker protocol (the GPU test runs real specializations): one JSON line back per
    request, a bad one reported by its error, the next one still served."""
    pytest.importorskip("triton")
    import json
    import subprocess

    from rlfuse.kernels.backend import compile_worker_command
    target = {"backend": "cuda", "arch": 90, "warp_size": 32}
    bad = ["rlfuse.kernels.norm.triton_rms", "_rmsnorm_fwd_kernel", "{}", target]
    missing = ["rlfuse.kernels.norm.triton_rms", "no_such_kernel", "{}", target]
    out = subprocess.run(compile_worker_command(), input="".join(json.dumps(r) + "\n" for r in (bad, missing)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(x) for x in out.stdout.splitlines() if x.startswith('{"kernel"')]
    assert [r["kernel"] for r in rows] == ["_rmsnorm_fwd_kernel", "no_such_kernel"]
    assert rows[0]["error"].startswith("KeyError") and rows[1]["error"].startswith("AttributeError")
