"""Grouped GEMM over expert-sorted rows, the Triton kernels: forward (the exact linear's
canonical K order), dx and dW (the math and the steps are in
`rlfuse.kernels.moe.grouped_gemm`'s docstring)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlfuse.kernels.linear.triton_gemm import _store_tile, _tile_sum, _tiles
from rlfuse.kernels.triton_common import dot, dot_precision, round_to


@triton.jit(do_not_specialize=['M'])  # row counts vary per step: one compile
def _grouped_fwd_kernel(X, W, Y, TILE_E, TILE_ROW, OFFS, M, N, K, sxm, swe, swn, sym, CHUNK_K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    slot = tl.program_id(0)
    e = tl.load(TILE_E + slot)
    if e >= 0:  # -1: a slot past the tiles this routing needs
        end = tl.load(OFFS + e + 1)
        rows = tl.load(TILE_ROW + slot) + tl.arange(0, BLOCK_M).to(tl.int64)
        cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        # the exact linear's tile sum over W[e]: rows at or past `end` are masked like rows past M
        y = _tile_sum(X, W + e * swe, W, rows, cols, end, N, K, sxm, swn, CHUNK_K, False,
                      BLOCK_M, BLOCK_N, BLOCK_K, PREC)
        _store_tile(Y, y, rows, cols, sym, end, N)


@triton.jit(do_not_specialize=['M'])
def _grouped_dx_kernel(DY, W, DX, TILE_E, TILE_ROW, OFFS, M, N, K, sdym, swe, swn, swk, sdxm,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    """dx[rows, ks] = dy[rows, :] W[e][:, ks], N walked BLOCK_N at a time."""
    slot = tl.program_id(0)
    e = tl.load(TILE_E + slot)
    if e >= 0:
        end = tl.load(OFFS + e + 1)
        rows = tl.load(TILE_ROW + slot) + tl.arange(0, BLOCK_M).to(tl.int64)
        ks = (tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        for n0 in range(0, N, BLOCK_N):
            ns = n0 + tl.arange(0, BLOCK_N)
            a = tl.load(DY + rows[:, None] * sdym + ns[None, :], mask=(rows < end)[:, None] & (ns < N)[None, :],
                        other=0.0)
            b = tl.load(W + e * swe + ns[:, None] * swn + ks[None, :] * swk,
                        mask=(ns < N)[:, None] & (ks < K)[None, :], other=0.0)
            acc = dot(a, b, acc, PREC)
        DT = DX.dtype.element_ty
        tl.store(DX + rows[:, None] * sdxm + ks[None, :], round_to(acc, DT).to(DT),
                 mask=(rows < end)[:, None] & (ks < K)[None, :])


@triton.jit
def _grouped_dw_kernel(DY, X, DW, OFFS, N, K, sdym, sxm, sdwe, sdwn,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PREC: tl.constexpr):
    """dW[e, ns, ks] = sum over expert e's rows r of dy[r, ns]^T x[r, ks], BLOCK_R rows at a time."""
    e = tl.program_id(1).to(tl.int64)
    tiles_k = tl.cdiv(K, BLOCK_K)
    ns = ((tl.program_id(0) // tiles_k) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = ((tl.program_id(0) % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    start = tl.load(OFFS + e)
    end = tl.load(OFFS + e + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        a = tl.load(DY + rs[None, :] * sdym + ns[:, None], mask=(rs < end)[None, :] & (ns < N)[:, None], other=0.0)
        b = tl.load(X + rs[:, None] * sxm + ks[None, :], mask=(rs < end)[:, None] & (ks < K)[None, :], other=0.0)
        acc = dot(a, b, acc, PREC)
    DT = DW.dtype.element_ty
    tl.store(DW + e * sdwe + ns[:, None] * sdwn + ks[None, :], round_to(acc, DT).to(DT),
             mask=(ns < N)[:, None] & (ks < K)[None, :])


def tile_table(offsets: torch.Tensor, M: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1: (expert, first row) of each of the cdiv(M, block_m) + E row-tile slots, int64;
    expert -1 marks an unused slot. Device ops only (no host sync)."""
    E = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    slots = torch.arange(triton.cdiv(M, block_m) + E, device=offsets.device)
    e = torch.searchsorted(tile_end, slots, right=True)  # the expert whose tiles cover the slot
    ec = e.clamp(max=E - 1)
    row0 = offsets[ec] + (slots - (tile_end[ec] - tiles[ec])) * block_m
    return torch.where(e < E, e, -1), row0


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def grouped_fwd(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    x, weight = _unit_rows(x), _unit_rows(weight)
    M, K = x.shape
    E, N, _ = weight.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    # the tile family by the mean rows an expert gets (decode: a few, narrow tiles; training:
    # hundreds, wide ones); every family has the canonical BLOCK_K and CHUNK_K, so the bits
    # do not depend on the choice (the exact linear's rule, its docstring)
    t = _tiles(x.dtype, -(-M // E))
    tile_e, tile_row = tile_table(offsets, M, t["BLOCK_M"])
    grid = (tile_e.numel(), triton.cdiv(N, t["BLOCK_N"]))
    _grouped_fwd_kernel[grid](x, weight, y, tile_e, tile_row, offsets, M, N, K, x.stride(0), weight.stride(0),
                              weight.stride(1), y.stride(0), t["CHUNK_K"], BLOCK_M=t["BLOCK_M"],
                              BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"], PREC=dot_precision(x),
                              num_warps=t["num_warps"], num_stages=t["num_stages"])
    return y


def _bwd_tiles(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_OUT, BLOCK_RED, warps) of the backward kernels: fp32 (the test dtype) a small tile."""
    return (32, 32, 32, 4) if dtype == torch.float32 else (64, 64, 64, 4)


def grouped_dx(dy: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    dy = _unit_rows(dy)
    M, N = dy.shape
    E, _, K = weight.shape
    dx = torch.empty((M, K), dtype=dy.dtype, device=dy.device)
    if M == 0:
        return dx
    bm, bk, bn, warps = _bwd_tiles(dy.dtype)
    tile_e, tile_row = tile_table(offsets, M, bm)
    _grouped_dx_kernel[(tile_e.numel(), triton.cdiv(K, bk))](
        dy, weight, dx, tile_e, tile_row, offsets, M, N, K, dy.stride(0), weight.stride(0), weight.stride(1),
        weight.stride(2), dx.stride(0), BLOCK_M=bm, BLOCK_K=bk, BLOCK_N=bn, PREC=dot_precision(dy), num_warps=warps)
    return dx


def grouped_dw(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    dy, x = _unit_rows(dy), _unit_rows(x)
    E, N, K = weight.shape
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
    bn, bk, br, warps = _bwd_tiles(dy.dtype)
    _grouped_dw_kernel[(triton.cdiv(N, bn) * triton.cdiv(K, bk), E)](
        dy, x, dw, offsets, N, K, dy.stride(0), x.stride(0), dw.stride(0), dw.stride(1), BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_R=br, PREC=dot_precision(dy), num_warps=warps)
    return dw


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offsets):
        ctx.save_for_backward(x, weight, offsets)
        return grouped_fwd(x, weight, offsets)

    @staticmethod
    def backward(ctx, dy):
        x, weight, offsets = ctx.saved_tensors
        dx = grouped_dx(dy, weight, offsets) if ctx.needs_input_grad[0] else None
        dw = grouped_dw(dy, x, offsets, weight) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _GroupedLinear.apply(x, weight, offsets)
    return grouped_fwd(x, weight, offsets)
