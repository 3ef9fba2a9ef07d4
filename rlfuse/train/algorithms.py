"""GRPO-family math: group-relative advantages and the reference policy losses.

Advantages (rewards (P*G,) in prompt-major order, G = group size):
    c_ij = r_ij - mean_j r_ij
    A_ij = c_ij / (std_j r_ij + eps)   scale="group"  (GRPO; std unbiased, torch's default)
    A_ij = c_ij / (std   r    + eps)   scale="batch"  (std over the whole batch)
    A_ij = c_ij                        scale="none"   (Dr. GRPO)
`zero_variance_groups` marks groups whose rewards are all equal (DAPO dynamic sampling
drops them: their advantages are 0 and they only dilute the batch).

Policy loss, per token t of sequence i (mask m_t, advantage A_i, ratio r_t = exp(logp_t - old_t)):
    pg_t  = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)
    dual clip (c > 1, only where A < 0):  pg_t = min(pg_t, -c A)
    kl_t  = k1: d | k2: d^2 / 2 | k3: exp(-d) + d - 1,   d = logp_t - ref_t   (0 if no ref)
    l_t   = pg_t + beta * kl_t
Aggregation over B = num_seqs sequences, n_i = max(sum_t m_t, 1):
    grpo    : (1/B) sum_i (1/n_i) sum_t m_t l_t
    dapo    : sum_{i,t} m_t l_t / max(sum m, 1)               (token-level)
    dr_grpo : sum_{i,t} m_t l_t / (B * max_tokens)             (constant normalizer)
    gspo    : as grpo, with the sequence ratio s_i = exp((1/n_i) sum_t m_t (logp_t - old_t))
              in place of r_t; per token s_it = sg(s_i) * exp(logp_t - sg(logp_t)), so the
              value is s_i and d s_it / d logp_t = s_i (GSPO-token form); clipped on s_i.
Stats (means over masked tokens): clip_frac (pg_t took the clipped branch),
clip_frac_low (r < 1 - eps_low and A < 0), clip_frac_high (r > 1 + eps_high and A > 0),
ratio_mean, kl (mean kl_t; 0 without ref).

`policy_loss_ref` is the readable reference of `rlfuse.kernels.policy_loss.policy_loss`
(same arguments, same results); the trainer uses the kernel when it is importable and
the test suite compares the two. No host syncs: aggregation by index_add.
Test: python -m pytest -q tests/test_grpo_algorithms.py
"""

from __future__ import annotations

import functools

import torch

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo")
KL_TYPES = ("k1", "k2", "k3")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group",
                     eps: float = 1e-6) -> torch.Tensor:
    """rewards (P*G,) -> advantages (P*G,) fp32; see the module docstring."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not a whole number of groups of {group_size}")
    r_PG = rewards.float().view(-1, group_size)
    centred = r_PG - r_PG.mean(1, keepdim=True)
    if scale == "group":
        adv = centred / (r_PG.std(1, keepdim=True) + eps)
    elif scale == "batch":
        adv = centred / (r_PG.std() + eps)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"adv_scale must be 'group', 'batch' or 'none', got {scale!r}")
    return adv.reshape(-1)


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(P,) bool: all G rewards of the group are equal."""
    r_PG = rewards.view(-1, group_size)
    return (r_PG == r_PG[:, :1]).all(1)


