"""FP8 KV cache on the GPU: the compiled kernels against their references, and exact numerics
with an fp8 cache at realistic shapes (rollout log-probs == trainer log-probs, bitwise).

  * quantization: the Triton store's rounding (`triton_fp8.to_e4m3`, then the hardware cast)
    equals torch's cast bit for bit over 4M values of every magnitude;
  * the fused q/k norm + RoPE + fp8 store writes quantize(the trainer's k) and quantize(v);
  * paged attention over fp8 (decode, prefill; head dims 64 / 128 / 256, GQA 1-8) equals
    the packed varlen forward over fake-quantized K/V bitwise in exact numerics, and is
    close to float64 gold of the dequantized values in fast numerics (split decode too);
  * models: `run_setting` with `kv_cache_dtype: fp8_e4m3` (CUDA graphs, look-ahead,
    ragged batches, chunked prefill + preemption, shared-prefix decode) reads 100% bitwise.
Run: python -m pytest -m gpu tests/test_gpu_kv_fp8.py
"""

import pytest
import torch

from rlfuse.consistency.check import Setting, run_setting
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.attention import paged_attention, paged_attention_ref, varlen_attention
from rlfuse.kernels.kv_quant import FP8_DTYPE, dequantize_kv, fake_quant_kv, quantize_kv, quantize_kv_ref
from rlfuse.kernels.rope import qk_norm_rope, rope_cos_sin, rope_inv_freq
from rlfuse.model import CausalLM, ModelConfig

pytestmark = pytest.mark.gpu
DEV = "cuda"
FP8 = dict(kv_cache_dtype="fp8_e4m3")


