"""FP8 KV cache kernels (`rlfuse.kernels.kv_quant`, the fp8 paths of `rlfuse.kernels.attention`).

Quantization against its reference and against a float64 oracle of e4m3's nearest-even
rounding (ties, subnormals, saturation, signed zero); the scale rule; the fake quant the
trainer runs; the KV stores (plain and fused with q/k norm + RoPE) writing the reference's
bytes; paged attention over an fp8 cache (decode, prefill after a prefix, split and
unsplit) against float64 gold of the dequantized values; and the exactness contract: in
exact numerics, paged attention over the fp8 cache equals varlen attention over K/V
fake-quantized with the same scales, bit for bit, also through the shared-prefix decode.
Triton runs under the CPU interpreter at small shapes.
Run: python -m pytest -q tests/test_kernel_kv_fp8.py
"""

import pytest
import torch

from rlfuse.engine.step.shared_prefix import plan_shared_prefix
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.attention.paged import (
    SharedPrefixDecode,
    paged_attention,
    paged_attention_ref,
    shared_prefix_members,
    store_kvcache,
)
from rlfuse.kernels.attention.triton_paged import paged_attention_triton
from rlfuse.kernels.attention.varlen import varlen_attention
from rlfuse.kernels.kv_quant import (
    FP8_DTYPE,
    KVQuant,
    dequantize_kv,
    fake_quant_kv,
    quantize_kv,
    quantize_kv_ref,
    scales_from_amax,
)
from rlfuse.kernels.rope.rotary import qk_norm_rope, rope_inv_freq

DEV = "cuda" if torch.cuda.is_available() else "cpu"
U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
GRID = torch.arange(127, dtype=torch.uint8).view(FP8_DTYPE).double()  # every finite e4m3 value >= 0, ascending


