"""lora_linear with fused-projection parts and adapter banks (several adapters in one batch):
the kernels against the float64 gold, the bitwise promises (batch invariance, a mixed batch
equals each adapter alone, rows without an adapter equal the base linear, one adapter in a
bank equals the same adapter alone), every launch plan, the fast in-place kernel.
Run: python -m pytest -q tests/test_lora_bank.py   (GPU: -m gpu)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import random_prompts, tiny_model
from tiny_hf import rel_err

from rlfuse.engine import LLM, EngineConfig, SamplingParams
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.linear import linear, linear_exact, lora_linear, lora_linear_ref
from rlfuse.model import Packed
from rlfuse.model.lora import LoRAConfig, attach_lora, init_lora_
from rlfuse.model.lora_bank import load_adapter_bank
from rlfuse.model.lora_peft import load_peft_adapter, save_peft_adapter

GOLD_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SIZES = (24, 8, 8)  # q, k, v of a tiny GQA attention
GDN_SIZES = (24, 8, 3, 3)  # a Gated DeltaNet's qkv, z, b, a (four parts, two of a few columns)


def _bank(dtype, n=3, M=29, K=48, sizes=SIZES, r=4, seed=0, bias=True, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s, a=0.1: (a * torch.randn(*s, generator=g)).to(dtype).to(device)  # noqa: E731
    N = sum(sizes)
    x, w, b = t(M, K, a=1.0), t(N, K), (t(N) if bias else None)
    A, B = t(n, len(sizes) * r, K, a=0.3), t(n, N, r, a=0.3)
    scale = torch.tensor([2.0, 0.5, 1.25, 3.0][:n], dtype=torch.float32, device=device)
    adapter = torch.randint(-1, n, (M,), generator=g).to(device)
    return x, w, b, A, B, scale, adapter


def _gold(x, w, b, A, B, scale, adapter, sizes):
    """float64, z rounded to x.dtype as the op rounds it."""
    y0 = x.double() @ w.double().T + (0 if b is None else b.double())
    out = y0.clone()
    r = B.shape[2]
    for m in range(x.shape[0]):
        a = int(adapter[m])
        if a < 0:
            continue
        z = (x[m].double() @ A[a].double().T).to(x.dtype).double()
        lo = 0
        for p, n in enumerate(sizes):
            out[m, lo:lo + n] += float(scale[a]) * (z[p * r:(p + 1) * r] @ B[a, lo:lo + n].double().T)
            lo += n
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_bank_mixed_batch_equals_each_adapter_alone(backend, dtype):
    x, w, b, A, B, s, ad = _bank(dtype)
    with use_backend(backend), use_numerics("exact"):
        mixed = lora_linear(x, w, b, A, B, s, sizes=SIZES, adapter=ad)
        for a in range(A.shape[0]):
            rows = ad == a
            alone = lora_linear(x[rows], w, b, A, B, s, sizes=SIZES, adapter=ad[rows])
            assert torch.equal(mixed[rows], alone), a
            # the same adapter outside a bank (float scale, 2-D A and B): the same bits
            single = lora_linear(x[rows], w, b, A[a], B[a], float(s[a]), sizes=SIZES)
            assert torch.equal(single, alone), a
        none = ad < 0
        assert torch.equal(mixed[none], linear(x[none], w, b))  # no adapter: the base model's bits
        for k in (1, 7, 17):  # batch-invariant: leading rows, rows moved within a tile
            assert torch.equal(lora_linear(x[:k], w, b, A, B, s, sizes=SIZES, adapter=ad[:k]), mixed[:k])
            assert torch.equal(lora_linear(x[k:], w, b, A, B, s, sizes=SIZES, adapter=ad[k:]), mixed[k:])
    if backend == "torch":
        assert torch.equal(mixed, lora_linear_ref(x, w, b, A, B, s, sizes=SIZES, adapter=ad))
    assert rel_err(mixed, _gold(x, w, b, A, B, s, ad, SIZES)) < GOLD_TOL[dtype]


@pytest.mark.parametrize("sizes", [SIZES, GDN_SIZES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_parts_equal_the_separate_projections_under_torch(dtype, sizes):
    """A fused q/k/v (or qkv/z/b/a) LoRA: each part's columns are the separate projection's
    bits (torch backend; the Triton path rounds once per element either way)."""
    x, w, b, A, B, s, _ = _bank(dtype, n=1, seed=3, sizes=sizes)
    r = B.shape[2]
    with use_backend("torch"), use_numerics("exact"):
        fused = lora_linear(x, w, b, A[0], B[0], 1.5, sizes=sizes)
        lo = 0
        for p, n in enumerate(sizes):
            sep = lora_linear(x, w[lo:lo + n], b[lo:lo + n], A[0, p * r:(p + 1) * r], B[0, lo:lo + n], 1.5)
            assert torch.equal(fused[:, lo:lo + n], sep), p
            lo += n


@pytest.mark.parametrize("dtype,sizes", [(torch.float32, SIZES), (torch.bfloat16, SIZES),
                                         (torch.bfloat16, GDN_SIZES)])
def test_triton_lora_plans_agree_bitwise_with_parts_and_bank(dtype, sizes):
    """fused, split and split_last: the same bits, K over several chunks with a ragged tail;
    each part's columns equal that part alone (4 parts: a Gated DeltaNet's in_proj group)."""
    from rlfuse.kernels.linear.triton_lora import lora_expand_triton
    x, w, b, A, B, s, ad = _bank(dtype, n=2, M=37, K=300, seed=5, sizes=sizes)
    z = (x.float() @ A.reshape(-1, A.shape[-1]).float().T).to(dtype)
    tiles = dict(CHUNK_K=128)  # 3 chunks
    ys = {plan: lora_expand_triton(x, w, b, z, B, s, sizes=sizes, adapter=ad, plan=plan, tiles=tiles)
          for plan in ("fused", "split", "split_last")}
    assert torch.equal(ys["split"], ys["fused"]) and torch.equal(ys["split_last"], ys["fused"])
    assert rel_err(ys["fused"], _gold(x, w, b, A, B, s, ad, sizes)) < GOLD_TOL[dtype]
    if sizes == GDN_SIZES:
        r, P, lo = B.shape[2], len(sizes), 0
        zp = z.view(z.shape[0], 2, P, r)  # (M, adapters, parts, r)
        for p, n in enumerate(sizes):
            alone = lora_expand_triton(x, w[lo:lo + n], b[lo:lo + n], zp[:, :, p].reshape(z.shape[0], -1),
                                       B[:, lo:lo + n], s, adapter=ad, plan="fused", tiles=tiles)
            assert torch.equal(ys["fused"][:, lo:lo + n], alone), p
            lo += n


@pytest.mark.parametrize("bank", [False, True])
def test_fast_triton_adds_the_expand_in_place(bank):
    x, w, b, A, B, s, ad = _bank(torch.float32, n=2, seed=7)
    args = (A, B, s) if bank else (A[1], B[1], 0.75)
    adapter = ad if bank else None
    with use_backend("triton"), use_numerics("fast"):
        y = lora_linear(x, w, b, *args, sizes=SIZES, adapter=adapter)
    with use_backend("torch"), use_numerics("fast"):
        y_torch = lora_linear(x, w, b, *args, sizes=SIZES, adapter=adapter)
    gold = _gold(x, w, b, A, B, s, ad, SIZES) if bank else \
        _gold(x, w, b, A[1:], B[1:], torch.tensor([0.75]), torch.zeros_like(ad), SIZES)
    assert rel_err(y, gold) < 1e-5 and rel_err(y_torch, gold) < 1e-5


@pytest.mark.parametrize("numerics,backend", [("exact", "triton"), ("exact", "torch"), ("fast", "torch")])
def test_parts_gradients_vs_gold(numerics, backend):
    """The trainer's path through a fused group: gradients of x, A and B (every part) against
    float64; in exact numerics the grad-mode forward has the no-grad forward's bits."""
    x, w, b, A, B, _, _ = _bank(torch.float32, n=1, seed=11)
    xs, a, bb = x.clone().requires_grad_(True), A[0].clone().requires_grad_(True), B[0].clone().requires_grad_(True)
    dy = torch.randn(x.shape[0], w.shape[0], generator=torch.Generator().manual_seed(12))
    with use_backend(backend), use_numerics(numerics):
        y = lora_linear(xs, w, b, a, bb, 1.5, sizes=SIZES)
        with torch.no_grad():
            y_ng = lora_linear(x, w, b, A[0], B[0], 1.5, sizes=SIZES)
    (y * dy).sum().backward()
    if numerics == "exact":
        assert torch.equal(y.detach(), y_ng)
    x64, a64, b64 = (t.detach().double().requires_grad_(True) for t in (x, A[0], B[0]))
    z = x64 @ a64.T
    r, lo, cols = B.shape[2], 0, []
    for p, n in enumerate(SIZES):
        cols.append(z[:, p * r:(p + 1) * r] @ b64[lo:lo + n].T)
        lo += n
    y64 = x64 @ w.double().T + b.double() + 1.5 * torch.cat(cols, 1)
    (y64 * dy.double()).sum().backward()
    assert rel_err(y.detach(), y64.detach()) < 1e-5
    for g, g64 in ((xs.grad, x64.grad), (a.grad, a64.grad), (bb.grad, b64.grad)):
        assert rel_err(g, g64) < 1e-5


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bias", [True, False])
def test_fast_joined_buffer_runs_base_and_shrink_as_one_gemm(backend, bias):
    """W and A as rows of one buffer (the bias beside zeros): the same y as the separate
    GEMMs up to fp32 rounding, the output a view of the joined GEMM's base columns."""
    x, w, b, A, B, _, _ = _bank(torch.float32, n=1, seed=9, bias=bias)
    N = w.shape[0]
    wa = torch.cat([w, A[0]])
    ba = torch.cat([b, b.new_zeros(A.shape[1])]) if bias else None
    w, a = wa[:N], wa[N:]
    with use_backend(backend), use_numerics("fast"), torch.no_grad():
        y = lora_linear(x, w, None if ba is None else ba[:N], a, B[0], 0.75, sizes=SIZES, joined=(wa, ba))
        ref = lora_linear(x, w.clone(), None if ba is None else ba[:N].clone(), a.clone(), B[0], 0.75, sizes=SIZES)
    if backend == "triton":
        assert y.stride(0) == N + A.shape[1]  # added in place to the base columns of [base | z]
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    gold = _gold(x, w, None if ba is None else ba[:N], A, B, torch.tensor([0.75]), torch.zeros(x.shape[0]), SIZES)
    assert rel_err(y, gold) < 1e-5


