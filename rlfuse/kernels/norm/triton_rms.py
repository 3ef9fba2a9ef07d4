"""RMSNorm, the Triton kernels: forward, backward and the dw partial sum (the math, the
contract and the tiling rules are in `rlfuse.kernels.norm.rms`'s docstring)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.backend import num_sms
from rlfuse.kernels.triton_common import round_to

# Every kernel that computes a row's mean of squares, or rotates by RoPE angles, is compiled
# with FMA contraction off: whether the compiler fuses a product into the next add depends on
# the code around it, so two kernels with the same expressions could round differently.
NO_FMA = dict(enable_fp_fusion=False)


@triton.jit
def _halve(s):
    """(R, N) -> (R, N / 2): s[:, j] + s[:, j + N / 2], one add per element (its order is moot)."""
    R: tl.constexpr = s.shape[0]
    N: tl.constexpr = s.shape[1]
    return tl.sum(tl.reshape(s, (R, 2, N // 2)), axis=1)


@triton.jit
def mean_square(x, D, PIN: tl.constexpr = False):
    """x (ROWS, BLOCK_D) fp32 -> mean of squares per row (ROWS,): the one row reduction every
    RMSNorm kernel runs (the fused ones too). The sum is the fixed pairwise tree of
    `rlfuse.kernels.invariant.pairwise_sum` (x[j] + x[j + n/2], halving), spelled out with
    reshapes: `tl.sum` over a whole row reduces in the order of the register layout, which
    the compiler picks per kernel, and kernels with different surroundings (the fused q/k
    norm + RoPE + KV store against the plain norm) rounded some rows differently at head
    dims <= 64 in bf16. BLOCK_D <= 2**14.

    PIN: return the tree's value, bit for bit, in the row layout of x's own tile. Triton
    (3.6) takes each reshape as a layout anchor and may carry the tree's last layout (rows in
    registers, columns broadcast) forward into the caller's tiles: in the fused q/k norm +
    RoPE + KV-store kernel it chose it for the k heads, each thread held whole (16, 128)
    tiles and the compile did not finish (issue 38; docs/perf-log.md). A select against a
    `tl.sum` of the same squares (never < 0: a sum of values >= 0, or NaN) makes the compiler
    move the ROWS results instead. Costs one more row reduction, so only callers whose
    tiles were taken over set it (the plain norms' were not)."""
    s = x * x
    if PIN:  # before the tree: the layout pass meets this reduction first (the other order failed)
        u = tl.sum(s, axis=1)
    t = s
    for _ in tl.static_range(14):  # unrolled; each level halves the columns until one is left
        if t.shape[1] > 1:
            t = _halve(t)
    t = tl.sum(t, axis=1)
    if PIN:
        t = tl.where(u < 0, u, t)
    return tl.math.div_rn(t, D.to(tl.float32))


@triton.jit
def norm_rows(x, r, w, XT: tl.constexpr, YT: tl.constexpr):
    """x (ROWS, BLOCK_D) fp32, r (ROWS,), w (BLOCK_D,) fp32 -> y (fp32 holding YT values):
    the row rounded to XT (the input dtype), then times w, one rounding to YT."""
    return round_to(round_to(x * r[:, None], XT) * w[None, :], YT)


@triton.jit(do_not_specialize=['N'])  # row counts vary per step: one compile
def _rmsnorm_fwd_kernel(X_ptr, W_ptr, Y_ptr, R_ptr, H_ptr, S_ptr, N, D, stride_x, stride_y, stride_h, stride_s,
                        eps, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, STORE_R: tl.constexpr,
                        ADD: tl.constexpr, OFFSET: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < N
    mask = rmask[:, None] & (cols[None, :] < D)
    x = tl.load(X_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    XT: tl.constexpr = X_ptr.dtype.element_ty
    if ADD:
        # 0. the residual add: s = h + x rounded once to x.dtype (h's too), stored
        h = tl.load(H_ptr + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = round_to(h + x, XT)
        tl.store(S_ptr + rows[:, None] * stride_s + cols[None, :], x.to(XT), mask=mask)
    # 1. fp32 mean of squares, one row per tile row (fixed tree for a given BLOCK_D)
    r = tl.math.rsqrt(mean_square(x, D) + eps)  # (ROWS,)
    # 2. normalized row rounded to x.dtype, 3. times w, one rounding to y.dtype
    # (OFFSET, Qwen3.5's: the row stays fp32 and is multiplied by 1 + w in fp32)
    w = tl.load(W_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    YT: tl.constexpr = Y_ptr.dtype.element_ty
    if OFFSET:
        y = norm_rows(x, r, 1.0 + w, tl.float32, YT)
    else:
        y = norm_rows(x, r, w, XT, YT)
    tl.store(Y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(YT), mask=mask)
    if STORE_R:
        tl.store(R_ptr + rows, r, mask=rmask)


@triton.jit(do_not_specialize=['N', 'rows_per_prog'])  # row counts vary per step: one compile
def _rmsnorm_bwd_kernel(DY_ptr, X_ptr, W_ptr, R_ptr, DX_ptr, DWP_ptr, N, D, rows_per_prog,
                        stride_dy, stride_x, stride_dx,
                        ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(W_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_prog
    for r0 in range(0, rows_per_prog, ROWS):
        rows = start + r0 + tl.arange(0, ROWS)
        rmask = (rows < N) & (r0 + tl.arange(0, ROWS) < rows_per_prog)
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = tl.load(R_ptr + rows, mask=rmask, other=0.0)
        n = x * r[:, None]
        dn = dy * w[None, :]
        c = tl.math.div_rn(tl.sum(dn * n, axis=1), D.to(tl.float32))  # mean(dn n) per row
        dx = r[:, None] * (dn - n * c[:, None])
        DXT: tl.constexpr = DX_ptr.dtype.element_ty
        tl.store(DX_ptr + rows[:, None] * stride_dx + cols[None, :], round_to(dx, DXT).to(DXT), mask=mask)
        dw += tl.sum(dy * round_to(n, X_ptr.dtype.element_ty), axis=0)
    tl.store(DWP_ptr + pid.to(tl.int64) * BLOCK_D + cols, dw, mask=cmask)


# dw = the P partial rows summed in order and cast to w's dtype in one launch (torch's sum +
# cast + memset cost a third of the backward). Tile set by an H100 sweep (bench_layers.py;
# docs/perf-log.md): many narrow programs, not a few long serial loops.
_DW_COLS = 8     # columns a program (D = 1024: 128 programs)


_DW_ROWS = 1024  # partial rows a step


_DW_WARPS = 8    # warps a program


@triton.jit(do_not_specialize=['P'])  # P follows N: one compile
def _rmsnorm_dw_sum_kernel(DWP_ptr, DW_ptr, P, D, BLOCK_D: tl.constexpr, COLS: tl.constexpr, BLOCK_P: tl.constexpr):
    cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
    acc = tl.zeros((COLS,), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        part = tl.load(DWP_ptr + rows.to(tl.int64)[:, None] * BLOCK_D + cols[None, :],
                       mask=(rows < P)[:, None] & (cols < D)[None, :], other=0.0)
        acc += tl.sum(part, axis=0)
    DT: tl.constexpr = DW_ptr.dtype.element_ty
    tl.store(DW_ptr + cols, round_to(acc, DT).to(DT), mask=cols < D)


def _tile(D: int, backward: bool = False) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps) from D alone (batch invariance). Set by H100 tile sweeps
    under CUDA-graph replay (bench_layers.py; docs/perf-log.md). The backward holds x, dy,
    dx and the dw sum, so its tiles are half the forward's (no register spills on sm_90)."""
    block_d = triton.next_power_of_2(D)
    if block_d <= 128:
        # per-head norms (Qwen3 qk-norm, D = 128), timed at D = 128 only
        return (block_d, 8, 2) if backward else (block_d, 16, 4)
    # wider rows: about 2048 elements a forward tile, 1024 backward (timed at D = 1024)
    rows = max(1, min(64, (1024 if backward else 2048) // block_d))
    warps = 4 if block_d * rows <= 2048 else 8 if block_d * rows <= 8192 else 16
    return block_d, rows, warps


def _flat(t: torch.Tensor, D: int) -> torch.Tensor:
    t2 = t.reshape(-1, D)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rmsnorm_fwd_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, store_r: bool = True,
                       residual: torch.Tensor | None = None, offset: bool = False):
    """-> (y like x with dtype promote(w, x), r (N,) fp32 or None, s or None). With
    `residual` h (like x, same dtype): the norm is of s = h + x, returned as s. `offset`:
    `offset_rmsnorm`'s y (x.dtype) instead."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rmsnorm: weight shape {tuple(weight.shape)} != ({D},)")
    x2 = _flat(x, D)
    N = x2.shape[0]
    y = torch.empty((N, D), dtype=x.dtype if offset else torch.result_type(weight, x), device=x.device)
    r = torch.empty((N,), dtype=torch.float32, device=x.device) if store_r else y
    add = residual is not None
    h2 = _flat(residual, D) if add else x2
    s = torch.empty((N, D), dtype=x.dtype, device=x.device) if add else y
    block_d, rows, warps = _tile(D)
    if N:
        _rmsnorm_fwd_kernel[(triton.cdiv(N, rows),)](
            x2, weight.contiguous(), y, r, h2, s, N, D, x2.stride(0), y.stride(0), h2.stride(0), s.stride(0),
            float(eps), ROWS=rows, BLOCK_D=block_d, STORE_R=store_r, ADD=add, OFFSET=offset, num_warps=warps,
            **NO_FMA)
    return (y.view(*x.shape[:-1], D), (r if store_r else None),
            (s.view(*x.shape[:-1], D) if add else None))


def _num_partials(N: int, rows: int, device: torch.device) -> int:
    # Enough programs to fill the GPU (8 an SM: the sweep behind _tile); a function of N and
    # the device only, so dw's summation order never depends on the batch composition.
    return max(1, min(triton.cdiv(N, rows), 8 * num_sms(device)))


def rmsnorm_bwd_triton(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, r: torch.Tensor):
    D = x.shape[-1]
    x2, dy2 = _flat(x, D), _flat(dy, D)
    N = x2.shape[0]
    block_d, rows, warps = _tile(D, backward=True)
    dx = torch.empty((N, D), dtype=x.dtype, device=x.device)
    P = _num_partials(N, rows, x.device)
    rows_per_prog = triton.cdiv(triton.cdiv(N, P), rows) * rows
    P = max(1, triton.cdiv(N, rows_per_prog))
    dw_part = torch.empty((P, block_d), dtype=torch.float32, device=x.device)
    if N:
        _rmsnorm_bwd_kernel[(P,)](dy2, x2, weight.contiguous(), r, dx, dw_part, N, D, rows_per_prog,
                                  dy2.stride(0), x2.stride(0), dx.stride(0),
                                  ROWS=rows, BLOCK_D=block_d, num_warps=warps)
        dw = torch.empty((D,), dtype=weight.dtype, device=x.device)
        _rmsnorm_dw_sum_kernel[(triton.cdiv(D, _DW_COLS),)](dw_part, dw, P, D, BLOCK_D=block_d, COLS=_DW_COLS,
                                                           BLOCK_P=_DW_ROWS, num_warps=_DW_WARPS)
    else:
        dw = torch.zeros((D,), dtype=weight.dtype, device=x.device)
    return dx.view(x.shape), dw


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, r, _ = rmsnorm_fwd_triton(x, weight, eps)
        ctx.save_for_backward(x, weight, r)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        dx, dw = rmsnorm_bwd_triton(dy, x, weight, r)
        return dx, dw, None


def rmsnorm(x, weight, eps):
    """The op on the Triton backend (autograd where a gradient is needed)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return rmsnorm_fwd_triton(x, weight, eps, store_r=False)[0]


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, x, weight, eps):
        ctx.set_materialize_grads(False)
        y, r, s = rmsnorm_fwd_triton(x, weight, eps, residual=h)
        ctx.save_for_backward(s, weight, r)
        return s, y

    @staticmethod
    def backward(ctx, ds, dy):
        s, weight, r = ctx.saved_tensors
        dw = None
        if dy is not None:
            dn, dw = rmsnorm_bwd_triton(dy, s, weight, r)
            # autograd's sum of s's two gradients: one add in s.dtype (commutative, so bitwise
            # the unfused graph's whichever order it accumulates them in)
            ds = dn if ds is None else ds + dn
        return ds, ds, dw, None


def add_rmsnorm(h, x, weight, eps):
    """(h + x, rmsnorm(h + x)) in one forward kernel (autograd where a gradient is needed)."""
    if torch.is_grad_enabled() and (h.requires_grad or x.requires_grad or weight.requires_grad):
        return _AddRMSNorm.apply(h, x, weight, eps)
    y, _, s = rmsnorm_fwd_triton(x, weight, eps, store_r=False, residual=h)
    return s, y


def offset_rmsnorm(x, weight, eps, residual=None):
    """`rlfuse.kernels.norm.rms.offset_rmsnorm` on the Triton backend, inference only (the
    public op sends a gradient through the reference's composition): one kernel."""
    y, _, s = rmsnorm_fwd_triton(x, weight, eps, store_r=False, residual=residual, offset=True)
    return y if residual is None else (s, y)
