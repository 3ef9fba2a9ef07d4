"""PPO's estimators, as small pure functions on padded (B, T) tensors (mask m: 1 on the
model's tokens of a completion, 0 on right padding and, in multi-turn episodes, on the
observation tokens between turns).

GAE (Schulman et al. 2016, arXiv:1506.02438), per sequence, over the masked positions
only: t and t' = next(t) are consecutive positions with m = 1 (observation tokens are
transparent: they are skipped, not steps of the recursion, so gamma discounts per model
token and the value of a turn's last token bootstraps from the next turn's first token),
V_{next(t)} = 0 past the last masked token:
    delta_t = r_t + gamma V_{next(t)} - V_t
    A_t     = delta_t + gamma lam A_{next(t)}      R_t = A_t + V_t   (the value target)
A and R are 0 where m = 0, and r_t there is ignored. With no hole in the mask this is the
plain per-token recursion, bit for bit.
Whitening: A <- (A - mean_m A) / sqrt(var_m A + eps), over the masked tokens of the batch.
Clipped value loss (PPO2 / OpenAI baselines):
    V^clip_t = V^old_t + clamp(V_t - V^old_t, -c, c)
    l_t      = 1/2 max((V_t - R_t)^2, (V^clip_t - R_t)^2)   clip_frac = mean_m [clipped term > plain]
Explained variance: 1 - Var_m(R - V^old) / Var_m(R) (1: the critic predicts the returns).
Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593, sec. 2.2): after a batch of
n sequences whose mean summed KL is KL,
    e = clip(KL / target - 1, -0.2, 0.2);   beta <- beta (1 + e n / horizon)
Running reward statistics (Chan et al. parallel mean/variance update) normalize rewards:
    r' = (r - mean) / (std + eps), with the statistics of every batch so far, this one included.
Test: python -m pytest -q tests/test_ppo_math.py
"""

from __future__ import annotations

import dataclasses
import math

import torch


def gae(rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both (B, T) fp32 and 0 where mask is 0; masked-out positions
    are skipped (module docstring), so (next_adv, next_v) carry across them unchanged."""
    r, v, m = rewards_BT.float(), values_BT.float(), mask_BT.float()
    B, T = r.shape
    adv = torch.zeros_like(r)
    next_adv = r.new_zeros(B)
    next_v = r.new_zeros(B)
    for t in range(T - 1, -1, -1):
        on = m[:, t] > 0
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = (delta + gamma * lam * next_adv) * m[:, t]
        adv[:, t] = a
        next_adv = torch.where(on, a, next_adv)
        next_v = torch.where(on, v[:, t] * m[:, t], next_v)
    return adv, (adv + v) * m


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance over the masked entries."""
    mu = masked_mean(x, mask)
    return masked_mean((x - mu) ** 2, mask)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over masked entries; masked-out entries become 0."""
    return (x - masked_mean(x, mask)) * torch.rsqrt(masked_var(x, mask) + eps) * mask.to(x.dtype)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss l_t (masked, for the caller's aggregation), clip fraction over masked tokens);
    clip None: the plain 1/2 (V - R)^2."""
    plain = (values - returns) ** 2
    if clip is None:
        return 0.5 * plain * mask, values.new_zeros(())
    delta = values - old_values
    # V itself where the clamp does not bite: old + (V - old) rounds to a neighbour of V, and
    # the clip fraction would count such rounding ties as clipped (seen as 1 token in 44
    # flipping between 1 process and 2 ranks, tests/test_distributed_ppo.py)
    v_clip = torch.where(delta.abs() > clip, old_values + delta.clamp(-clip, clip), values)
    clipped = (v_clip - returns) ** 2
    with torch.no_grad():
        frac = masked_mean((clipped > plain).to(values.dtype), mask)
    return 0.5 * torch.maximum(plain, clipped) * mask, frac


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over masked entries (nan when Var(R) is 0)."""
    var_r = masked_var(returns, mask)
    return 1.0 - masked_var(returns - values, mask) / var_r


def adaptive_kl_coef(coef: float, observed_kl: float, target: float, horizon: int, n: int) -> float:
    """The next KL coefficient after a batch of n sequences (module docstring)."""
    e = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + e * n / horizon)


@dataclasses.dataclass
class RunningMoments:
    """Mean and variance of every value seen so far (merged batch by batch)."""
    count: float = 0.0
    mean: float = 0.0
    var: float = 1.0
    """Population variance (1 before any data, so normalizing is then the identity scale)."""

    def update(self, x: torch.Tensor) -> None:
        n = x.numel()
        if n == 0:
            return
        xd = x.double()
        b_mean, b_var = float(xd.mean()), float(xd.var(unbiased=False))  # host sync: rewards are host values
        tot = self.count + n
        delta = b_mean - self.mean
        m2 = self.var * self.count + b_var * n + delta * delta * self.count * n / tot
        self.mean += delta * n / tot
        self.var = m2 / tot
        self.count = tot

    EPS = 1e-6

    def normalize(self, x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
        return (x - self.mean) / (math.sqrt(self.var) + eps)

    def slope(self, eps: float = EPS) -> float:
        """d normalize(x) / dx: how a part of a reward scales (PPO's per-turn rewards)."""
        return 1.0 / (math.sqrt(self.var) + eps)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, sd: dict) -> None:
        self.count, self.mean, self.var = float(sd["count"]), float(sd["mean"]), float(sd["var"])
