"""Batch-invariant building blocks for the exact-mode PyTorch references.

On CPU, torch's own kernels are not batch-invariant: an fp32 GEMM picks its algorithm
from M (row k of `x @ W.T` differs bitwise from `(x[:k+1] @ W.T)[k]`), and unary ops
such as exp2, sigmoid and silu run a SIMD body and a scalar tail that disagree in the
last bit, so an element's result depends on where it falls in the tensor. The exact
references are written with the three helpers below instead; each gives an element a
result that depends only on that element's own inputs:

  pairwise_sum(x, dim)   sum by repeated halving over a zero-padded power-of-two length:
                         x[i] + x[i + n/2], then again, ... Padding with exact zeros to
                         any larger power of two gives the same bits (x + 0 == x), so a
                         row summed with 5 entries or with 3 real ones and 2 masked zeros
                         agrees with the same row inside a longer padded buffer.
  pointwise(fn, x)       applies fn to x padded to whole SIMD chunks (every element goes
                         through the vector body, never the scalar tail) in pieces small
                         enough that torch never splits them across threads.
  matmul_nt(a, b)        a (M, K) @ b (N, K)^T: fp32 products, pairwise_sum over K.
                         Row m of the result depends on a[m] and b only.
  elementwise(fn, x)     `pointwise` where it matters (exact numerics on CPU), else fn(x):
                         what the models call for sigmoid / exp / softplus gates.

They are references (the readable spec and the CPU path of exact mode): O(M N K)
memory in chunks, slow, and exact by construction. Tests:
`python -m pytest -q tests/test_exact_numerics.py`.
"""

from __future__ import annotations

import torch

from rlfuse.kernels.backend import is_exact

_SIMD_CHUNK = 64  # a multiple of every CPU vector body width torch uses (2 x 16 fp32 lanes on AVX-512)
_PIECE = 16384  # elements per call: below torch's parallel grain (32768), so one thread does a piece
_MATMUL_ELEMS = 1 << 22  # products held at once by matmul_nt (16 MiB of fp32)


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pairwise_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` by halving a zero-padded power-of-two length (see module docstring)."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    if n == 0:
        return x.new_zeros(x.shape[:-1])
    p = _next_pow2(n)
    if p != n:
        x = torch.nn.functional.pad(x, (0, p - n))
    while p > 1:
        p //= 2
        x = x[..., :p] + x[..., p:]
    return x[..., 0]


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) elementwise, every element through the same (vector) code path."""
    flat = x.reshape(-1)
    n = flat.numel()
    if n == 0:
        return fn(x)
    pad = (-n) % _SIMD_CHUNK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    out = torch.cat([fn(flat[i:i + _PIECE].contiguous()) for i in range(0, flat.numel(), _PIECE)])
    return out[:n].view(x.shape)


def elementwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x); in exact numerics on CPU through `pointwise` (an element's value would otherwise
    depend on T: the SIMD body and scalar tail disagree). CUDA elementwise kernels have no tail."""
    return pointwise(fn, x) if is_exact() and not x.is_cuda else fn(x)


def matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T in fp32 (fp64 for fp64 inputs), batch-invariant in M."""
    ct = torch.float64 if a.dtype == torch.float64 else torch.float32
    a, b = a.to(ct), b.to(ct)
    M, K = a.shape
    N = b.shape[0]
    out = a.new_empty((M, N))
    rows = max(1, _MATMUL_ELEMS // max(1, N * K))
    for i in range(0, M, rows):
        out[i:i + rows] = pairwise_sum(a[i:i + rows, None, :] * b[None, :, :], -1)
    return out
