"""Test-session set-up: Triton kernels run under Triton's interpreter on CPU-only machines.

TRITON_INTERPRET must be set before triton decorates any kernel, i.e. before the first
import of a module of rlfuse.kernels, hence here at conftest import time."""

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
