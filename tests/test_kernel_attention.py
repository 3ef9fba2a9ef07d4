"""varlen_attention (Triton) vs float64 gold: forward, lse, backward, tiles, invariance.

Tolerance (one rule for every dtype): err(triton) <= 4 * err(reference in the same
dtype) + 4 * u * max|gold|, u = unit roundoff (2^-8 bf16, 2^-11 fp16, 2^-24 fp32).
Why 4u: beyond the reference, the kernel rounds P (forward) or dS (backward) to the
input dtype before the second matmul (each term of the sum off by <= u relative) and
rounds the result once (<= u |gold|); 4u leaves a factor ~2 over that. Why 4x the
reference: in fp32 (where the u term is negligible) the kernel sums over KV blocks in a
different order than the reference's single matmul; the measured error ratio was up to
2.3 (dq, 6 seeds, lengths up to 265, tests on CPU); 4x keeps the check at ~1e-6.
On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); shapes are small.
Run: python -m pytest -q tests/test_kernel_attention.py
"""

import pytest
import torch

from rlfuse.kernels import use_backend
from rlfuse.kernels.attention.triton_varlen import varlen_bwd, varlen_fwd
from rlfuse.kernels.attention.varlen import KV_BLOCK, varlen_attention, varlen_attention_ref

U = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_TILES = {"fwd": dict(BLOCK_M=16, BLOCK_N=16), "dkdv": dict(BLOCK_M=16, BLOCK_N=16),
               "dq": dict(BLOCK_M=16, BLOCK_N=16)}
# query and key tiles of different sizes: diagonal blocks start at multiples of the other tile
MIXED_TILES = {"fwd": dict(BLOCK_M=16, BLOCK_N=32), "dkdv": dict(BLOCK_M=32, BLOCK_N=16),
               "dq": dict(BLOCK_M=16, BLOCK_N=32)}


