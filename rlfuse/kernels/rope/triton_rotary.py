"""Rotary position embedding, the Triton kernels: RoPE (forward and backward are one
kernel) and the fused per-head norms + RoPE + KV store (the math, the layout and the
bitwise contract are in `rlfuse.kernels.rope.rotary`'s docstring)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.attention.paged import _check_cache, check_kv_scale
from rlfuse.kernels.kv_quant.triton_fp8 import to_e4m3
from rlfuse.kernels.norm.triton_rms import NO_FMA, _tile, mean_square, norm_rows
from rlfuse.kernels.triton_common import round_to


@triton.jit
def _cos_sin(P_ptr, F_ptr, toks, tmask, fr, HALF: tl.constexpr):
    """cos, sin (BLOCK_T, BLOCK_F) of the fp32 angles, exactly as the reference:
    float(pos) * inv_freq."""
    pos = tl.load(P_ptr + toks, mask=tmask, other=0).to(tl.float32)
    inv = tl.load(F_ptr + fr, mask=fr < HALF, other=0.0)
    ang = pos[:, None] * inv[None, :]
    return tl.cos(ang), tl.sin(ang)


@triton.jit
def _angles(P_ptr, F_ptr, CS_ptr, toks, tmask, fr, HALF: tl.constexpr, TABLE: tl.constexpr):
    """cos, sin (BLOCK_T, len(fr)) of angles fr (< HALF): with TABLE, loaded from the step's
    table (`cos_sin_table`: the bits of `_cos_sin`, computed once per forward instead of in
    every program of every layer); else computed here. Masked lanes are never stored."""
    if TABLE:
        m = tmask[:, None] & (fr[None, :] < HALF)
        row = CS_ptr + toks[:, None] * (2 * HALF) + fr[None, :]
        return tl.load(row, mask=m, other=1.0), tl.load(row + HALF, mask=m, other=0.0)
    else:
        return _cos_sin(P_ptr, F_ptr, toks, tmask, fr, HALF)


@triton.jit(do_not_specialize=['T'])  # varies per step: one compile
def _rope_cos_sin_kernel(P_ptr, F_ptr, CS_ptr, AX_ptr, T, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_F: tl.constexpr, MULTI: tl.constexpr):
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    fr = tl.arange(0, BLOCK_F)
    tmask = toks < T
    m = tmask[:, None] & (fr[None, :] < HALF)
    if MULTI:
        # frequency f reads position row AX[f] of the (R, T) positions: the same int -> fp32
        # -> times inv_freq as `_cos_sin`, so equal rows give the single-row bits
        ax = tl.load(AX_ptr + fr, mask=fr < HALF, other=0).to(tl.int64)
        pos = tl.load(P_ptr + ax[None, :] * T + toks[:, None], mask=m, other=0).to(tl.float32)
        inv = tl.load(F_ptr + fr, mask=fr < HALF, other=0.0)
        ang = pos * inv[None, :]
        cos, sin = tl.cos(ang), tl.sin(ang)
    else:
        cos, sin = _cos_sin(P_ptr, F_ptr, toks, tmask, fr, HALF)
    row = CS_ptr + toks[:, None] * (2 * HALF) + fr[None, :]
    tl.store(row, cos, mask=m)
    tl.store(row + HALF, sin, mask=m)


@triton.jit
def _rotate(x1, x2, cos, sin, DT: tl.constexpr):
    """The halves rotated in fp32, each rounded once to DT (returned as fp32)."""
    return round_to(x1 * cos - x2 * sin, DT), round_to(x2 * cos + x1 * sin, DT)


@triton.jit(do_not_specialize=['T', 'H', 'HPP'])  # vary per step (H: q vs k heads): one compile
def _rope_kernel(X_ptr, Y_ptr, P_ptr, F_ptr, CS_ptr, T, H, HPP, stride_xt, stride_xh, stride_yt, stride_yh,
                 HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
                 BACKWARD: tl.constexpr, TABLE: tl.constexpr):
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    fr = tl.arange(0, BLOCK_F)
    tmask = toks < T
    mask = tmask[:, None] & (fr[None, :] < HALF)
    # 1. angles in fp32, their cos and sin (or the step's table of them)
    cos, sin = _angles(P_ptr, F_ptr, CS_ptr, toks, tmask, fr, HALF, TABLE)
    if BACKWARD:
        sin = -sin
    DT: tl.constexpr = Y_ptr.dtype.element_ty
    xo = toks[:, None] * stride_xt + fr[None, :]
    yo = toks[:, None] * stride_yt + fr[None, :]
    # 2. heads [h0, h0 + HPP) of these tokens with the same cos/sin
    h0 = tl.program_id(1) * HPP
    for h in range(h0, tl.minimum(h0 + HPP, H)):
        x1 = tl.load(X_ptr + xo + h * stride_xh, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X_ptr + xo + h * stride_xh + HALF, mask=mask, other=0.0).to(tl.float32)
        y1, y2 = _rotate(x1, x2, cos, sin, DT)
        tl.store(Y_ptr + yo + h * stride_yh, y1.to(DT), mask=mask)
        tl.store(Y_ptr + yo + h * stride_yh + HALF, y2.to(DT), mask=mask)


# 16 tokens a program: with HALF = 64 a (16, 64) tile per half and head, and the cos/sin
# (the costly part, libdevice sin/cos) computed once per token for HPP heads. HPP = all
# heads when there are enough token blocks to fill the GPU (training); fewer when not, so
# that a decode step's few tokens still spread over the SMs. Every element is computed the
# same way whatever HPP: batch invariance holds.
_BLOCK_T = 16        # tokens a program


_MIN_PROGRAMS = 512  # programs to aim for (~4 per SM on an H100); a guess, not timed on its own


# mean_square's PIN in the fused q/k kernel: Triton 3.6 (the device's) needs it, 3.9 does not
# and compiles it into ~1,100 more instructions (sm_90 compiles: docs/perf-log.md, 2026-11-28).
# The bits are the same either way.
_PIN_ROWS = tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9)


def cos_sin_table(positions: torch.Tensor, inv_freq: torch.Tensor, axis: torch.Tensor | None = None) -> torch.Tensor:
    """(T, Dh) fp32 [cos a | sin a] of a = float(positions)[:, None] * inv_freq, by the
    kernels' own `_cos_sin`: loading it gives them the bits they would compute. With `axis`
    (Dh/2,) and positions (R, T): a[:, f] = float(positions[axis[f]]) * inv_freq[f]."""
    multi = axis is not None
    if positions.dim() != 1 + multi or inv_freq.dim() != 1 or (multi and axis.shape != inv_freq.shape):
        want = "positions (R, T), axis (Dh/2,)" if multi else "positions (T,)"
        raise ValueError(f"rope_cos_sin: {want} and inv_freq (Dh/2,), got {tuple(positions.shape)} "
                         f"and {tuple(inv_freq.shape)}")
    T, half = positions.shape[-1], inv_freq.shape[0]
    cs = torch.empty((T, 2 * half), dtype=torch.float32, device=positions.device)
    if T and half:
        ax = axis.to(device=positions.device, dtype=torch.int32).contiguous() if multi else positions
        _rope_cos_sin_kernel[(triton.cdiv(T, _BLOCK_T),)](
            positions.contiguous(), inv_freq.float().contiguous(), cs, ax, T, HALF=half, BLOCK_T=_BLOCK_T,
            BLOCK_F=triton.next_power_of_2(half), MULTI=multi, num_warps=4, **NO_FMA)
    return cs


def _table(cos_sin: torch.Tensor | None, positions: torch.Tensor, Dh: int, who: str) -> tuple[torch.Tensor, bool]:
    """(the table's pointer, TABLE) after checking its shape; without a table, positions
    stand in for the pointer the kernel then never reads."""
    T = positions.shape[0]
    if cos_sin is None:
        return positions, False
    if cos_sin.shape != (T, Dh) or cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous():
        raise ValueError(f"{who}: cos_sin must be a contiguous ({T}, {Dh}) float32 table (rope_cos_sin), got "
                         f"{tuple(cos_sin.shape)} {cos_sin.dtype}")
    return cos_sin, True


def rope_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                backward: bool = False, cos_sin: torch.Tensor | None = None) -> torch.Tensor:
    if x.dim() != 3 or x.shape[-1] % 2 or inv_freq.numel() * 2 != x.shape[-1]:
        raise ValueError(f"rope: x must be (T, H, Dh) with Dh = 2 * len(inv_freq), got "
                         f"{tuple(x.shape)} and inv_freq {tuple(inv_freq.shape)}")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"rope: positions must be ({x.shape[0]},), got {tuple(positions.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, H, Dh = x.shape
    cs, table = _table(cos_sin, positions, Dh, "rope")
    y = torch.empty((T, H, Dh), dtype=x.dtype, device=x.device)
    if T and H:
        half = Dh // 2
        nt = triton.cdiv(T, _BLOCK_T)
        hpp = triton.cdiv(H, min(H, triton.cdiv(_MIN_PROGRAMS, nt)))
        _rope_kernel[(nt, triton.cdiv(H, hpp))](
            x, y, positions.contiguous(), inv_freq.float().contiguous(), cs, T, H, hpp,
            x.stride(0), x.stride(1), y.stride(0), y.stride(1),
            HALF=half, BLOCK_T=_BLOCK_T, BLOCK_F=triton.next_power_of_2(half),
            BACKWARD=backward, TABLE=table, num_warps=4, **NO_FMA)
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, inv_freq, cos_sin):
        ctx.save_for_backward(positions, inv_freq, cos_sin)
        return rope_triton(x, positions, inv_freq, cos_sin=cos_sin)

    @staticmethod
    def backward(ctx, dy):
        positions, inv_freq, cos_sin = ctx.saved_tensors
        return rope_triton(dy, positions, inv_freq, backward=True, cos_sin=cos_sin), None, None, None


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
         cos_sin: torch.Tensor | None = None) -> torch.Tensor:
    """The op on the Triton backend (autograd where a gradient is needed)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rope.apply(x, positions, inv_freq, cos_sin)
    return rope_triton(x, positions, inv_freq, cos_sin=cos_sin)


@triton.jit
def _norm_rope_rows(X, stride_xt, W, toks, tmask, cols, cos, sin, D, eps, HALF: tl.constexpr, PIN: tl.constexpr,
                    NORM: tl.constexpr, YT: tl.constexpr):
    """One head of BLOCK_T tokens as whole rows (BLOCK_T, BLOCK_D) -> the rotated rows (fp32
    holding YT values). Column c works on angle c mod HALF (cos, sin hold it there): x1 and
    x2 are that angle's halves, rotated with `_rotate`'s own expressions (the same products,
    so the same contractions and bits as on half tiles), and c keeps y1 or y2 by its half.
    Whole-row tiles keep every step in the row tile's layout: half tiles cost the compiler
    a layout conversion (shared memory and a barrier) per half, in and out."""
    xo = X + toks[:, None] * stride_xt
    m = tmask[:, None] & (cols[None, :] < D)
    fr = cols % HALF
    x1 = tl.load(xo + fr[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xo + HALF + fr[None, :], mask=m, other=0.0).to(tl.float32)
    if NORM:
        # 1. the RMSNorm kernel's steps on the whole row (same tile: same reduction order),
        # then applied to each half (elementwise: the halves get the row's bits); PIN keeps
        # this kernel's tiles in their own layout under Triton 3.6 (mean_square says why)
        x = tl.load(xo + cols[None, :], mask=m, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(mean_square(x, D, PIN) + eps)
        XT: tl.constexpr = X.dtype.element_ty
        x1 = norm_rows(x1, r, tl.load(W + fr, mask=cols < D, other=0.0).to(tl.float32), XT, YT)
        x2 = norm_rows(x2, r, tl.load(W + HALF + fr, mask=cols < D, other=0.0).to(tl.float32), XT, YT)
    # 2. the rotation, y1 kept in the first half of the row, y2 in the second
    y1, y2 = _rotate(x1, x2, cos, sin, YT)
    return tl.where((cols < HALF)[None, :], y1, y2)


@triton.jit(do_not_specialize=['T', 'HPP'])  # vary per step: one compile
def _qk_norm_rope_kernel(Q, K, V, QO, KO, WQ, WK, P_ptr, F_ptr, CS_ptr, KC, VC, SLOT, INV, T, HQ, HKV, HPP,
                         sqt, sqh, skt, skh, svt, svh, sot, soh, skot, skoh,
                         skcb, skct, skch, svcb, svct, svch, D, eps,
                         HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                         NORM: tl.constexpr, CACHE: tl.constexpr, PAGE: tl.constexpr,
                         TABLE: tl.constexpr, FP8: tl.constexpr, PIN: tl.constexpr):
    # heads [0, HQ) are q's, [HQ, HQ + HKV) k's, then (CACHE) HKV of v's, copied to the cache
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    cols = tl.arange(0, BLOCK_D)
    tmask = toks < T
    m = tmask[:, None] & (cols[None, :] < D)
    h0 = tl.program_id(1) * HPP
    if h0 < HQ + HKV:  # once for this program's q/k heads; a program of v heads only copies
        cos, sin = _angles(P_ptr, F_ptr, CS_ptr, toks, tmask, cols % HALF, HALF, TABLE)
    else:
        cos = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
        sin = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    YT: tl.constexpr = QO.dtype.element_ty
    if CACHE:
        slot = tl.load(SLOT + toks, mask=tmask, other=-1).to(tl.int64)
        cmask = m & (slot >= 0)[:, None]
        crow = (slot // PAGE)[:, None] * skcb + (slot % PAGE)[:, None] * skct + cols[None, :]
        vrow = (slot // PAGE)[:, None] * svcb + (slot % PAGE)[:, None] * svct + cols[None, :]
        NH = HQ + 2 * HKV
    else:
        NH = HQ + HKV
    for h in range(h0, tl.minimum(h0 + HPP, NH)):
        if h < HQ:
            y = _norm_rope_rows(Q + h * sqh, sqt, WQ, toks, tmask, cols, cos, sin, D, eps, HALF, PIN, NORM, YT)
            tl.store(QO + h * soh + toks[:, None] * sot + cols[None, :], y.to(YT), mask=m)
        elif h < HQ + HKV:
            hk = h - HQ
            y = _norm_rope_rows(K + hk * skh, skt, WK, toks, tmask, cols, cos, sin, D, eps, HALF, PIN, NORM, YT)
            if CACHE:  # as store_kvcache: k (in YT) cast to the cache's dtype, slot -1 skipped
                KCT: tl.constexpr = KC.dtype.element_ty
                if FP8:  # quantized from k's YT value (y holds it), as the trainer's fake_quant_kv
                    tl.store(KC + hk * skch + crow, to_e4m3(y, tl.load(INV + hk)), mask=cmask)
                else:
                    tl.store(KC + hk * skch + crow, y.to(YT).to(KCT), mask=cmask)
            else:
                tl.store(KO + hk * skoh + toks[:, None] * skot + cols[None, :], y.to(YT), mask=m)
        else:
            if CACHE:  # h < NH: a v head
                hv = h - HQ - HKV
                VCT: tl.constexpr = VC.dtype.element_ty
                v = tl.load(V + hv * svh + toks[:, None] * svt + cols[None, :], mask=cmask)
                if FP8:
                    tl.store(VC + hv * svch + vrow, to_e4m3(v.to(tl.float32), tl.load(INV + HKV + hv)), mask=cmask)
                else:
                    tl.store(VC + hv * svch + vrow, v.to(VCT), mask=cmask)


def _heads(x: torch.Tensor, T: int, Dh: int, who: str) -> torch.Tensor:
    if x.dim() != 3 or x.shape[0] != T or x.shape[2] != Dh:
        raise ValueError(f"qk_norm_rope: {who} must be ({T}, heads, {Dh}), got {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def qk_norm_rope_triton(q, k, positions, inv_freq, q_weight=None, k_weight=None, eps=0.0, *,
                        v=None, kv_cache=None, slot_mapping=None, cos_sin=None, kv_scale=None):
    if q.dim() != 3 or q.shape[-1] % 2 or inv_freq.numel() * 2 != q.shape[-1]:
        raise ValueError(f"qk_norm_rope: q must be (T, H, Dh) with Dh = 2 * len(inv_freq), got "
                         f"{tuple(q.shape)} and inv_freq {tuple(inv_freq.shape)}")
    T, Hq, Dh = q.shape
    q, k = _heads(q, T, Dh, "q"), _heads(k, T, Dh, "k")
    if positions.shape != (T,):
        raise ValueError(f"qk_norm_rope: positions must be ({T},), got {tuple(positions.shape)}")
    cs, table = _table(cos_sin, positions, Dh, "qk_norm_rope")
    if k.dtype != q.dtype:
        raise ValueError(f"qk_norm_rope: q and k must share a dtype, got {q.dtype} and {k.dtype}")
    norm = q_weight is not None
    if norm and (q_weight.shape != (Dh,) or k_weight.shape != (Dh,) or q_weight.dtype != k_weight.dtype):
        raise ValueError(f"qk_norm_rope: q_weight {tuple(q_weight.shape)} {q_weight.dtype} and k_weight "
                         f"{tuple(k_weight.shape)} {k_weight.dtype} must both be ({Dh},) of one dtype")
    yt = torch.result_type(q_weight, q) if norm else q.dtype  # rmsnorm's output dtype, rope keeps it
    Hkv = k.shape[1]
    qo = torch.empty((T, Hq, Dh), dtype=yt, device=q.device)
    cache = kv_cache is not None
    fp8 = cache and kv_cache[0].dtype == torch.float8_e4m3fn
    if cache:
        k_cache, v_cache = kv_cache
        _check_cache(k_cache, v_cache, "qk_norm_rope")
        check_kv_scale(k_cache, kv_scale, "qk_norm_rope")
        v = _heads(v, T, Dh, "v")
        if v.shape[1] != Hkv or k_cache.shape[2:] != (Hkv, Dh) or slot_mapping.shape != (T,):
            raise ValueError(f"qk_norm_rope: k {tuple(k.shape)}, v {tuple(v.shape)}, cache "
                             f"{tuple(k_cache.shape)} and slot_mapping {tuple(slot_mapping.shape)} disagree")
        ko = None
        kc_args = (*k_cache.stride()[:3], *v_cache.stride()[:3])
        page = k_cache.shape[1]
    else:
        k_cache = v_cache = slot_mapping = v = q  # unused
        ko = torch.empty((T, Hkv, Dh), dtype=yt, device=q.device)
        kc_args, page = (0,) * 6, 1
    if T:
        half = Dh // 2
        block_d, rows, warps = _tile(Dh) if norm else (triton.next_power_of_2(Dh), _BLOCK_T, 4)
        nh = Hq + Hkv * (2 if cache else 1)
        nt = triton.cdiv(T, rows)
        # without the table, half rope's program count: each program's cos/sin (libdevice)
        # then serves 2+ heads; with it cos/sin are a load, so a decode step's heads spread
        # over twice the programs, each with half the serial work (the bits ignore HPP)
        hpp = triton.cdiv(nh, min(nh, triton.cdiv(max(1, _MIN_PROGRAMS // (1 if table else 2)), nt)))
        kout = qo if ko is None else ko
        _qk_norm_rope_kernel[(nt, triton.cdiv(nh, hpp))](
            q, k, v, qo, kout, q_weight if norm else q, k_weight if norm else q, positions.contiguous(),
            inv_freq.float().contiguous(), cs, k_cache, v_cache, slot_mapping, kv_scale[1] if fp8 else q, T, Hq,
            Hkv, hpp,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            qo.stride(0), qo.stride(1), kout.stride(0), kout.stride(1), *kc_args, Dh, float(eps),
            HALF=half, BLOCK_T=rows, BLOCK_D=block_d, NORM=norm, CACHE=cache, PAGE=page, TABLE=table,
            FP8=fp8, PIN=_PIN_ROWS, num_warps=warps, **NO_FMA)
    return qo, ko
