"""`mean_square`, the row reduction of every RMSNorm kernel (plain, fused q/k norm + RoPE,
gated), against its spec `pairwise_sum(x * x) / D`, bit for bit, under the Triton
interpreter: powers of two 16..4096, odd D padded to BLOCK_D, masked rows, fp32 / bf16 /
fp16 inputs, with and without PIN (which may only move the result, never change it).

    python -m pytest -q tests/test_kernel_mean_square.py
"""

import pytest
import torch
import triton
import triton.language as tl

from rlfuse.kernels.invariant import pairwise_sum
from rlfuse.kernels.norm.triton_rms import mean_square


@triton.jit
def _mean_square_kernel(X, OUT, N, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, PIN: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    x = tl.load(X + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + rows, mean_square(x, D, PIN), mask=rows < N)


def _mean_square(x: torch.Tensor, pin: bool) -> torch.Tensor:
    N, D = x.shape
    out = torch.full((N,), float("nan"))  # poisoned: every row must be written
    rows = 4
    _mean_square_kernel[(triton.cdiv(N, rows),)](x.contiguous(), out, N, D, ROWS=rows,
                                                 BLOCK_D=triton.next_power_of_2(D), PIN=pin)
    return out


@pytest.mark.parametrize("D", [1, 3, 16, 17, 32, 64, 100, 128, 129, 256, 512, 1000, 1024, 2048, 3000, 4096])
def test_mean_square_is_the_pairwise_tree_bitwise(D):
    g = torch.Generator().manual_seed(D)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        # wide magnitudes, so that a different summation order would round differently
        x = (torch.randn(7, D, generator=g) * torch.exp(2 * torch.randn(7, 1, generator=g))).to(dtype)
        want = pairwise_sum(x.float() * x.float(), -1) / D
        for pin in (False, True):
            got = _mean_square(x, pin)
            assert torch.equal(got, want), (D, dtype, pin, (got - want).abs().max())


def test_mean_square_pin_keeps_special_values():
    # PIN selects the tree's value against a row sum that is never < 0: inf and NaN rows too
    x = torch.randn(6, 40)
    x[1, 3] = float("inf")
    x[2, 5] = float("nan")
    x[3] = 0.0
    x[4, 7] = 3e38  # the square overflows to inf
    want = pairwise_sum(x * x, -1) / 40
    for pin in (False, True):
        assert torch.equal(_mean_square(x, pin).nan_to_num(nan=-1.0), want.nan_to_num(nan=-1.0))