def _oracle(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """float64 oracle: saturate, then the nearest e4m3 value, ties to the even code."""
    y = (x.double() * inv.double()[None, :, None]).clamp(-448, 448)
    a = y.abs().flatten()
    d = (a[:, None] - GRID[None, :]).abs()
    best = d.min(1, keepdim=True).values
    cand = (d == best)
    code = torch.where(cand.sum(1) > 1, (cand & (torch.arange(127) % 2 == 0)).int().argmax(1), cand.int().argmax(1))
    return (GRID[code] * torch.where(y.flatten() < 0, -1.0, 1.0)).view(y.shape)


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(29, 3, 16, generator=g) * torch.exp(torch.randn(29, 3, 16, generator=g) * 3)
    special = [1.0625, 1.1875, 1.3125, 2.0**-10, 2.0**-9 * 0.5, 2.0**-9 * 1.5, 2.0**-9 * 2.5, 2.0**-6 * 0.999,
               448.0, 464.0, 1e30, -1e30, -(2.0**-12), 0.0, 240.0, 232.0]  # ties, subnormals, saturation
    x[0, 0] = torch.tensor(special)
    return x.clamp(-6e4, 6e4).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_matches_reference_and_rounds_to_nearest_even(dtype):
    x = _inputs(dtype)
    inv = torch.tensor([1.0, 0.25, 8.0])
    ref = quantize_kv_ref(x, inv)
    gold = _oracle(x, inv)
    assert torch.equal(ref.double(), gold), "torch's cast is not the nearest-even saturating rounding"
    assert ref.view(torch.uint8)[0, 0, 12].item() == 0x80  # -2^-12 underflows to -0: the sign kept
    with use_backend("triton"):
        tri = quantize_kv(x.to(DEV), inv.to(DEV)).cpu()
    assert torch.equal(tri.view(torch.uint8), ref.view(torch.uint8))


def test_scales_are_powers_of_two_that_fit_amax_with_the_margin():
    amax = torch.tensor([0.0, 1e-3, 0.3, 1.0, 7.5, 224.0, 225.0, 3e4, float("inf"), float("nan")])
    s = scales_from_amax(amax, margin=2.0)
    m, _ = torch.frexp(s)
    assert torch.all(m == 0.5)  # powers of two
    ok = amax[1:8]
    fit = ok * 2.0 / s[1:8]
    assert torch.all(fit <= 448) and torch.all(fit > 224), fit  # the smallest such power
    assert s[0] == 1 and s[-1] == 1 and s[-2] == 1  # nothing seen / not finite: scale 1
    assert s[5] == 1 and s[6] == 2


def test_fake_quant_is_the_dequantized_cache_value_with_a_straight_through_gradient():
    x = _inputs(torch.bfloat16)[:, :2].clone().requires_grad_(True)
    scale, inv = torch.tensor([4.0, 0.5]), torch.tensor([0.25, 2.0])
    y = fake_quant_kv(x, scale, inv)
    assert y.dtype == x.dtype
    assert torch.equal(y.detach(), dequantize_kv(quantize_kv_ref(x.detach(), inv), scale, x.dtype))
    # the dequantization is exact: the fp8 value times a power of two, representable in bf16
    assert torch.equal(y.detach().double(), quantize_kv_ref(x.detach(), inv).double() * scale.double()[None, :, None])
    g = torch.randn(x.shape).to(x.dtype)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_kvquant_calibrates_in_place():
    kvq = KVQuant.unit(2, 3)
    scale, inv = kvq.scale, kvq.inv
    kvq.start_calibration()
    k, v = torch.full((5, 3, 16), 0.5), torch.full((5, 3, 16), 3.0)
    v[2, 1, 4] = -100.0
    assert kvq.apply(1, k, v) == (k, v)  # calibrating: nothing quantized
    amax = kvq.finish_calibration(margin=2.0)
    assert amax[1, 1].tolist() == [3.0, 100.0, 3.0] and amax[0].abs().sum() == 0
    assert kvq.scale is scale and kvq.inv is inv  # in place: CUDA graphs keep their pointers
    assert kvq.scale[1, 1].tolist() == [2.0**-6, 0.5, 2.0**-6] and kvq.scale[0].eq(1).all()
    assert torch.equal(kvq.inv * kvq.scale, torch.ones_like(scale))


def _scales(hkv, seed=3):
    g = torch.Generator().manual_seed(seed)
    s = torch.ldexp(torch.ones(2, hkv), torch.randint(-3, 2, (2, hkv), generator=g))
    return s.to(DEV), (1.0 / s).to(DEV)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_store_kvcache_writes_quantized_bytes(backend):
    T, hkv, dh, page = 9, 2, 16, 16
    g = torch.Generator().manual_seed(4)
    k, v = (torch.randn(T, hkv, dh, generator=g).mul(3).to(torch.bfloat16).to(DEV) for _ in range(2))
    slots = torch.tensor([5, -1, 17, 40, 3, -1, 63, 20, 0], device=DEV)
    kc0 = torch.randint(0, 120, (4, page, hkv, dh), generator=g, dtype=torch.uint8).view(FP8_DTYPE).to(DEV)
    kc, vc = kc0.clone(), kc0.clone()
    kv_scale = _scales(hkv)
    with use_backend(backend):
        store_kvcache(k, v, kc, vc, slots, kv_scale)
        with pytest.raises(ValueError, match="fp8 KV cache needs kv_scale"):
            store_kvcache(k, v, kc, vc, slots)
    keep = slots >= 0
    for cache, x, row in ((kc, k, 0), (vc, v, 1)):
        flat = cache.view(-1, hkv, dh).view(torch.uint8)
        want = quantize_kv_ref(x[keep], kv_scale[1][row]).view(torch.uint8)
        assert torch.equal(flat[slots[keep]], want)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEV)
        untouched[slots[keep]] = False
        assert torch.equal(flat[untouched], kc0.view(-1, hkv, dh).view(torch.uint8)[untouched])