def _cu(lens, device=DEV):
    return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def _inputs(lens, hq, hkv, dh, dtype, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v, do = (torch.randn(T, h, dh, generator=g).to(dtype).to(device) for h in (hq, hkv, hkv, hq))
    return q, k, v, do


def _gold(q, k, v, cu, max_len, do=None):
    """float64 output, lse and (if do) grads of the reference on the same (rounded) inputs."""
    xs = [x.detach().double().requires_grad_(do is not None) for x in (q, k, v)]
    o, lse = varlen_attention_ref(*xs, cu, max_len, return_lse=True)
    grads = torch.autograd.grad(o, xs, do.double()) if do is not None else None
    return o.detach(), lse, grads


def _ref_same_dtype(q, k, v, cu, max_len, do=None):
    xs = [x.detach().clone().requires_grad_(do is not None) for x in (q, k, v)]
    o = varlen_attention_ref(*xs, cu, max_len)
    grads = torch.autograd.grad(o, xs, do) if do is not None else None
    return o.detach(), grads


def _assert_close(name, got, gold, ref, dtype):
    assert torch.isfinite(got).all(), f"{name}: non-finite values (unwritten rows?)"
    err = (got.double() - gold).abs().max().item()
    tol = 4 * (ref.double() - gold).abs().max().item() + 4 * U[dtype] * gold.abs().max().item()
    assert err <= tol, f"{name}: max err {err:.3e} > tol {tol:.3e}"


# lengths: 1, not multiples of any block, one spanning several 16-tiles
LENS = [1, 17, 64, 5, 40]


@pytest.mark.parametrize("dtype,hq,hkv,dh", [
    (torch.float32, 4, 2, 32), (torch.bfloat16, 4, 2, 32), (torch.float16, 4, 4, 16),
    (torch.bfloat16, 4, 1, 64), (torch.float32, 4, 4, 16),
])
def test_forward_and_lse_vs_gold(dtype, hq, hkv, dh):
    q, k, v, _ = _inputs(LENS, hq, hkv, dh, dtype)
    cu, T = _cu(LENS), sum(LENS)
    gold_o, _, _ = _gold(q, k, v, cu, max(LENS))
    ref_o, _ = _ref_same_dtype(q, k, v, cu, max(LENS))
    # lse gold straight from torch.logsumexp over the float64 causal scores, per sequence
    gold_lse = torch.empty(hq, T, dtype=torch.float64)
    for s, e in zip(cu.tolist()[:-1], cu.tolist()[1:]):
        qd = q[s:e].double().transpose(0, 1).cpu()
        kd = k[s:e].double().transpose(0, 1).repeat_interleave(hq // hkv, 0).cpu()
        sc = (qd @ kd.transpose(1, 2)) * dh**-0.5
        sc = sc.masked_fill(~torch.ones(e - s, e - s, dtype=torch.bool).tril(), float("-inf"))
        gold_lse[:, s:e] = torch.logsumexp(sc, -1)
    for config in (None, SMALL_TILES["fwd"], MIXED_TILES["fwd"]):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((hq, T), float("nan"), device=q.device)
        varlen_fwd(q, k, v, cu, max(LENS), dh**-0.5, config=config, out=out, lse=lse)
        _assert_close(f"o {config}", out, gold_o, ref_o, dtype)
        assert torch.isfinite(lse).all()
        torch.testing.assert_close(lse.double().cpu(), gold_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,hq,hkv,dh,config", [
    (torch.float32, 4, 2, 32, None), (torch.bfloat16, 4, 2, 32, None),
    (torch.float32, 4, 4, 16, SMALL_TILES), (torch.bfloat16, 4, 1, 16, SMALL_TILES),
    (torch.float16, 4, 2, 64, None), (torch.float32, 4, 2, 16, MIXED_TILES),
])
def test_backward_vs_gold(dtype, hq, hkv, dh, config):
    q, k, v, do = _inputs(LENS, hq, hkv, dh, dtype, seed=1)
    cu = _cu(LENS)
    gold_o, _, gold_g = _gold(q, k, v, cu, max(LENS), do)
    _, ref_g = _ref_same_dtype(q, k, v, cu, max(LENS), do)
    o, lse = varlen_fwd(q, k, v, cu, max(LENS), dh**-0.5, config=(config or {}).get("fwd"))
    grads = tuple(torch.full_like(x, float("nan")) for x in (q, k, v))
    bwd_cfg = {n: c for n, c in (config or {}).items() if n != "fwd"}
    varlen_bwd(do, q, k, v, o, lse, cu, max(LENS), dh**-0.5, config=bwd_cfg, grads=grads)
    for name, got, gold, ref in zip("qkv", grads, gold_g, ref_g):
        _assert_close(f"d{name}", got, gold, ref, dtype)


def test_autograd_public_op_longer_sequence_default_tiles():
    # one sequence longer than two default query blocks and several KV blocks, through
    # torch.autograd; q is a non-contiguous slice of a fused qkv tensor
    # bf16, so the 16-bit default tiles run (fp32 has its own, smaller ones)
    lens, hq, hkv, dh = [3, 2 * 128 + 37], 2, 1, 16
    assert lens[1] > 4 * KV_BLOCK
    T, dtype = sum(lens), torch.bfloat16
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(T, hq + 2 * hkv, dh, generator=g).to(dtype).to(DEV)
    do = torch.randn(T, hq, dh, generator=g).to(dtype).to(DEV)
    cu = _cu(lens)
    gold_o, gold_lse, gold_g = _gold(qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], cu, max(lens), do)
    ref_o, ref_g = _ref_same_dtype(qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], cu, max(lens), do)
    leaf = qkv.clone().requires_grad_()
    q, k, v = leaf[:, :hq], leaf[:, hq:hq + hkv], leaf[:, hq + hkv:]
    assert not q.is_contiguous()
    with use_backend("triton"):
        o, lse = varlen_attention(q, k, v, cu, max(lens), return_lse=True)
    o.backward(do)
    _assert_close("o", o.detach(), gold_o, ref_o, dtype)
    torch.testing.assert_close(lse.double().cpu(), gold_lse.cpu(), atol=1e-5, rtol=1e-5)
    gq, gk, gv = leaf.grad[:, :hq], leaf.grad[:, hq:hq + hkv], leaf.grad[:, hq + hkv:]
    for name, got, gold, ref in zip("qkv", (gq, gk, gv), gold_g, ref_g):
        _assert_close(f"d{name}", got, gold, ref, dtype)


