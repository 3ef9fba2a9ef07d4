"""GRPO-family policy losses: PPO-clip (or CISPO) per token, fused in one Triton pass,
plus segment-sum aggregation over sequences.

Per token t of sequence i (mask m_t, advantage A_t, d_t = logp_t - old_t):
    ratio     r_t = exp(d_t)                              grpo / dapo / dr_grpo
              r_t = s_i = exp((1/n_i) sum_{u in i} m_u d_u)   gspo (sequence ratio; gradient
              through the per-token form sg(s_i) exp(logp_t - sg(logp_t)): d r_t/d logp_t = s_i)
    clip      c_t = clamp(r_t, 1 - clip_low, 1 + clip_high)
    pg_t      = -min(r_t A_t, c_t A_t)
    dual clip (c > 1; Ye et al. 2020 "dual-clip PPO", bounds the loss of negative
              advantages when r_t explodes): where A_t < 0 and pg_t > -c A_t, pg_t = -c A_t
    cispo     (MiniMax-M1, arXiv:2506.13585) pg_t = -sg(w_t) A_t logp_t with the importance
              weight capped above only, w_t = min(r_t, 1 + clip_high), as the paper (and TRL);
              cispo_clip_low=True also bounds it below: w_t = c_t. The weight is detached,
              so every token keeps a gradient (no dual clip)
    kl_t      = k1: e | k2: e^2 / 2 | k3: exp(-e) + e - 1,   e = logp_t - ref_t
              (0 when ref_logp is None or kl_coef == 0)
    kl_ratio  (TRL's use_bias_correction_kl, DeepSeek-V3.2) the KL term is r_t kl_t, r_t the
              token ratio with its gradient: the expected gradient is then that of the reverse
              KL(pi || ref) even off-policy (plain k3's is that of KL(ref || pi)); not for gspo
    l_t       = pg_t + kl_coef * kl_t         (kl_coef * r_t kl_t with kl_ratio)
Derivative w.r.t. logp_t (the "grad coefficient"):
    d pg_t = 0 where the clipped branch won (c_t A_t < r_t A_t) or the dual-clip cap applies,
             else -A_t r_t                     (ties split by torch.minimum sum to the same)
           = -w_t A_t                          cispo
    d kl_t = 1 | e | 1 - exp(-e)               (kl_ratio: r_t (d kl_t + kl_t))
Aggregation: loss = sum_t w_t l_t with n_i = max(sum_{t in i} m_t, 1), B = num_seqs:
    grpo, gspo: w_t = m_t / (n_i B)     (mean over sequences of the token mean)
    dapo, cispo: w_t = m_t / max(sum m, 1)            (token-level mean, as both papers)
    dr_grpo:    w_t = m_t / (B max_tokens)            (constant normalizer)
Masked tokens (m_t = 0) contribute 0 loss and 0 grad even where their inputs are not
finite (the kernel selects, it does not multiply). Stats, means over masked tokens:
clip_frac (clipped branch or dual cap; cispo: r_t beyond its bounds), clip_frac_low (r < 1 - clip_low, A < 0),
clip_frac_high (r > 1 + clip_high, A > 0), ratio_mean, kl.
Micro-batches: each loss is normalized within its own batch; `accumulation_weight` scales
it to its share of the full batch's normalizer, so accumulated gradients equal those of
the loss on the whole batch.

Triton path: the weights w_t (and gspo's s_i) come from torch segment ops (index_add, no
host sync); `_policy_loss_kernel` computes l_t, d l_t / d logp_t * w_t (saved: backward is one
multiply) and per-block partial sums of the loss and the stats, one row per program in the
columns `PART_*` below; torch adds the (P, PART_COLS) partials (fixed order: deterministic). Computes in fp64 for fp64 logp, else fp32.
`grpo_loss_from_hidden` composes `token_logprobs` (fused linear log-prob, autograd)
with `policy_loss`: hidden states to loss and gradients with no (N, V) logits.
Tests: `python -m pytest -q tests/test_kernel_policy_loss.py`.
"""

from __future__ import annotations

import torch

from rlfuse.kernels.backend import resolve_backend, triton_ops
from rlfuse.kernels.loss.logprob import token_logprobs

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo", "cispo")
"""Aggregations (and gspo's sequence ratio, cispo's surrogate) of the module docstring."""
TOKEN_MEAN_TYPES = ("dapo", "cispo")
"""Loss types normalized by the token count (the rest by the sequence count)."""
KL_TYPES = ("k1", "k2", "k3")
"""Per-token estimators of KL(policy || reference) from the policy's samples."""


def _seg_sum(x_N, seq_ids, num_seqs: int):
    return x_N.new_zeros(num_seqs).index_add_(0, seq_ids, x_N)


def _validate(loss_type, kl_type, dual_clip, max_tokens, kl_ratio=False, cispo_clip_low=False):
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")
    if loss_type == "dr_grpo" and not max_tokens:
        raise ValueError("loss_type 'dr_grpo' needs max_tokens (the constant length normalizer)")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if dual_clip is not None and loss_type == "cispo":
        raise ValueError("dual_clip does not apply to loss_type 'cispo' (its clipped weight is detached)")
    if kl_ratio and loss_type == "gspo":
        raise ValueError("kl_ratio weights each token's KL by its own ratio; loss_type 'gspo' has a sequence "
                         "ratio (turn kl_ratio off with gspo)")
    if cispo_clip_low and loss_type != "cispo":
        raise ValueError(f"cispo_clip_low applies to loss_type 'cispo' only, not {loss_type!r}")


def ratio_bounds(loss_type: str, clip_low: float, clip_high: float, cispo_clip_low: bool = False):
    """(lower, upper) bounds of the ratio: 1 -+ the clip ranges; cispo's weight has no lower
    bound (0: r_t > 0 always) unless cispo_clip_low."""
    low = 0.0 if loss_type == "cispo" and not cispo_clip_low else 1.0 - clip_low
    return low, 1.0 + clip_high


