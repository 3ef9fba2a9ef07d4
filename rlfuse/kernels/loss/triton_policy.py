"""The clipped policy-gradient loss, the Triton kernel: per-token loss, clip flags, ratio
and KL with their masked partial sums, and the gradient coefficient (the loss types, the
aggregation and the KL estimators are in `rlfuse.kernels.loss.policy`'s docstring)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.loss.policy import KL_TYPES, TOKEN_MEAN_TYPES, _seg_sum, _validate, ratio_bounds

# The partial sums `_policy_loss_kernel` writes, one row per program, in this column order: masked
# sums of w l, of clipped tokens (clip, low, high), of r, of kl and of the mask (the
# token count); "pad" rounds the row up to 8. The kernel addresses columns by the PART_*
# constants, the host reads them by name.
_PART_NAMES = ("loss", "clip", "clip_low", "clip_high", "ratio", "kl", "count", "pad")
(PART_LOSS, PART_CLIP, PART_CLIP_LOW, PART_CLIP_HIGH, PART_RATIO, PART_KL, PART_COUNT,
 PART_PAD) = (tl.constexpr(i) for i in range(len(_PART_NAMES)))
PART_COLS = tl.constexpr(len(_PART_NAMES))


@triton.jit(do_not_specialize=['N'])  # row counts vary per step: one compile
def _policy_loss_kernel(LOGP, OLD, LOGR, ADV, MASK, WGT, REF, COEF, PART, N, lo, hi, dual_c, kl_coef,
                        GSPO: tl.constexpr, CISPO: tl.constexpr, DUAL: tl.constexpr, KL: tl.constexpr,
                        KL_RATIO: tl.constexpr, BLOCK: tl.constexpr):
    """KL: 0 none, 1/2/3 = k1/k2/k3; KL_RATIO: the KL term is r kl. lo, hi: the ratio bounds
    (`ratio_bounds`). PART (P, PART_COLS): this program's sums, columns PART_*.
    Scalars arrive as fp32 (Triton's float arguments), as torch rounds them for fp32 tensors;
    for fp64 logp they differ from the double constants by < 1e-7 relative."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    CT = COEF.dtype.element_ty
    logp = tl.load(LOGP + offs, mask=valid, other=0.0).to(CT)
    m = tl.load(MASK + offs, mask=valid, other=0.0).to(CT)
    act = valid & (m != 0)
    adv = tl.load(ADV + offs, mask=valid, other=0.0).to(CT)
    w = tl.load(WGT + offs, mask=valid, other=0.0).to(CT)
    if GSPO:
        lr = tl.load(LOGR + offs, mask=valid, other=0.0).to(CT)
    else:
        lr = logp - tl.load(OLD + offs, mask=valid, other=0.0).to(CT)
    r = tl.exp(lr)
    if CISPO:
        cw = tl.minimum(tl.maximum(r, lo), hi)
        took = (r < lo) | (r > hi)
        pg = -cw * adv * logp
        dpg = -cw * adv
    else:
        s1 = r * adv
        s2 = tl.minimum(tl.maximum(r, lo), hi) * adv
        took = s2 < s1
        pg = -tl.minimum(s1, s2)
        dpg = tl.where(took, 0.0, -adv * r)
    if DUAL:
        cap = -dual_c * adv
        use_cap = (adv < 0) & (pg > cap)
        pg = tl.where(use_cap, cap, pg)
        dpg = tl.where(use_cap, 0.0, dpg)
        took = took | use_cap
    lt = pg
    dl = dpg
    kl = tl.zeros_like(pg)
    if KL != 0:
        e = logp - tl.load(REF + offs, mask=valid, other=0.0).to(CT)
        if KL == 1:
            kl = e
            dk = tl.full(e.shape, 1.0, CT)
        elif KL == 2:
            kl = 0.5 * e * e
            dk = e
        else:
            ee = tl.exp(-e)
            kl = ee + e - 1.0
            dk = 1.0 - ee
        if KL_RATIO:  # d (r kl) / d logp = r (dk + kl): r's own derivative is r
            lt = lt + kl_coef * r * kl
            dl = dl + kl_coef * r * (dk + kl)
        else:
            lt = lt + kl_coef * kl
            dl = dl + kl_coef * dk
    tl.store(COEF + offs, tl.where(act, w * dl, 0.0), mask=valid)
    zero = tl.zeros_like(pg)
    row = PART + pid * PART_COLS
    tl.store(row + PART_LOSS, tl.sum(tl.where(act, w * lt, zero)))
    tl.store(row + PART_CLIP, tl.sum(tl.where(act & took, m, zero)))
    tl.store(row + PART_CLIP_LOW, tl.sum(tl.where(act & (r < lo) & (adv < 0), m, zero)))
    tl.store(row + PART_CLIP_HIGH, tl.sum(tl.where(act & (r > hi) & (adv > 0), m, zero)))
    tl.store(row + PART_RATIO, tl.sum(tl.where(act, r * m, zero)))
    tl.store(row + PART_KL, tl.sum(tl.where(act, kl * m, zero)))
    tl.store(row + PART_COUNT, tl.sum(tl.where(act, m, zero)))
    tl.store(row + PART_PAD, tl.sum(zero))


class _ScaledGrad(torch.autograd.Function):
    """value = loss (precomputed), d value / d logp = coef."""

    @staticmethod
    def forward(ctx, logp, loss, coef):
        ctx.save_for_backward(coef)
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        (coef,) = ctx.saved_tensors
        return g * coef, None, None


def _block(N: int) -> int:
    return 1024 if N > 65536 else 256


def policy_loss_triton(logp, old_logp, advantages, mask, seq_ids, num_seqs: int, *, loss_type: str = "grpo",
                       clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                       ref_logp=None, kl_coef: float = 0.0, kl_type: str = "k3", max_tokens: int | None = None,
                       kl_ratio: bool = False, cispo_clip_low: bool = False):
    _validate(loss_type, kl_type, dual_clip, max_tokens, kl_ratio, cispo_clip_low)
    lo, hi = ratio_bounds(loss_type, clip_low, clip_high, cispo_clip_low)
    N = logp.shape[0]
    ct = torch.float64 if logp.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        lp = logp.detach().to(ct).contiguous()
        m = mask.to(ct).contiguous()
        seq_ids = seq_ids.long()
        old = old_logp.contiguous()
        if loss_type in ("grpo", "gspo"):
            n_seq = _seg_sum(m, seq_ids, num_seqs).clamp_min(1.0)
            w = m / (n_seq[seq_ids] * num_seqs)
        elif loss_type in TOKEN_MEAN_TYPES:
            w = m / m.sum().clamp_min(1.0)
        else:
            w = m / float(num_seqs * max_tokens)
        logr = None
        if loss_type == "gspo":
            logr = (_seg_sum(m * (lp - old.to(ct)), seq_ids, num_seqs) / n_seq)[seq_ids].contiguous()
        has_kl = ref_logp is not None and kl_coef != 0.0
        coef = torch.empty(N, dtype=ct, device=logp.device)
        blk = _block(N)
        P = max(1, triton.cdiv(N, blk))
        part = torch.zeros((P, len(_PART_NAMES)), dtype=ct, device=logp.device)
        if N:
            _policy_loss_kernel[(P,)](lp, old, logr, advantages.contiguous(), m, w.contiguous(),
                                      ref_logp.contiguous() if has_kl else None, coef, part, N,
                                      lo, hi, float(dual_clip or 0.0), float(kl_coef),
                                      GSPO=loss_type == "gspo", CISPO=loss_type == "cispo",
                                      DUAL=dual_clip is not None, KL=KL_TYPES.index(kl_type) + 1 if has_kl else 0,
                                      KL_RATIO=has_kl and kl_ratio, BLOCK=blk)
        sums = dict(zip(_PART_NAMES, part.sum(0).unbind()))
        tot = sums["count"].clamp_min(1.0)
        stats = {"clip_frac": sums["clip"] / tot, "clip_frac_low": sums["clip_low"] / tot,
                 "clip_frac_high": sums["clip_high"] / tot, "ratio_mean": sums["ratio"] / tot,
                 "kl": sums["kl"] / tot}
        loss = sums["loss"].to(logp.dtype)
    if torch.is_grad_enabled() and logp.requires_grad:
        loss = _ScaledGrad.apply(logp, loss, coef.to(logp.dtype))
    return loss, stats