def test_bank_inputs_are_checked():
    x, w, b, A, B, s, ad = _bank(torch.float32)
    with pytest.raises(ValueError, match="fp32 tensor"):
        lora_linear(x, w, b, A, B, 2.0, sizes=SIZES, adapter=ad)
    with pytest.raises(ValueError, match="one per row"):
        lora_linear(x, w, b, A, B, s, sizes=SIZES, adapter=ad[:-1])
    with pytest.raises(ValueError, match="parts summing"):
        lora_linear(x, w, b, A, B, s, sizes=(24, 8, 9), adapter=ad)
    with pytest.raises(ValueError, match="for inference"), use_backend("triton"), use_numerics("exact"):
        lora_linear(x.requires_grad_(True), w, b, A, B, s, sizes=SIZES, adapter=ad)


# ------------------------------------------------------------------ the model and the engine
def _adapter_folders(tmp_path, ranks=(4, 4)) -> dict:
    """Two PEFT folders for tiny_model, different A, B and alpha."""
    folders = {}
    for i, (name, r) in enumerate(zip(("math", "code"), ranks)):
        m = tiny_model()
        attach_lora(m, LoRAConfig(rank=r, alpha=4.0 * (i + 1)))
        init_lora_(m, seed=10 + i, b_std=0.3)
        save_peft_adapter(m, tmp_path / name)
        folders[name] = tmp_path / name
    return folders


