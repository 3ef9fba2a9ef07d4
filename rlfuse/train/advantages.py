"""Advantage estimators: rewards of a rollout batch -> per-sequence advantages.

Group-relative (GRPO family), rewards (P*G,) in prompt-major order, G = group size:
    c_ij = r_ij - mean_j r_ij
    A_ij = c_ij / (std_j r_ij + eps)   scale="group"  (GRPO; std unbiased, torch's default)
    A_ij = c_ij / (std   r    + eps)   scale="batch"  (std over the whole batch)
    A_ij = c_ij                        scale="none"   (Dr. GRPO)
`zero_variance_groups` marks groups whose rewards are all equal (DAPO dynamic sampling
drops them: their advantages are 0 and they only dilute the batch).
The losses these advantages feed are in `rlfuse.kernels.policy_loss`.
Test: python -m pytest -q tests/test_grpo_algorithms.py
"""

from __future__ import annotations

import torch

ADV_SCALES = ("group", "batch", "none")
"""Normalizers of the centred group rewards (module docstring)."""


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group",
                     eps: float = 1e-6) -> torch.Tensor:
    """rewards (P*G,) -> advantages (P*G,) fp32; see the module docstring."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not a whole number of groups of {group_size}")
    if scale not in ADV_SCALES:
        raise ValueError(f"adv_scale must be one of {ADV_SCALES}, got {scale!r}")
    r_PG = rewards.float().view(-1, group_size)
    centred = r_PG - r_PG.mean(1, keepdim=True)
    if scale == "group":
        adv = centred / (r_PG.std(1, keepdim=True) + eps)
    elif scale == "batch":
        adv = centred / (r_PG.std() + eps)
    else:
        adv = centred
    return adv.reshape(-1)


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(P,) bool: all G rewards of the group are equal."""
    r_PG = rewards.view(-1, group_size)
    return (r_PG == r_PG[:, :1]).all(1)
