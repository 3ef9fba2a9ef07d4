"""`upload`: the engine step's host-to-device copy (the runner's, the static decode path's,
the eager step's and the sampler's), which never waits for the stream."""

from __future__ import annotations

import torch


def upload(x, dtype, device: torch.device) -> torch.Tensor:
    """Host list / array -> device, without waiting for the stream: pinned staging on
    CUDA (a pageable copy would block the host until the device reached it, which
    defeats launching a step ahead); the caching host allocator keeps the staging
    buffer alive until its copy ran."""
    t = torch.as_tensor(x, dtype=dtype)
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