def test_engine_mixed_adapter_batch_equals_each_adapter_alone(tmp_path):
    """One exact engine over a bank of two adapters: the base, `math` and `code` requests
    for the same prompts in one batch (the prefix cache keeps their K/V apart) give the
    tokens and log-probs bitwise of an engine over the base model, or over a model holding
    that one adapter alone. The bank engine fuses its projections (q/k/v and gate/up with
    the bank's parts side by side; o and down alone), the others do not."""
    folders = _adapter_folders(tmp_path)
    bank_model = tiny_model()
    slots = load_adapter_bank(bank_model, folders)
    assert slots.names == ("math", "code")
    prompts = random_prompts([12, 20, 7, 16])
    cfg = EngineConfig(max_num_seqs=16, numerics="exact", seed=0)

    def params(slot):
        return SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True, adapter=slot)

    def rows(outs):
        return [(list(o.output_token_ids), o.logprobs.tolist()) for o in outs]

    with use_backend("torch"):
        llm = LLM(bank_model, config=dataclasses.replace(cfg, fuse_projections=True))
        mixed = rows(llm.generate(prompts * 3, [params(None)] * 4 + [params(0)] * 4 + [params(1)] * 4))
        attn0 = bank_model.model.layers[0].self_attn
        assert attn0.qkv_fused.adapted and attn0.qkv_fused.live(attn0)
        for k, name in enumerate((None, "math", "code")):
            m = tiny_model()
            if name is not None:
                load_peft_adapter(m, folders[name])
            alone = rows(LLM(m, config=cfg).generate(prompts, params(None)))
            assert mixed[8 * k:8 * (k + 1)] == alone, name
        assert mixed[:8] != mixed[8:16] != mixed[16:]  # the adapters change the samples
        with pytest.raises(ValueError, match="bank has 2 slots"):
            llm.generate(prompts[:1], params(2))