def test_fused_norm_rope_store_writes_the_unfused_bytes():
    """The engine's fused q/k norm + RoPE + KV store quantizes the k the trainer computes (rounded
    to the model dtype first), so the cache holds quantize(k) of the unfused ops."""
    T, hq, hkv, dh, page = 7, 4, 2, 16, 16
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(T, h, dh, generator=g).to(torch.bfloat16).to(DEV) for h in (hq, hkv, hkv))
    wq, wk = (torch.rand(dh, generator=g).add(0.5).to(torch.bfloat16).to(DEV) for _ in range(2))
    pos = torch.tensor([0, 3, 9, 70, 1, 2, 200], device=DEV)
    inv_freq = rope_inv_freq(dh, 10000.0).to(DEV)
    slots = torch.tensor([0, 1, 2, -1, 30, 31, 16], device=DEV)
    kv_scale = _scales(hkv, seed=6)
    caches = {}
    for backend in ("torch", "triton"):
        kc = torch.zeros(2, page, hkv, dh, dtype=FP8_DTYPE, device=DEV)
        vc = torch.zeros_like(kc)
        with use_backend(backend):
            q_out, _ = qk_norm_rope(q, k, pos, inv_freq, wq, wk, 1e-6, v=v, kv_cache=(kc, vc), slot_mapping=slots,
                                    kv_scale=kv_scale)
            _, k_rot = qk_norm_rope(q, k, pos, inv_freq, wq, wk, 1e-6)
        caches[backend] = (kc.view(torch.uint8), vc.view(torch.uint8))
        keep = slots >= 0
        want_k = quantize_kv_ref(k_rot[keep], kv_scale[1][0]).view(torch.uint8)
        assert torch.equal(kc.view(-1, hkv, dh).view(torch.uint8)[slots[keep]], want_k), backend
    assert all(torch.equal(a, b) for a, b in zip(caches["torch"], caches["triton"]))


def _fp8_case(q_lens, kv_lens, page, hq, hkv, dh, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in kv_lens]
    width = max(need) + 1
    n_blocks = sum(need) + 2
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(perm[used:used + n] + [0] * (width - n))
        used += n
    kv_scale = _scales(hkv, seed)
    kc = quantize_kv_ref(torch.randn(n_blocks * page, hkv, dh, generator=g).mul(4).to(DEV), kv_scale[1][0])
    vc = quantize_kv_ref(torch.randn(n_blocks * page, hkv, dh, generator=g).mul(4).to(DEV), kv_scale[1][1])
    q = torch.randn(sum(q_lens), hq, dh, generator=g).to(dtype).to(DEV)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32).to(DEV)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    return (q, kc.view(n_blocks, page, hkv, dh), vc.view(n_blocks, page, hkv, dh), cu, i32(kv_lens), i32(tables),
            kv_scale)


@pytest.mark.parametrize("q_lens,kv_lens,dtype", [([1, 1, 1, 1], [1, 70, 131, 0], torch.float32),
                                                   ([5, 1, 17], [5, 100, 67], torch.bfloat16)])
