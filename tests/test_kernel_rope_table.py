"""The step's RoPE table (`rope_cos_sin`) changes no bit: RoPE (forward and backward) and the
fused q/k norms + RoPE (+ KV store) that load cos/sin from it equal the same kernels
computing cos/sin themselves and the unfused ops (rmsnorm, then the RoPE kernel on half
tiles), in both numerics, fp32 and bf16, odd shapes (T not a multiple of the token block,
Dh/2 not a power of two), large positions, strided inputs, either program grid.
CPU: Triton's interpreter at small shapes; GPU (marked): the Qwen3-0.6B decode step.

    python -m pytest -q tests/test_kernel_rope_table.py
    python -m pytest -m gpu tests/test_kernel_rope_table.py      (on the GPU machine)
"""

import pytest
import torch

from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.rope.rotary import qk_norm_rope, qk_norm_rope_ref, rope, rope_cos_sin, rope_inv_freq

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(g, T, Hq, Hkv, Dh, dtype, max_pos):
    # q, k, v as views of one fused projection output (unit stride on Dh only)
    qkv = (torch.randn(T, (Hq + 2 * Hkv) * Dh, generator=g) * 2).to(DEV, dtype)
    q, k, v = (t.view(T, -1, Dh) for t in qkv.split([Hq * Dh, Hkv * Dh, Hkv * Dh], dim=1))
    w = [(1 + 0.3 * torch.randn(Dh, generator=g)).to(DEV, dtype) for _ in range(2)]
    pos = torch.randint(0, max_pos, (T,), generator=g).to(DEV)
    return q, k, v, w, pos


def _check_qk(q, k, v, w, pos, inv, g, page=16):
    """qk_norm_rope with the table == without == the unfused ops (rmsnorm, rope, which
    compute cos/sin themselves), with and without norms and the KV store; -> the outputs
    (q, k, the caches)."""
    T, Hkv, Dh = k.shape
    cs = rope_cos_sin(pos, inv)
    assert cs is not None and cs.shape == (T, Dh) and cs.dtype == torch.float32
    pages = -(-(T + 8) // page) + 1
    slots = torch.randperm(pages * page, generator=g)[:T].to(DEV)
    slots[:: 5] = -1  # graph-batch padding rows
    outs = []
    for ws in ((*w, 1e-6), ()):
        a = qk_norm_rope(q, k, pos, inv, *ws)
        b = qk_norm_rope(q, k, pos, inv, *ws, cos_sin=cs)
        ref = qk_norm_rope_ref(q, k, pos, inv, *ws)
        assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, ref, strict=True))
        outs += a
        if Dh & (Dh - 1):  # the paged cache takes power-of-two head dims only
            continue
        caches = [torch.full((pages, page, Hkv, Dh), 7.0, dtype=q.dtype, device=DEV) for _ in range(4)]
        qa, _ = qk_norm_rope(q, k, pos, inv, *ws, v=v, kv_cache=caches[:2], slot_mapping=slots)
        qb, _ = qk_norm_rope(q, k, pos, inv, *ws, v=v, kv_cache=caches[2:], slot_mapping=slots, cos_sin=cs)
        assert torch.equal(qa, qb) and torch.equal(qa, a[0])
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        outs += caches[:2]
    return outs


