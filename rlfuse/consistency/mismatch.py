"""Rollout vs training log-prob mismatch, logged every RL step.

The engine reports log p(token) at sampling time (paged KV cache, decode kernels); the
trainer recomputes the same quantity with a packed forward (varlen attention). Both use
`rlfuse.kernels.loss.logprob.token_logprobs`, so any difference is numerical drift of the
forward (attention kernel, reduction order, dtype), never a different definition.
Over masked tokens, with d = train - rollout:
    max_abs  = max |d|          mean_abs = mean |d|
    kl_k3    = mean(exp(-d) + d - 1)   ~ KL(train || rollout) estimated on rollout samples
    ratio_max = max exp(d)      (the importance ratio at the first PPO iteration; 1 = exact)
All results are 0-dim tensors (no host sync here; the logger syncs once per step).
"""

from __future__ import annotations

import torch


def logprob_mismatch(train_logp: torch.Tensor, rollout_logp: torch.Tensor,
                     mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    d = train_logp.detach().double() - rollout_logp.detach().to(train_logp.device).double()
    m = torch.ones_like(d) if mask is None else mask.to(d.device).double()
    n = m.sum().clamp_min(1.0)
    absd = d.abs() * m
    return {
        "max_abs": absd.max() if d.numel() else d.new_zeros(()),
        "mean_abs": absd.sum() / n,
        "kl_k3": ((torch.exp(-d) + d - 1.0) * m).sum() / n,
        "ratio_max": (torch.exp(d) * m).max() if d.numel() else d.new_ones(()),
    }