def test_paged_attention_over_fp8_vs_gold(q_lens, kv_lens, dtype):
    """Decode (a padding row included) and prefill after cached prefixes: the Triton kernel
    (split and unsplit) and the reference against float64 attention over the dequantized K/V."""
    q, kc, vc, cu, sl, bt, kv_scale = _fp8_case(q_lens, kv_lens, 16, 4, 2, 16, dtype)
    s = kv_scale[0]
    deq = [dequantize_kv(c.view(-1, *c.shape[2:]), s[i], torch.float64).view(c.shape) for i, c in enumerate((kc, vc))]
    gold = paged_attention_ref(q.double(), *deq, cu, sl, bt, max(q_lens))
    ref = paged_attention_ref(q, kc, vc, cu, sl, bt, max(q_lens), kv_scale=kv_scale)
    tol = 4 * (ref.double() - gold).abs().max().item() + 4 * U[dtype] * gold.abs().max().item()
    for splits in ((1, 3) if max(q_lens) == 1 else (1,)):  # decode: unsplit and split-KV + combine
        out = paged_attention_triton(q, kc, vc, cu, sl, bt, max(q_lens), num_splits=splits, kv_scale=kv_scale)
        assert (out.double() - gold).abs().max().item() <= tol, splits
    with pytest.raises(ValueError, match="fp8 KV cache needs kv_scale"):
        paged_attention_triton(q, kc, vc, cu, sl, bt, max(q_lens))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_exact_paged_over_fp8_equals_varlen_over_fake_quant_bitwise(backend):
    """The contract exact numerics rests on: the engine's paged attention over the fp8 cache
    (store, then decode and chunked prefill) gives every row the bits of the trainer's varlen
    attention over K/V fake-quantized with the same scales."""
    L, hq, hkv, dh, page, dtype = 131, 4, 2, 16, 16, torch.bfloat16  # 3 KV tiles of 64
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(L, h, dh, generator=g).mul(2).to(dtype).to(DEV) for h in (hq, hkv, hkv))
    kv_scale = _scales(hkv, seed=9)
    n_pages = -(-L // page)
    table = torch.randperm(n_pages + 2, generator=g)[:n_pages].to(torch.int32).to(DEV)
    slots = table.long()[torch.arange(L, device=DEV) // page] * page + torch.arange(L, device=DEV) % page
    kc = torch.zeros(n_pages + 2, page, hkv, dh, dtype=FP8_DTYPE, device=DEV)
    vc = torch.zeros_like(kc)
    s, inv = kv_scale
    with use_backend(backend), use_numerics("exact"):
        store_kvcache(k, v, kc, vc, slots, kv_scale)
        packed = varlen_attention(q, fake_quant_kv(k, s[0], inv[0]), fake_quant_kv(v, s[1], inv[1]),
                                  torch.tensor([0, L], dtype=torch.int32, device=DEV), L)
        for q_len, end in ((1, L), (7, 100), (64, L)):  # decode; chunks of 7 and of a whole query tile
            out = paged_attention(q[end - q_len:end], kc, vc, torch.tensor([0, q_len], dtype=torch.int32, device=DEV),
                                  torch.tensor([end], dtype=torch.int32, device=DEV), table[None], q_len,
                                  kv_scale=kv_scale)
            assert torch.equal(out, packed[end - q_len:end]), (q_len, end)
    # the fp8 values differ from K/V (the comparison can fail; tests/test_engine_kv_fp8.py shows the log-probs move)
    assert not torch.equal(fake_quant_kv(k, s[0], inv[0]), k) and not torch.equal(fake_quant_kv(v, s[1], inv[1]), v)


def test_exact_shared_prefix_decode_over_fp8_is_bitwise():
    """Shared-prefix decode (a group's prompt read once per step) over an fp8 cache keeps the
    unshared decode's bits (the prefix program dequantizes the same tiles the same way)."""
    hq, hkv, dh, page, dtype = 4, 2, 16, 16, torch.bfloat16
    g = torch.Generator().manual_seed(10)
    prompt, outs = 150, [1, 40, 5]
    n_full = prompt // page
    tables, nxt = [], n_full
    for o in outs:  # one group of 3 sharing the prompt's full blocks 0..n_full-1
        own = -(-(prompt + o) // page) - n_full
        tables.append(list(range(n_full)) + list(range(nxt, nxt + own)))
        nxt += own
    width = max(map(len, tables)) + 1
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV)
    kv_scale = _scales(hkv, seed=11)
    kc = quantize_kv_ref(torch.randn(nxt * page, hkv, dh, generator=g).to(DEV), kv_scale[1][0]).view(nxt, page, hkv, dh)
    vc = quantize_kv_ref(torch.randn(nxt * page, hkv, dh, generator=g).to(DEV), kv_scale[1][1]).view(nxt, page, hkv, dh)
    q = torch.randn(3, hq, dh, generator=g).to(dtype).to(DEV)
    cu = torch.arange(4, dtype=torch.int32, device=DEV)
    sl = torch.tensor([prompt + o for o in outs], dtype=torch.int32, device=DEV)
    members = shared_prefix_members(hq, hkv, exact=True, itemsize=q.element_size())
    share_len, perm, first, count, n = plan_shared_prefix([tuple(range(n_full))] * 3, page, members, 2)
    assert n == 1
    plan = SharedPrefixDecode(*(torch.from_numpy(a).to(DEV) for a in (share_len, perm, first, count)),
                              max_members=members)
    plain = paged_attention_triton(q, kc, vc, cu, sl, bt, 1, exact=True, kv_scale=kv_scale)
    shared = paged_attention_triton(q, kc, vc, cu, sl, bt, 1, exact=True, shared=plan, kv_scale=kv_scale)
    assert torch.equal(plain, shared)