def _scales(hkv, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.ldexp(torch.ones(2, hkv), torch.randint(-4, 3, (2, hkv), generator=g))
    return s.to(DEV), (1.0 / s).to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_triton_quantization_equals_torch_cast(dtype):
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(16384, 4, 64, device=DEV, generator=g) * torch.exp(4 * torch.randn(16384, 4, 64, device=DEV,
                                                                                        generator=g))
    x = x.clamp(-6e4, 6e4).to(dtype)
    inv = torch.tensor([1.0, 0.125, 4.0, 2.0**-6], device=DEV)
    with use_backend("triton"):
        q = quantize_kv(x, inv)
    assert torch.equal(q.view(torch.uint8), quantize_kv_ref(x, inv).view(torch.uint8))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fused_store_writes_the_trainers_quantized_k_and_v(head_dim):
    T, hq, hkv, dtype = 4096, 8, 2, torch.bfloat16
    g = torch.Generator(device=DEV).manual_seed(head_dim)
    q, k, v = ((3 * torch.randn(T, h, head_dim, device=DEV, generator=g)).to(dtype) for h in (hq, hkv, hkv))
    qw, kw = ((1 + 0.3 * torch.randn(head_dim, device=DEV, generator=g)).to(dtype) for _ in range(2))
    pos = torch.randint(0, 4000, (T,), device=DEV, generator=g)
    inv_freq = rope_inv_freq(head_dim, 1e6).to(DEV)
    kc = torch.zeros((T // 16, 16, hkv, head_dim), device=DEV, dtype=FP8_DTYPE)
    vc = kc.clone()
    s = _scales(hkv, head_dim)
    with use_backend("triton"), use_numerics("exact"):
        cs = rope_cos_sin(pos, inv_freq)
        qk_norm_rope(q, k, pos, inv_freq, qw, kw, 1e-6, v=v, kv_cache=(kc, vc), slot_mapping=torch.arange(T, device=DEV),
                     cos_sin=cs, kv_scale=s)
        with torch.enable_grad():
            _, k_tr = qk_norm_rope(q.clone().requires_grad_(), k.clone().requires_grad_(), pos, inv_freq, qw, kw,
                                   1e-6, cos_sin=cs)
    assert torch.equal(kc.view(T, hkv, head_dim).view(torch.uint8), quantize_kv_ref(k_tr.detach(), s[1][0]).view(torch.uint8))
    assert torch.equal(vc.view(T, hkv, head_dim).view(torch.uint8), quantize_kv_ref(v, s[1][1]).view(torch.uint8))


def _paged_fp8(lens, k, v, kv_scale, page=16):
    """Quantize packed K/V into a shuffled fp8 paged cache; returns it and the block tables."""
    nblk = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(nblk) + 3, generator=torch.Generator().manual_seed(len(lens)))
    kc = torch.zeros((perm.numel(), page, *k.shape[1:]), device=DEV, dtype=FP8_DTYPE)
    vc = kc.clone()
    tables = torch.zeros((len(lens), max(nblk)), dtype=torch.int32)
    kq, vq = quantize_kv_ref(k, kv_scale[1][0]), quantize_kv_ref(v, kv_scale[1][1])
    off = used = 0
    for b, n in enumerate(lens):
        blocks = perm[used:used + nblk[b]]
        used += nblk[b]
        tables[b, :nblk[b]] = blocks.to(torch.int32)
        i = torch.arange(n)
        kc[blocks[i // page].to(DEV), (i % page).to(DEV)] = kq[off:off + n]
        vc[blocks[i // page].to(DEV), (i % page).to(DEV)] = vq[off:off + n]
        off += n
    return kc, vc, tables.to(DEV)


@pytest.mark.parametrize("head_dim,group", [(128, 1), (128, 2), (128, 4), (128, 8), (64, 2), (256, 4)])
def test_exact_paged_over_fp8_equals_varlen_over_fake_quant(head_dim, group):
    for B in (1, 64, 256):
        g = torch.Generator().manual_seed(head_dim * 100 + group * 10 + B)
        lens = torch.randint(1, 1200 if B == 1 else 300, (B,), generator=g).tolist()
        T, hkv, dtype = sum(lens), 2, torch.bfloat16
        q = torch.randn(T, hkv * group, head_dim, generator=g).to(device=DEV, dtype=dtype)
        k = (2 * torch.randn(T, hkv, head_dim, generator=g)).to(device=DEV, dtype=dtype)
        v = torch.randn(T, hkv, head_dim, generator=g).to(device=DEV, dtype=dtype)
        s = _scales(hkv, B)
        kc, vc, tables = _paged_fp8(lens, k, v, s)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        last = (cu[1:] - 1).long()
        with use_backend("triton"), use_numerics("exact"):
            packed = varlen_attention(q, fake_quant_kv(k, s[0][0], s[1][0]), fake_quant_kv(v, s[0][1], s[1][1]), cu,
                                      max(lens))
            dec = paged_attention(q[last].contiguous(), kc, vc, torch.arange(B + 1, dtype=torch.int32, device=DEV),
                                  seq_lens, tables, 1, kv_scale=s)
            pre = paged_attention(q, kc, vc, cu, seq_lens, tables, max(lens), kv_scale=s)
        assert torch.equal(dec, packed[last]), (group, B)
        assert torch.equal(pre, packed), (group, B)


@pytest.mark.parametrize("B", [1, 8, 256])
def test_fast_paged_over_fp8_vs_gold(B):
    g = torch.Generator().manual_seed(B)
    lens = torch.randint(1, 2000, (B,), generator=g).tolist()
    T, hq, hkv, dh, dtype = sum(lens), 16, 8, 128, torch.bfloat16
    q = torch.randn(T, hq, dh, generator=g).to(device=DEV, dtype=dtype)
    k, v = (torch.randn(T, hkv, dh, generator=g).to(device=DEV, dtype=dtype) for _ in range(2))
    s = _scales(hkv, 7)
    kc, vc, tables = _paged_fp8(lens, k, v, s)
    cu1 = torch.arange(B + 1, dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    last = (torch.tensor(lens).cumsum(0) - 1).to(DEV)
    qd = q[last].contiguous()
    deq = [dequantize_kv(c.view(-1, hkv, dh), s[0][i], torch.float64).view(c.shape) for i, c in enumerate((kc, vc))]
    gold = paged_attention_ref(qd.double(), *deq, cu1, seq_lens, tables, 1)
    ref = paged_attention_ref(qd, kc, vc, cu1, seq_lens, tables, 1, kv_scale=s)
    with use_backend("triton"):
        out = paged_attention(qd, kc, vc, cu1, seq_lens, tables, 1, kv_scale=s)  # split-KV at small B
    tol = 4 * (ref.double() - gold).abs().max().item() + 4 * 2.0**-8 * gold.abs().max().item()
    assert (out.double() - gold).abs().max().item() <= tol


def _model(head_dim, group, seed=0):
    cfg = ModelConfig(model_type="qwen3", vocab_size=4096, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=4, num_attention_heads=2 * group, num_key_value_heads=2, head_dim=head_dim,
                      qk_norm=True, tie_word_embeddings=True, max_position_embeddings=2048)
    m = CausalLM(cfg)
    m.init_weights(std=0.05, generator=torch.Generator().manual_seed(seed))
    return m.to(device=DEV, dtype=torch.bfloat16)


@pytest.mark.parametrize("head_dim,group", [(128, 2), (16, 2), (64, 8)])
def test_exact_fp8_rollout_equals_trainer(head_dim, group):
    model = _model(head_dim, group)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 4096, (int(n),), generator=g).tolist() for n in torch.randint(8, 200, (64,), generator=g)]
    pool = 64 * -(-(200 + 64) // 16) // 4
    settings = [
        Setting(name="fp8 batch 64 n=4 ragged", num_prompts=16, n=4, ragged=True, engine=dict(FP8)),
        Setting(name="fp8 batch 256 n=4", num_prompts=64, n=4, engine=dict(FP8)),
        Setting(name="fp8 chunked + preemption", num_prompts=16, n=4,
                engine=dict(FP8, max_num_batched_tokens=128, num_kv_blocks=pool)),
        Setting(name="fp8 long shared prompts", num_prompts=16, n=4, min_prompt_len=300,
                engine=dict(FP8, share_prefix_decode=True)),
    ]
    for s in settings:
        r = run_setting(model, prompts, s, numerics="exact", max_tokens=64, temperature=1.0)
        print(s.name, r.row())
        assert r.bitwise_frac == 1.0, (s.name, r.row(), r.first_diff)
        assert r.engine_stats["kv_calibrations"] == 1
        if s.min_prompt_len:
            assert r.engine_stats["shared_prefix_steps"] > 0
        if "preemption" in s.name:
            assert r.engine_stats["preemptions"] > 0
