"""Per-token log-probabilities straight from hidden states and the LM head.

    logits_i = h_i . W^T / T            (never materialized as (N, V) in the fast path)
    logp_i   = logits_i[y_i] - logsumexp(logits_i)
    H_i      = logsumexp(logits_i) - sum_v softmax(logits_i)_v * logits_i[v]   (entropy)

Contract: hidden (N, D), weight (V, D), targets (N,) int64, temperature a Python float
> 0. Outputs fp32 (N,) log-probs (and entropy when asked). fp32 accumulation for any
input dtype. Differentiable w.r.t. hidden and weight. Batch-invariant in the Triton
kernel: row i's result does not depend on the other rows.

This is THE log-prob of rlfuse: the engine reports rollout log-probs with this function
and the trainer optimizes this quantity, so the two agree by construction.
"""

from __future__ import annotations

import torch

from rlfuse.kernels.backend import resolve_backend


def token_logprobs_ref(hidden, weight, targets, temperature: float = 1.0,
                       return_entropy: bool = False):
    logits = (hidden.float() @ weight.float().t()) / temperature  # (N, V) fp32
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(1, targets.long()[:, None]).squeeze(1) - lse
    if not return_entropy:
        return logp
    probs = torch.softmax(logits, dim=-1)
    entropy = lse - (probs * logits).sum(-1)
    return logp, entropy


_HAS_TRITON = False


def token_logprobs(hidden, weight, targets, temperature: float = 1.0,
                   return_entropy: bool = False):
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if resolve_backend("token_logprobs", hidden, has_triton=_HAS_TRITON) == "triton":
        raise NotImplementedError
    return token_logprobs_ref(hidden, weight, targets, temperature, return_entropy)
