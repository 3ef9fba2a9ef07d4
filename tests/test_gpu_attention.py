"""GPU correctness of the attention kernels at real sizes vs float64 gold.

Checks (CUDA, bf16 and fp32, Dh 64 and 128, GQA):
  varlen_attention  forward, lse, dq/dk/dv vs the float64 reference (sequence lengths
                    1 .. 2061, not multiples of any tile); backward run twice bitwise
                    equal; a sequence alone bitwise equal to the same sequence in a pack
  paged_attention   decode (contexts 0 .. 4000, split and unsplit) and prefill chunks
                    after cached prefixes, block sizes 16 and 32, random block tables;
                    CUDA-graph capture of decode replayed on new inputs == eager, bitwise
  store_kvcache     with -1 slots == reference, skipped cache rows untouched
  consistency       varlen over a sequence vs paged prefill of the same tokens
Tolerance: err <= 4 * err(reference in the same dtype) + 4 * u * max|gold| (u the unit
roundoff; see tests/test_kernel_attention.py for the derivation); lse atol = rtol = 1e-5.

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_attention.py
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from gpu_checks import assert_all_pass, fresh_rows
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlfuse.kernels.attention.paged import paged_attention_ref, store_kvcache_ref
from rlfuse.kernels.attention.triton_paged import paged_attention_triton, store_kvcache_triton
from rlfuse.kernels.attention.triton_varlen import varlen_bwd, varlen_fwd
from rlfuse.kernels.attention.varlen import varlen_attention_ref

U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
ROWS: list[dict] = []


pytestmark = pytest.mark.gpu


_fresh_rows = fresh_rows(ROWS)


def record(check: str, dtype, dh, err: float, tol: float, **extra):
    ok = bool(err <= tol)  # NaN fails
    ROWS.append({"check": check, "dtype": str(dtype).replace("torch.", ""), "dh": dh, "err": err, "tol": tol,
                 "ok": ok, **extra})
    ref = f"  (ref err {extra['ref_err']:.3e})" if "ref_err" in extra else ""
    print(f"{'ok  ' if ok else 'FAIL'} {check:46s} {ROWS[-1]['dtype']:8s} dh={dh:<4} err {err:.3e} tol {tol:.3e}{ref}",
          flush=True)


def rel_check(check, dtype, dh, got, gold, ref):
    err = (got.double() - gold).abs().max().item() if torch.isfinite(got).all() else float("nan")
    ref_err = (ref.double() - gold).abs().max().item()
    tol = 4 * ref_err + 4 * U[dtype] * gold.abs().max().item()
    record(check, dtype, dh, err, tol, ref_err=ref_err)


def same_dtype_backend(dtype):
    """fp32 references run SDPA's math backend with TF32 off (the fused fp32 kernels may
    use other paths); 16-bit ones the default (flash) backend."""
    return sdpa_kernel(SDPBackend.MATH) if dtype == torch.float32 else contextlib.nullcontext()


def check_varlen(dtype, dh, hq, hkv):
    lens = [1, 37, 300, 1025, 2061]
    T, Lmax = sum(lens), max(lens)
    g = torch.Generator(device="cuda").manual_seed(dh)
    q, k, v, do = (torch.randn(T, h, dh, device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv, hq))
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
    scale = dh ** -0.5
    xs = [x.double().requires_grad_() for x in (q, k, v)]
    gold_o, gold_lse = varlen_attention_ref(*xs, cu, Lmax, return_lse=True)
    gold_g = torch.autograd.grad(gold_o, xs, do.double())
    rs = [x.clone().requires_grad_() for x in (q, k, v)]
    with same_dtype_backend(dtype):
        ref_o = varlen_attention_ref(*rs, cu, Lmax)
        ref_g = torch.autograd.grad(ref_o, rs, do)
    o, lse = varlen_fwd(q, k, v, cu, Lmax, scale)
    rel_check(f"varlen fwd Hq={hq} Hkv={hkv}", dtype, dh, o, gold_o.detach(), ref_o.detach())
    lse_err = ((lse.double() - gold_lse).abs() - 1e-5 * gold_lse.abs()).max().item()
    record("varlen lse (err - 1e-5|lse|)", dtype, dh, lse_err, 1e-5)
    grads = varlen_bwd(do, q, k, v, o, lse, cu, Lmax, scale)
    for name, got, gold, ref in zip("qkv", grads, gold_g, ref_g):
        rel_check(f"varlen d{name} Hq={hq} Hkv={hkv}", dtype, dh, got, gold, ref)
    again = varlen_bwd(do, q, k, v, o, lse, cu, Lmax, scale)
    record("varlen bwd deterministic (#diff elems)", dtype, dh,
           float(sum((a != b).sum().item() for a, b in zip(grads, again))), 0.0)
    s, e = 338, 1363  # the 1025-token sequence alone
    one = torch.tensor([0, e - s], device="cuda", dtype=torch.int32)
    o1, _ = varlen_fwd(q[s:e], k[s:e], v[s:e], one, e - s, scale)
    record("varlen seq alone == in pack (#diff elems)", dtype, dh, float((o1 != o[s:e]).sum().item()), 0.0)


def paged_case(q_lens, kv_lens, page, hq, hkv, dh, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [(n + page - 1) // page for n in kv_lens]
    width = max(need) + 2
    n_blocks = sum(need) + 5
    perm = torch.randperm(n_blocks, device="cuda", generator=g)
    bt = torch.full((len(kv_lens), width), -1, dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[used:used + n]
        used += n
    kc = torch.randn(n_blocks, page, hkv, dh, device="cuda", generator=g).to(dtype)
    vc = torch.randn(n_blocks, page, hkv, dh, device="cuda", generator=g).to(dtype)
    q = torch.randn(sum(q_lens), hq, dh, device="cuda", generator=g).to(dtype)
    cu = torch.tensor([0, *q_lens], device="cuda").cumsum(0).to(torch.int32)
    return q, kc, vc, cu, torch.tensor(kv_lens, dtype=torch.int32, device="cuda"), bt


def check_paged(dtype, dh, page):
    hq, hkv = 16, 8
    decode = paged_case([1] * 8, [1, 4000, 513, 0, 2048, 17, 1024, 3000], page, hq, hkv, dh, dtype, 1)
    prefill = paged_case([300, 1, 64, 129], [1000, 1, 64, 2000], page, hq, hkv, dh, dtype, 2)
    for name, (q, kc, vc, cu, sl, bt), max_q in (("decode", decode, 1), ("prefill+prefix", prefill, 300)):
        gold = paged_attention_ref(q.double(), kc.double(), vc.double(), cu, sl, bt, max_q)
        with same_dtype_backend(dtype):
            ref = paged_attention_ref(q, kc, vc, cu, sl, bt, max_q)
        for ns in (None, 1, 7):
            out = paged_attention_triton(q, kc, vc, cu, sl, bt, max_q, num_splits=ns)
            rel_check(f"paged {name} page={page} splits={ns}", dtype, dh, out, gold, ref)

    # CUDA graph: capture decode on static buffers, replay on new contents
    q, kc, vc, cu, sl, bt = decode
    s_q, s_sl, s_bt, s_out = q.clone(), sl.clone(), bt.clone(), torch.empty_like(q)
    paged_attention_triton(s_q, kc, vc, cu, s_sl, s_bt, 1, out=s_out)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        paged_attention_triton(s_q, kc, vc, cu, s_sl, s_bt, 1, out=s_out)
    # new contents: rows permuted, some contexts shortened, two rows turned into padding
    perm = torch.randperm(8, device="cuda")
    q2, bt2 = torch.randn_like(q), bt[perm]
    sl2 = sl[perm] // torch.tensor([1, 2, 1, 3, 1, 1, 5, 1], device="cuda", dtype=torch.int32)
    sl2[[1, 6]] = 0
    s_q.copy_(q2), s_sl.copy_(sl2), s_bt.copy_(bt2)
    graph.replay()
    eager = paged_attention_triton(q2, kc, vc, cu, sl2, bt2, 1)
    diff = float((s_out != eager).sum().item()) if torch.isfinite(s_out).all() else float("nan")
    record(f"paged decode CUDA graph == eager page={page} (#diff)", dtype, dh, diff, 0.0)


def check_store_and_consistency(dtype, dh):
    hq, hkv, page, L = 16, 8, 16, 1500
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(L, h, dh, device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv))
    n_pages = (L + page - 1) // page
    kc0 = torch.randn(n_pages + 10, page, hkv, dh, device="cuda", generator=g).to(dtype)
    vc0 = torch.randn_like(kc0)
    table = torch.randperm(n_pages + 10, device="cuda", generator=g)[:n_pages].to(torch.int32)
    pos = torch.arange(L, device="cuda")
    slots = table.long()[pos // page] * page + pos % page
    slots_pad = slots.clone()
    slots_pad[::7] = -1
    kc, vc, kr, vr = kc0.clone(), vc0.clone(), kc0.clone(), vc0.clone()
    store_kvcache_triton(k, v, kc, vc, slots_pad)
    store_kvcache_ref(k, v, kr, vr, slots_pad)
    record("store_kvcache with -1 slots == ref (#diff)", dtype, dh,
           float((kc != kr).sum().item() + (vc != vr).sum().item()), 0.0)
    store_kvcache_triton(k, v, kc, vc, slots)
    cu = torch.tensor([0, L], device="cuda", dtype=torch.int32)
    o_var, _ = varlen_fwd(q, k, v, cu, L, dh ** -0.5)
    o_pag = paged_attention_triton(q, kc, vc, cu, torch.tensor([L], device="cuda", dtype=torch.int32),
                                   table[None], L)
    gold = varlen_attention_ref(q.double(), k.double(), v.double(), cu, L)
    with same_dtype_backend(dtype):
        ref = varlen_attention_ref(q, k, v, cu, L)
    rel_check("paged prefill vs gold (same tokens as varlen)", dtype, dh, o_pag, gold, ref)
    tol = 2 * (4 * (ref.double() - gold).abs().max().item() + 4 * U[dtype] * gold.abs().max().item())  # both sides
    record("|varlen - paged prefill|", dtype, dh, (o_var.double() - o_pag.double()).abs().max().item(), tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("dh", [64, 128])
def test_varlen_paged_and_consistency(dtype, dh):
    check_varlen(dtype, dh, 16, 8)
    check_paged(dtype, dh, 16)
    check_store_and_consistency(dtype, dh)
    assert_all_pass(ROWS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gqa_ratios_and_page_32(dtype):
    check_varlen(dtype, 128, 16, 16)
    check_varlen(dtype, 64, 16, 2)
    check_paged(dtype, 128, 32)
    assert_all_pass(ROWS)