def test_bank_errors_name_the_adapter(tmp_path):
    folders = _adapter_folders(tmp_path, ranks=(4, 8))
    with pytest.raises(ValueError, match="must share rank and targets"):
        load_adapter_bank(tiny_model(), folders)
    m = tiny_model()
    load_adapter_bank(m, {"math": folders["math"]})
    with pytest.raises(ValueError, match="each row's adapter"):
        m(torch.tensor([1, 2]), torch.tensor([0, 1]), Packed.from_lengths([2]))
    with pytest.raises(ValueError, match="no bank"):
        LLM(tiny_model(), config=EngineConfig(max_num_seqs=2)).generate([[1, 2]], SamplingParams(adapter=0))


# ------------------------------------------------------------------ GPU (the lead runs these on an H100)
@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 64, 200, 1000])
def test_gpu_exact_bank_bitwise_and_gold(M):
    """Decode- and prefill-sized M at the Qwen3-0.6B q/k/v shape, bf16, rank 16, 3 adapters:
    every plan the same bits, each adapter alone equal to the mixed batch, no-adapter rows
    equal to the base linear, close to the float64 gold."""
    from rlfuse.kernels.linear.triton_lora import lora_expand_triton
    sizes = (2048, 1024, 1024)
    x, w, b, A, B, s, ad = _bank(torch.bfloat16, n=3, M=M, K=1024, sizes=sizes, r=16, bias=False, device="cuda")
    with use_backend("triton"), use_numerics("exact"):
        mixed = lora_linear(x, w, b, A, B, s, sizes=sizes, adapter=ad)
        for a in range(3):
            rows = ad == a
            if rows.any():
                assert torch.equal(lora_linear(x[rows], w, b, A, B, s, sizes=sizes, adapter=ad[rows]), mixed[rows])
                assert torch.equal(lora_linear(x[rows], w, b, A[a], B[a], float(s[a]), sizes=sizes), mixed[rows])
        if (ad < 0).any():
            assert torch.equal(mixed[ad < 0], linear(x[ad < 0], w, b))
        z = linear_exact(x, A.reshape(-1, 1024))
        for plan in ("fused", "split", "split_last"):
            assert torch.equal(lora_expand_triton(x, w, b, z, B, s, sizes=sizes, adapter=ad, plan=plan), mixed), plan
    assert rel_err(mixed.cpu(), _gold(x.cpu(), w.cpu(), b, A.cpu(), B.cpu(), s.cpu(), ad.cpu(), sizes)) < 2e-2