def test_sequence_independence_and_determinism():
    # a sequence's output and gradients do not depend on its neighbours in the pack
    # (bitwise), and two backward runs give identical bits (no atomics)
    lens, hq, hkv, dh, dtype = [9, 30, 21], 4, 2, 16, torch.bfloat16
    q, k, v, do = _inputs(lens, hq, hkv, dh, dtype, seed=3)
    cu = _cu(lens)
    o, lse = varlen_fwd(q, k, v, cu, max(lens), dh**-0.5)
    g1 = varlen_bwd(do, q, k, v, o, lse, cu, max(lens), dh**-0.5)
    g2 = varlen_bwd(do, q, k, v, o, lse, cu, max(lens), dh**-0.5)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    s, e = 9, 39  # the middle sequence alone
    one = _cu([30])
    o1, lse1 = varlen_fwd(q[s:e], k[s:e], v[s:e], one, 30, dh**-0.5)
    assert torch.equal(o1, o[s:e]) and torch.equal(lse1, lse[:, s:e])
    d1 = varlen_bwd(do[s:e], q[s:e], k[s:e], v[s:e], o1, lse1, one, 30, dh**-0.5)
    assert all(torch.equal(a, b[s:e]) for a, b in zip(d1, g1))


def test_rows_outside_sequences_untouched_and_empty_sequences():
    # cu_seqlens with an empty sequence and 5 trailing rows that belong to none
    lens, hq, hkv, dh, dtype = [7, 0, 12], 2, 2, 16, torch.float32
    q, k, v, _ = _inputs([*lens, 5], hq, hkv, dh, dtype, seed=4)
    cu = _cu(lens)
    out = torch.full_like(q, float("nan"))
    varlen_fwd(q, k, v, cu, 12, dh**-0.5, out=out)
    assert torch.isnan(out[19:]).all() and torch.isfinite(out[:19]).all()
    gold = varlen_attention_ref(q[:19].double(), k[:19].double(), v[:19].double(), cu, 12)
    torch.testing.assert_close(out[:19].double(), gold, atol=1e-5, rtol=1e-5)


def test_backend_torch_matches_reference_and_rejects_bad_head_dim():
    q, k, v, _ = _inputs([4], 2, 1, 16, torch.float32)
    with use_backend("torch"):
        assert torch.equal(varlen_attention(q, k, v, _cu([4]), 4), varlen_attention_ref(q, k, v, _cu([4]), 4))
    bad = torch.randn(4, 2, 24, device=DEV)
    with use_backend("triton"), pytest.raises(ValueError, match="head_dim"):
        varlen_attention(bad, bad[:, :1], bad[:, :1], _cu([4]), 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dh", [64, 128])
def test_cuda_bf16_real_sizes(dh):
    lens = [1, 300, 1025, 77]
    q, k, v, do = _inputs(lens, 16, 8, dh, torch.bfloat16, seed=5)
    cu = _cu(lens)
    gold_o, _, gold_g = _gold(q, k, v, cu, max(lens), do)
    ref_o, ref_g = _ref_same_dtype(q, k, v, cu, max(lens), do)
    o, lse = varlen_fwd(q, k, v, cu, max(lens), dh**-0.5)
    _assert_close("o", o, gold_o, ref_o, torch.bfloat16)
    for name, got, gold, ref in zip("qkv", varlen_bwd(do, q, k, v, o, lse, cu, max(lens), dh**-0.5), gold_g, ref_g):
        _assert_close(f"d{name}", got, gold, ref, torch.bfloat16)
