"""Off-policy corrections for fast numerics: the rollout's log-probs come from the engine's
forward, the old policy of the PPO ratio from the trainer's (a no-grad recompute), and the
two differ (~1e-2 in bf16, docs/numerics.md). With d_t = log pi_old(y_t) - log pi_rollout(y_t):

  TIS     (truncated importance sampling, token level)  A_t <- A_t * min(exp(d_t), cap)
          The weight is a stop-gradient and >= 0, so weighting the advantage weights the
          whole clipped PPO term: min(r A w, clip(r) A w) = w min(r A, clip(r) A).
  MIS     (sequence masking)  a completion with exp(mean_t d_t) outside [low, high] gets mask 0
  IcePop  (token masking)     tokens with exp(d_t) outside [low, high] get mask 0

Masked tokens are dropped from the loss like truncated completions are. In exact numerics
d_t = 0 bitwise and the trainer never recomputes, so none of this runs.
Metrics (token-weighted means over the step): offpolicy/ratio_mean, offpolicy/tis_weight,
offpolicy/tis_capped_frac, offpolicy/mis_masked_frac, offpolicy/icepop_masked_frac.
Test: python -m pytest -q tests/test_grpo_algorithms.py -k off_policy
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

def off_policy_corrections(log_ratio_N: torch.Tensor, adv_N: torch.Tensor, mask_N: torch.Tensor,
                           seq_ids_N: torch.Tensor, num_seqs: int, *, tis_cap: float | None = None,
                           mis_bounds: tuple[float, float] | None = None,
                           icepop_bounds: tuple[float, float] | None = None):
    """log_ratio_N (N,) = old - rollout log-probs per token -> (adv_N, mask_N, metrics);
    metrics are per-token means over the unmasked tokens of this micro-batch."""
    d = log_ratio_N.detach().float()
    ratio = torch.exp(d)
    live = mask_N > 0
    n = live.sum().clamp_min(1)
    stats = {"offpolicy/ratio_mean": (ratio * live).sum() / n}
    if tis_cap is not None:
        w = ratio.clamp(max=tis_cap)
        adv_N = adv_N * w
        stats["offpolicy/tis_weight"] = (w * live).sum() / n
        stats["offpolicy/tis_capped_frac"] = ((ratio > tis_cap) & live).sum() / n
    keep = torch.ones_like(d, dtype=torch.bool)
    if mis_bounds is not None:
        tok_per_seq = torch.zeros(num_seqs, device=d.device).index_add_(0, seq_ids_N, torch.ones_like(d))
        mean_d = torch.zeros(num_seqs, device=d.device).index_add_(0, seq_ids_N, d) / tok_per_seq.clamp_min(1)
        seq_ok = (torch.exp(mean_d) >= mis_bounds[0]) & (torch.exp(mean_d) <= mis_bounds[1])
        stats["offpolicy/mis_masked_frac"] = (~seq_ok[seq_ids_N] & live).sum() / n
        keep &= seq_ok[seq_ids_N]
    if icepop_bounds is not None:
        tok_ok = (ratio >= icepop_bounds[0]) & (ratio <= icepop_bounds[1])
        stats["offpolicy/icepop_masked_frac"] = (~tok_ok & live).sum() / n
        keep &= tok_ok
    return adv_N, mask_N * keep.to(mask_N.dtype), stats


def recompute_old_logprobs(g, numerics: str) -> bool:
    """Whether a GRPO step recomputes the old policy's log-probs with a trainer forward
    (`g`: the GRPOConfig): in fast numerics when asked (grpo.old_logprobs recompute) or
    when an off-policy correction needs the trainer's view; never in exact numerics, where
    the rollout's log-probs ARE the trainer's, bitwise. Logs the choice."""
    corrections = g.tis_cap is not None or g.mis_bounds is not None or g.icepop_bounds is not None
    if numerics == "exact" and (g.old_logprobs == "recompute" or corrections):
        log.info("numerics exact: old log-probs = the rollout's (bitwise the trainer's); no recompute "
                 "forward, and the off-policy corrections are identities")
    log.info("numerics %s (engine.numerics): %s", numerics,
             "rollout log-probs equal the trainer's bitwise; mismatch/* must read 0" if numerics == "exact"
             else "rollout log-probs drift from the trainer's (~1e-2 in bf16); mismatch/* logs it every step")
    return numerics == "fast" and (g.old_logprobs == "recompute" or corrections)
