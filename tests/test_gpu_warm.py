"""GPU: the kernel warm-up (rlfuse/train/warm.py) on a cold Triton cache. The dry run
records the update's kernels without launching them, the worker processes compile them
into the cache, and the update's own launches then add nothing to the cache (they load
what the workers wrote), in fast and exact numerics.
Run: python -m pytest -q -m gpu tests/test_gpu_warm.py"""

import os

import pytest
import torch
from train_setup import tiny_cfg

from rlfuse.kernels.backend import use_numerics
from rlfuse.kernels.triton_common import forget_compiled
from rlfuse.train.grpo import GRPOStep
from rlfuse.train.loop import make_optimizer
from rlfuse.train.session import open_session
from rlfuse.train.warm import KernelWarmup, policy_head

pytestmark = pytest.mark.gpu

MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=128)


def _cache_entries(path) -> int:
    """Compiled kernels in a Triton cache (its .cubin files; the launcher stubs a process
    builds when it first loads a kernel are .so files, and do not count)."""
    return sum(f.endswith(".cubin") for _, _, files in os.walk(path) for f in files)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_workers_compile_what_the_update_launches(tmp_path, monkeypatch, numerics):
    cache = tmp_path / "triton_cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))  # cold, and inherited by the workers
    forget_compiled()  # a cold start: earlier tests (the exact shape sweep) compiled these kernels
    cfg = tiny_cfg(tmp_path, "model.dtype=bfloat16", "model.device=cuda", "model.kernel_backend=auto",
                   f"engine.numerics={numerics}", "grpo.warm_kernels=true", model={"random_init": MODEL},
                   engine={"gpu_memory_fraction": 0.3, "max_num_seqs": 16})
    ses = open_session(cfg)
    tr = GRPOStep(cfg, ses.model, ses.sampler, ses.rewards(), None, make_optimizer(ses.model, cfg))
    assert tr.update.warm.error is None, tr.update.warm.error
    m = tr.update.warm.wait()
    assert m.get("compile/warmup_failed", 0.0) == 0, (m, tr.update.warm.failures[:3])
    assert m["compile/warmup_kernels"] > 0, m
    n = _cache_entries(cache)
    # the same forward and backward for real: every kernel comes from the cache
    with use_numerics(numerics):
        KernelWarmup(ses.model, lambda h, b: policy_head(tr.update, h, b), numerics=numerics, enabled=False)._forward_backward()
    torch.cuda.synchronize()
    assert n > 0 and _cache_entries(cache) == n, "the update compiled kernels the workers did not"