def kl_term(logp, ref_logp, kl_type: str):
    """Per-token estimator of KL(pi || ref) from samples of pi, e = logp - ref_logp."""
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")
    d = logp - ref_logp
    if kl_type == "k1":
        return d
    if kl_type == "k2":
        return 0.5 * d * d
    return torch.exp(-d) + d - 1.0


def policy_loss_ref(logp, old_logp, advantages, mask, seq_ids, num_seqs: int, *, loss_type: str = "grpo",
                    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                    ref_logp=None, kl_coef: float = 0.0, kl_type: str = "k3", max_tokens: int | None = None,
                    kl_ratio: bool = False, cispo_clip_low: bool = False):
    """(loss, stats) by plain torch autograd; see the module docstring."""
    _validate(loss_type, kl_type, dual_clip, max_tokens, kl_ratio, cispo_clip_low)
    lo, hi = ratio_bounds(loss_type, clip_low, clip_high, cispo_clip_low)
    m = mask.to(logp.dtype)
    old, adv, seq_ids = old_logp.to(logp.dtype), advantages.to(logp.dtype), seq_ids.long()
    n_seq = _seg_sum(m, seq_ids, num_seqs).clamp_min(1.0)  # (B,)
    if loss_type == "gspo":
        log_s = _seg_sum(m * (logp - old), seq_ids, num_seqs) / n_seq
        ratio = torch.exp(log_s.detach())[seq_ids] * torch.exp(logp - logp.detach())
    else:
        ratio = torch.exp(logp - old)
    if loss_type == "cispo":
        r = ratio.detach()
        pg = -r.clamp(lo, hi) * adv * logp
        took_clip = (r < lo) | (r > hi)
    else:
        surr1, surr2 = ratio * adv, ratio.clamp(lo, hi) * adv
        pg = -torch.minimum(surr1, surr2)
        took_clip = surr2 < surr1
    if dual_clip is not None:
        cap = -dual_clip * adv
        use_cap = (adv < 0) & (pg > cap)
        pg = torch.where(use_cap, cap, pg)
        took_clip = took_clip | use_cap
    has_kl = ref_logp is not None and kl_coef != 0.0
    kl = kl_term(logp, ref_logp.to(logp.dtype), kl_type) if has_kl else torch.zeros_like(logp)
    kl_loss = ratio * kl if kl_ratio else kl
    lm = (pg + kl_coef * kl_loss if has_kl else pg) * m
    if loss_type in ("grpo", "gspo"):
        loss = (_seg_sum(lm, seq_ids, num_seqs) / n_seq).sum() / num_seqs
    elif loss_type in TOKEN_MEAN_TYPES:
        loss = lm.sum() / m.sum().clamp_min(1.0)
    else:
        loss = lm.sum() / (num_seqs * max_tokens)
    with torch.no_grad():
        tot, r = m.sum().clamp_min(1.0), ratio.detach()
        stats = {"clip_frac": (took_clip.to(m.dtype) * m).sum() / tot,
                 "clip_frac_low": (((r < lo) & (adv < 0)).to(m.dtype) * m).sum() / tot,
                 "clip_frac_high": (((r > hi) & (adv > 0)).to(m.dtype) * m).sum() / tot,
                 "ratio_mean": (r * m).sum() / tot,
                 "kl": (kl.detach() * m).sum() / tot}
    return loss, stats


def policy_loss(logp, old_logp, advantages, mask, seq_ids, num_seqs: int, **kwargs):
    """(loss scalar, stats dict of scalars); keyword arguments and math in the module docstring."""
    if resolve_backend("policy_loss", logp) == "triton":
        return triton_ops("loss.triton_policy").policy_loss_triton(logp, old_logp, advantages, mask, seq_ids, num_seqs, **kwargs)
    return policy_loss_ref(logp, old_logp, advantages, mask, seq_ids, num_seqs, **kwargs)


def accumulation_weight(loss_type: str, mb_seqs: int, mb_tokens: float, total_seqs: int,
                        total_tokens: float) -> float:
    """Factor turning a micro-batch's self-normalized loss into its share of the full-batch
    loss (module docstring, "Aggregation"): the sequence-normalized types (grpo, gspo,
    dr_grpo) scale by the micro-batch's share of sequences, dapo and cispo by its share of
    loss tokens. Host numbers (counts known from the rollout lists): no sync."""
    if loss_type in TOKEN_MEAN_TYPES:
        return mb_tokens / max(total_tokens, 1.0) if mb_tokens > 0 else 0.0
    return mb_seqs / total_seqs


def grpo_loss_from_hidden(hidden, weight, targets, temperature, old_logp, advantages, mask, seq_ids,
                          num_seqs: int, *, with_entropy: bool = False, **loss_kwargs):
    """hidden (N, D) at the positions predicting targets (N,) -> (loss, stats, logp (N,) detached).
    Gradients flow to hidden and weight through `token_logprobs`; no (N, V) tensor is made.
    with_entropy adds stats["entropy"], the masked token mean of the policy entropy (no grad)."""
    if with_entropy:
        logp, ent = token_logprobs(hidden, weight, targets, temperature, return_entropy=True)
    else:
        logp = token_logprobs(hidden, weight, targets, temperature)
    loss, stats = policy_loss(logp, old_logp, advantages, mask, seq_ids, num_seqs, **loss_kwargs)
    if with_entropy:
        with torch.no_grad():
            m = mask.to(ent.dtype)
            stats["entropy"] = (ent.detach() * m).sum() / m.sum().clamp_min(1.0)
    return loss, stats, logp.detach()