def kl_term(logp: torch.Tensor, ref_logp: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimator of KL(pi || ref) from samples of pi."""
    d = logp - ref_logp
    if kl_type == "k1":
        return d
    if kl_type == "k2":
        return 0.5 * d * d
    if kl_type == "k3":
        return torch.exp(-d) + d - 1.0
    raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")


def _seg_sum(x_N: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return x_N.new_zeros(num_seqs).index_add_(0, seq_ids, x_N)


def policy_loss_ref(logp, old_logp, advantages, mask, seq_ids, num_seqs: int, *, loss_type: str = "grpo",
                    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                    ref_logp=None, kl_coef: float = 0.0, kl_type: str = "k3", max_tokens: int | None = None):
    """(loss scalar, stats dict) for flattened tokens; see the module docstring.
    logp (N,) fp32 (differentiable), old_logp/advantages (N,), mask (N,) bool/float,
    seq_ids (N,) int64 in [0, num_seqs)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if loss_type == "dr_grpo" and not max_tokens:
        raise ValueError("loss_type 'dr_grpo' needs max_tokens (the constant length normalizer)")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    m = mask.to(logp.dtype)
    old = old_logp.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    seq_ids = seq_ids.long()
    n_seq = _seg_sum(m, seq_ids, num_seqs).clamp_min(1.0)  # (B,)
    if loss_type == "gspo":
        log_s = _seg_sum(m * (logp - old), seq_ids, num_seqs) / n_seq  # (B,)
        s_tok = torch.exp(log_s.detach())[seq_ids]
        ratio = s_tok * torch.exp(logp - logp.detach())  # value s_i, gradient s_i * dlogp
    else:
        ratio = torch.exp(logp - old)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surr1, surr2 = ratio * adv, clipped * adv
    pg = -torch.minimum(surr1, surr2)
    took_clip = surr2 < surr1
    if dual_clip is not None:
        cap = -dual_clip * adv
        use_cap = (adv < 0) & (pg > cap)
        pg = torch.where(use_cap, cap, pg)
        took_clip = took_clip | use_cap
    per_tok = pg
    if ref_logp is not None and kl_coef != 0.0:
        kl = kl_term(logp, ref_logp.to(logp.dtype), kl_type)
        per_tok = per_tok + kl_coef * kl
    else:
        kl = torch.zeros_like(logp)
    lm = per_tok * m
    if loss_type in ("grpo", "gspo"):
        loss = (_seg_sum(lm, seq_ids, num_seqs) / n_seq).sum() / num_seqs
    elif loss_type == "dapo":
        loss = lm.sum() / m.sum().clamp_min(1.0)
    else:  # dr_grpo
        loss = lm.sum() / (num_seqs * max_tokens)
    with torch.no_grad():
        tot = m.sum().clamp_min(1.0)
        r = ratio.detach()
        stats = {
            "clip_frac": (took_clip.to(m.dtype) * m).sum() / tot,
            "clip_frac_low": (((r < 1.0 - clip_low) & (adv < 0)).to(m.dtype) * m).sum() / tot,
            "clip_frac_high": (((r > 1.0 + clip_high) & (adv > 0)).to(m.dtype) * m).sum() / tot,
            "ratio_mean": (r * m).sum() / tot,
            "kl": (kl.detach() * m).sum() / tot,
        }
    return loss, stats


@functools.cache
def _kernel_policy_loss():
    """The fused kernel's `policy_loss` when its module exists, else None."""
    try:
        from rlfuse.kernels.policy_loss import policy_loss
    except ImportError:
        return None
    return policy_loss


def policy_loss(*args, use_kernel: bool = True, **kwargs):
    """`rlfuse.kernels.policy_loss.policy_loss` when available (use_kernel), else the
    reference above. Same signature and results."""
    fn = _kernel_policy_loss() if use_kernel else None
    return (fn or policy_loss_ref)(*args, **kwargs)


def accumulation_weight(loss_type: str, mb_seqs: int, mb_tokens: float, total_seqs: int,
                        total_tokens: float) -> float:
    """Factor turning a micro-batch's self-normalized loss into its share of the full-batch
    loss, so accumulated gradients equal the gradient of the loss on the whole batch:
    seq-normalized types scale by the micro-batch's share of sequences, dapo by its share
    of loss tokens. Host numbers (counts known from the rollout lists): no sync."""
    if loss_type == "dapo":
        return mb_tokens / max(total_tokens, 1.0) if mb_tokens > 0 else 0.0
    return mb_seqs / total_seqs