@pytest.mark.parametrize("numerics", ["fast", "exact"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,Dh", [(21, 32), (5, 48)])  # T off the 16-token block; Dh/2 = 24 off a power of 2
def test_table_is_the_in_kernel_cos_sin(numerics, dtype, T, Dh, monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k, v, w, pos = _inputs(g, T, 4, 2, Dh, dtype, 200000)  # angles far past 2 pi: the long reduction
    inv = rope_inv_freq(Dh, 1e6).to(DEV)
    dy = torch.randn(T, 4, Dh, generator=g).to(DEV, dtype)
    with use_backend("triton"), use_numerics(numerics):
        with torch.no_grad():
            spread = _check_qk(q, k, v, w, pos, inv, torch.Generator().manual_seed(1))
            from rlfuse.kernels.rope import triton_rotary as R
            monkeypatch.setattr(R, "_MIN_PROGRAMS", 1)  # every head of a token block in one program
            whole = _check_qk(q, k, v, w, pos, inv, torch.Generator().manual_seed(1))
            assert all(torch.equal(a, b) for a, b in zip(spread, whole, strict=True))
        cs = rope_cos_sin(pos, inv)
        outs = []
        for table in (None, cs):  # the plain op under autograd: forward and backward
            x = q.clone().requires_grad_()
            y = rope(x, pos, inv, table)
            (dx,) = torch.autograd.grad(y, x, dy)
            outs.append((y.detach(), dx))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        # batch invariance of the table itself: a token's row ignores the others
        assert torch.equal(rope_cos_sin(pos[3:5], inv), cs[3:5])


def test_table_only_on_triton_and_checked():
    pos, inv = torch.arange(6, device=DEV), rope_inv_freq(16, 1e4).to(DEV)
    with use_backend("torch"):
        assert rope_cos_sin(pos, inv) is None  # the references compute their own
    q = torch.randn(6, 2, 16, device=DEV)
    with use_backend("triton"), torch.no_grad():
        cs = rope_cos_sin(pos, inv)
        with pytest.raises(ValueError, match=r"cos_sin must be a contiguous \(6, 16\) float32"):
            qk_norm_rope(q, q, pos, inv, cos_sin=cs[:5])
        with pytest.raises(ValueError, match=r"cos_sin must be a contiguous \(6, 16\) float32"):
            rope(q, pos, inv, cs.double())
        assert rope_cos_sin(pos[:0], inv).shape == (0, 16)


@pytest.mark.gpu
def test_cuda_table_bitwise_at_qwen3_decode():
    """Compiled kernels, the Qwen3-0.6B decode step (B = 256, 16 q / 8 kv heads, Dh 128, bf16,
    positions of a long rollout) and a training-sized pack (T = 4096, RoPE forward and
    backward): the table changes no bit, and the fused kernel's whole-row tiles give the
    unfused ops' bits (the compiler's contractions and reduction layout, unseen on CPU)."""
    g = torch.Generator().manual_seed(1)
    inv = rope_inv_freq(128, 1e6).to(DEV)
    with use_backend("triton"):
        for numerics in ("fast", "exact"):
            with use_numerics(numerics), torch.no_grad():
                q, k, v, w, pos = _inputs(g, 256, 16, 8, 128, torch.bfloat16, 40960)
                _check_qk(q, k, v, w, pos, inv, g)
        q, k, v, w, pos = _inputs(g, 4096, 16, 8, 128, torch.bfloat16, 4096)
        cs = rope_cos_sin(pos, inv)
        dy = torch.randn(4096, 16, 128, generator=g).to(DEV, torch.bfloat16)
        outs = []
        for table in (None, cs):
            x = q.clone().requires_grad_()
            y = rope(x, pos, inv, table)
            outs.append((y.detach(), *torch.autograd.grad(y, x, dy)))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_multi_axis_table(backend, numerics):
    """mRoPE / 2-D RoPE: frequency f reads position row axis[f]. Equal rows give the
    single-row bits (the table, and RoPE forward and backward run from it); distinct rows
    give the fp32 angles' cos/sin; a token's row ignores the others."""
    g = torch.Generator().manual_seed(3)
    T, Dh = 21, 24  # Dh/2 = 12 frequencies, off a power of two
    inv = rope_inv_freq(Dh, 1e4).to(DEV)
    axis = torch.tensor([0, 1, 2] * 3 + [0] * 3, device=DEV)  # interleaved, as Qwen3-VL's mrope_section (4, 3, 3)
    pos = torch.randint(0, 5000, (T,), generator=g).to(DEV)
    x = torch.randn(T, 3, Dh, generator=g).to(DEV)
    dy = torch.randn(T, 3, Dh, generator=g).to(DEV)
    with use_backend(backend), use_numerics(numerics):
        same = rope_cos_sin(pos.expand(3, -1).contiguous(), inv, axis)
        plain = rope_cos_sin(pos, inv)
        if plain is not None:
            assert torch.equal(same, plain)
        outs = []
        for table in (None, same):
            xx = x.clone().requires_grad_()
            y = rope(xx, pos, inv, table)
            outs.append((y.detach(), *torch.autograd.grad(y, xx, dy)))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        rows = torch.randint(0, 5000, (3, T), generator=g).to(DEV)
        cs = rope_cos_sin(rows, inv, axis)
        ang = (rows[axis].t().float() * inv[None, :]).double()  # the fp32 angles, then exact cos/sin
        torch.testing.assert_close(cs, torch.cat([ang.cos(), ang.sin()], -1).float(), rtol=0, atol=2e-6)
        assert torch.equal(rope_cos_sin(rows[:, 4:9].contiguous(), inv, axis), cs[4:9])