@pytest.mark.gpu
def test_gpu_fast_lora_add_vs_gold():
    sizes = (2048, 1024, 1024)
    x, w, b, A, B, s, ad = _bank(torch.bfloat16, n=2, M=96, K=1024, sizes=sizes, r=16, device="cuda")
    with use_backend("triton"), use_numerics("fast"):
        y = lora_linear(x, w, b, A, B, s, sizes=sizes, adapter=ad)
    assert rel_err(y.cpu(), _gold(x.cpu(), w.cpu(), b.cpu(), A.cpu(), B.cpu(), s.cpu(), ad.cpu(), sizes)) < 2e-2


@pytest.mark.gpu
def test_gpu_exact_rollout_equals_trainer_with_fused_lora():
    """A CUDA engine fuses q/k/v and gate/up with their adapters and captures decode graphs:
    rollout log-probs equal the trainer's bitwise in every setting of `rlfuse check`'s sweep."""
    from rlfuse.consistency.check import default_sweep, run_setting
    model = tiny_model(dtype=torch.bfloat16, device="cuda")
    attach_lora(model, LoRAConfig(rank=8))
    init_lora_(model, seed=1, b_std=0.2)
    prompts = random_prompts([14, 30, 33, 7, 40, 3, 18, 9])
    for s in default_sweep(8, small_pool_blocks=8, chunk_tokens=16):
        r = run_setting(model, prompts, s, numerics="exact", max_tokens=16, temperature=1.0)
        assert r.bitwise_frac == 1.0, (s.name, r.row(), r.first_diff)
    assert model.model.layers[0].self_attn.qkv_fused.adapted


@pytest.mark.gpu
@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_gpu_engine_bank_mixed_batch(tmp_path, numerics):
    """CUDA graphs and fused groups over a bank: exact, a mixed batch equals each adapter
    served alone bitwise; fast, the greedy tokens mostly agree (bf16 GEMMs pick algorithms by shape)."""
    folders = {}
    for i, name in enumerate(("math", "code")):
        m = tiny_model(dtype=torch.bfloat16, device="cuda")
        attach_lora(m, LoRAConfig(rank=16, alpha=16.0 * (i + 1)))
        init_lora_(m, seed=10 + i, b_std=0.2)
        save_peft_adapter(m, tmp_path / name)
        folders[name] = tmp_path / name
    bank_model = tiny_model(dtype=torch.bfloat16, device="cuda")
    load_adapter_bank(bank_model, folders)
    prompts = random_prompts([12, 40, 7, 33])
    cfg = EngineConfig(max_num_seqs=32, numerics=numerics, seed=0)
    mk = lambda slot: SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True, adapter=slot)  # noqa: E731
    mixed = LLM(bank_model, config=cfg).generate(prompts * 3, [mk(None)] * 4 + [mk(0)] * 4 + [mk(1)] * 4)
    for k, name in enumerate((None, "math", "code")):
        m = tiny_model(dtype=torch.bfloat16, device="cuda")
        if name is not None:
            load_peft_adapter(m, folders[name])
        alone = LLM(m, config=cfg).generate(prompts, mk(None))
        part = mixed[8 * k:8 * (k + 1)]  # 4 prompts x n=2 samples per adapter, prompt-major
        got = [list(o.output_token_ids) for o in part]
        want = [list(o.output_token_ids) for o in alone]
        if numerics == "exact":
            assert got == want, name
            assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(part, alone)), name
        else:
            same = sum(a[:8] == b[:8] for a, b in zip(got, want))
            assert same >= 6, (name, same)
