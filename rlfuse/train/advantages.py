"""Advantage estimators: rewards of a rollout batch -> per-token advantages.

Rewards r (P*G,) in prompt-major order, G = group size, completion i of n_i tokens.
`grpo.advantage` picks the estimator:

group (GRPO family), one value per sequence, copied to its tokens:
    c_ij = r_ij - mean_j r_ij
    A_ij = c_ij / (std_j r_ij + eps)   scale="group"  (GRPO; std unbiased, torch's default)
    A_ij = c_ij / (std   r    + eps)   scale="batch"  (std over the whole batch)
    A_ij = c_ij                        scale="none"   (Dr. GRPO)
rloo (leave-one-out baseline), one value per sequence:
    A_ij = r_ij - (1 / (G - 1)) sum_{k != j} r_ik  =  G / (G - 1) * c_ij
reinforce_pp (REINFORCE++, Hu 2025, arXiv:2501.03262), per token, with the KL folded
into the reward as in the paper (k1 of the sampling policy against the reference,
kl_t = old_t - ref_t; 0 when kl_coef == 0):
    return   R_t = r_i - kl_coef * sum_{u >= t in i} kl_u        (gamma = 1)
    A_t      = (R_t - mean R) / (std R + eps)                     mean, std over every
             completion token of the batch (global batch normalization; std unbiased)
reinforce_pp_baseline: the same with r_ij - mean_j r_ij (the group mean subtracted
    first) in place of r_i ("REINFORCE++ with baseline", the paper's version for
    reasoning tasks with several samples per prompt).
`drop_rewards` gives dropped failed episodes their group's mean reward (rollout.failed_episode).
`zero_variance_groups` marks groups whose rewards are all equal (DAPO dynamic sampling
drops them: for group and rloo their advantages are 0 and they only dilute the batch).
The losses these advantages feed are in `rlfuse.kernels.loss.policy`.
Test: python -m pytest -q tests/test_grpo_algorithms.py tests/test_estimators.py
"""

from __future__ import annotations

import torch

from rlfuse.run.config import ADV_SCALES, ESTIMATORS

KL_IN_REWARD = ("reinforce_pp", "reinforce_pp_baseline")
"""Estimators that fold the KL penalty into the per-token return (the loss then has no KL term)."""


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not a whole number of groups of {group_size}")
    return rewards.reshape(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group",
                     eps: float = 1e-6) -> torch.Tensor:
    """rewards (P*G,) -> advantages (P*G,) fp32; see the module docstring."""
    r_PG = _groups(rewards, group_size).float()
    if scale not in ADV_SCALES:
        raise ValueError(f"adv_scale must be one of {ADV_SCALES}, got {scale!r}")
    centred = r_PG - r_PG.mean(1, keepdim=True)
    if scale == "group":
        adv = centred / (r_PG.std(1, keepdim=True) + eps)
    elif scale == "batch":
        adv = centred / (r_PG.std() + eps)
    else:
        adv = centred
    return adv.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards (P*G,) -> (P*G,) fp32: each reward minus the mean of the other G - 1 of its group."""
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2 (a leave-one-out baseline), got {group_size}")
    r_PG = _groups(rewards, group_size).float()
    loo_mean = (r_PG.sum(1, keepdim=True) - r_PG) / (group_size - 1)
    return (r_PG - loo_mean).reshape(-1)


def reinforce_pp_advantages(rewards: torch.Tensor, lengths: list[int], *, group_size: int | None = None,
                            kl_N: torch.Tensor | None = None, kl_coef: float = 0.0,
                            eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ token advantages (N,) fp32, N = sum(lengths), sequence after sequence.
    rewards (B,); group_size given: subtract the group mean first (the baseline variant);
    kl_N (N,): per-token kl_t folded into the return with weight kl_coef."""
    if len(lengths) != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards for {len(lengths)} sequences")
    r = rewards.double()
    if group_size is not None:
        r_PG = _groups(r, group_size)
        r = (r_PG - r_PG.mean(1, keepdim=True)).reshape(-1)
    lens = torch.tensor(lengths, dtype=torch.long)
    ret_N = r.repeat_interleave(lens)  # (N,)
    if kl_N is not None and kl_coef != 0.0 and ret_N.numel():
        if kl_N.numel() != ret_N.numel():
            raise ValueError(f"kl_N has {kl_N.numel()} tokens, the sequences {ret_N.numel()}")
        # suffix sums within each sequence from the global inclusive prefix sum:
        # sum_{u >= t in i} kl_u = incl[last token of i] - incl[t] + kl_t
        kl = kl_N.detach().double().cpu()
        incl = kl.cumsum(0)
        last = (lens.cumsum(0) - 1).clamp_min(0)  # empty sequences repeat 0 times below
        suffix = incl[last].repeat_interleave(lens) - incl + kl
        ret_N = ret_N - kl_coef * suffix
    if ret_N.numel() < 2:
        return torch.zeros_like(ret_N, dtype=torch.float32)
    return ((ret_N - ret_N.mean()) / (ret_N.std() + eps)).float()


def token_advantages(estimator: str, rewards: torch.Tensor, lengths: list[int], group_size: int, *,
                     adv_scale: str = "group", eps: float = 1e-6, kl_N: torch.Tensor | None = None,
                     kl_coef: float = 0.0) -> list[torch.Tensor]:
    """The advantages of `grpo.advantage` = `estimator`: one (n_i,) fp32 tensor per sequence
    (n_i = lengths[i]); kl_N only for the KL_IN_REWARD estimators."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage must be one of {ESTIMATORS}, got {estimator!r}")
    if estimator in KL_IN_REWARD:
        adv_N = reinforce_pp_advantages(rewards, lengths, kl_N=kl_N, kl_coef=kl_coef, eps=eps,
                                        group_size=group_size if estimator == "reinforce_pp_baseline" else None)
        return list(adv_N.split(lengths))
    seq = group_advantages(rewards, group_size, adv_scale, eps) if estimator == "group" else \
        rloo_advantages(rewards, group_size)
    return [seq[i].expand(n) for i, n in enumerate(lengths)]


def drop_rewards(rewards: torch.Tensor, dropped: list[bool], group_size: int) -> torch.Tensor:
    """rewards (P*G,) with each dropped sample's (rollout.failed_episode drop) replaced by the
    mean of its group's kept ones, so it moves neither the baseline nor the others' advantages
    (its loss mask is zero: it trains nothing itself). A group with none kept stays as it is."""
    r_PG = _groups(rewards, group_size).clone().float()
    d_PG = torch.tensor(dropped, dtype=torch.bool).reshape(r_PG.shape)
    kept = (~d_PG).sum(1, keepdim=True)
    mean = torch.where(d_PG, 0.0, r_PG).sum(1, keepdim=True) / kept.clamp_min(1)
    return torch.where(d_PG & (kept > 0), mean, r_PG).reshape(-1)


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(P,) bool: all G rewards of the group are equal."""
    r_PG = rewards.view(-1, group_size)
    return (r_PG == r_PG[:, :1]).all(1)
