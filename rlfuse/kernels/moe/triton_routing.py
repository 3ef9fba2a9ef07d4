"""MoE routing, the Triton kernel: softmax top-k, one row a program (the math and the
tie rule are in `rlfuse.kernels.moe.routing`'s docstring)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=['T'])  # token counts vary per step: one compile
def _topk_softmax_kernel(L, W, IDX, P, T, E, sl, TOPK: tl.constexpr, NORM: tl.constexpr,
                         BLOCK_E: tl.constexpr, STORE_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    es = tl.arange(0, BLOCK_E)
    ok = es < E
    # 1. softmax in fp32; padded experts are -inf (probability 0)
    l = tl.load(L + t * sl + es, mask=ok, other=float("-inf")).to(tl.float32)
    q = tl.exp(l - tl.max(l, 0))
    p = tl.math.div_rn(q, tl.sum(q, 0))
    if STORE_P:
        tl.store(P + t * E + es, p, mask=ok)
    # 2. TOPK rounds of argmax; a taken expert (and padding) drops to -1, below any probability.
    # The k values and ids collect in registers and are stored once (no re-read of a store).
    cand = tl.where(ok, p, -1.0)
    js = tl.arange(0, TOPK)
    vals = tl.zeros((TOPK,), tl.float32)
    ids = tl.zeros((TOPK,), tl.int64)
    s = 0.0
    for j in tl.static_range(TOPK):
        v = tl.max(cand, 0)
        # the lowest index among equal values, spelled out (the interpreter's argmax ignores
        # tie_break_left, so CPU tests would not see the GPU's choice)
        e = tl.min(tl.where(cand == v, es, BLOCK_E), 0)
        cand = tl.where(es == e, -1.0, cand)
        vals = tl.where(js == j, v, vals)
        ids = tl.where(js == j, e.to(tl.int64), ids)
        s += v  # 3. slot order, left to right
    if NORM:
        vals = tl.math.div_rn(vals, s)
    tl.store(W + t * TOPK + js, vals)
    tl.store(IDX + t * TOPK + js, ids)


def _launch(logits: torch.Tensor, k: int, norm: bool, store_p: bool):
    T, E = logits.shape
    lg = logits if logits.stride(-1) == 1 else logits.contiguous()
    w = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    idx = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    p = torch.empty((T, E) if store_p else (1,), dtype=torch.float32, device=logits.device)
    if T:
        # TOPK is a constexpr (k is a model constant) and must be a power of two for tl.arange: pad
        kp = triton.next_power_of_2(k)
        if kp != k:
            w_p = torch.empty((T, kp), dtype=torch.float32, device=logits.device)
            i_p = torch.empty((T, kp), dtype=torch.int64, device=logits.device)
            _topk_softmax_kernel[(T,)](lg, w_p, i_p, p, T, E, lg.stride(0), TOPK=kp, NORM=False,
                                       BLOCK_E=triton.next_power_of_2(E), STORE_P=store_p, num_warps=1)
            return _renorm(w_p[:, :k], norm), i_p[:, :k].contiguous(), p
        _topk_softmax_kernel[(T,)](lg, w, idx, p, T, E, lg.stride(0), TOPK=k, NORM=norm,
                                   BLOCK_E=triton.next_power_of_2(E), STORE_P=store_p, num_warps=1)
    return w, idx, p


def _renorm(v: torch.Tensor, norm: bool) -> torch.Tensor:
    """Step 3 for a k that is not a power of two: the values summed in slot order."""
    v = v.contiguous()
    if not norm:
        return v
    s = v[:, 0]
    for j in range(1, v.shape[1]):
        s = s + v[:, j]
    return v / s[:, None]


class _TopKSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, k, norm):
        w, idx, p = _launch(logits, k, norm, store_p=True)
        ctx.save_for_backward(w, idx, p)
        ctx.norm, ctx.dtype = norm, logits.dtype
        ctx.mark_non_differentiable(idx)
        return w, idx

    @staticmethod
    def backward(ctx, dw, _didx):
        w, idx, p = ctx.saved_tensors
        dv = dw.float()
        if ctx.norm:  # w = v / s: dv_j = (dw_j - sum_i dw_i w_i) / s
            s = p.gather(1, idx).sum(-1, keepdim=True)
            dv = (dv - (dv * w).sum(-1, keepdim=True)) / s
        dp = torch.zeros_like(p).scatter_(1, idx, dv)  # distinct experts per row: no collisions
        dl = p * (dp - (dp * p).sum(-1, keepdim=True))  # the softmax's Jacobian
        return dl.to(ctx.dtype), None, None


def topk_softmax(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.is_grad_enabled() and logits.requires_grad:
        return _TopKSoftmax.apply(logits, k, norm)
    w, idx, _ = _launch(logits, k, norm, store_p=False)
    return w, idx
