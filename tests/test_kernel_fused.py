"""The fused decode-path kernels equal the unfused ops they replace, bitwise:
  add_rmsnorm   (h + x, rmsnorm(h + x))          vs the add, then rmsnorm
  qk_norm_rope  q/k norms + RoPE (+ KV store)     vs rmsnorm, rope, store_kvcache
forward and every gradient, fp32 and bf16, both numerics, odd shapes, strided inputs,
batch invariance; and the model whose layers use them equals the unfused layer formula
(h = h + attn(norm(h)); h = h + mlp(norm(h))), values and parameter gradients.
CPU: Triton's interpreter (small shapes) and the torch backend; GPU (marked): Qwen3 sizes.

    python -m pytest -q tests/test_kernel_fused.py
"""

import pytest
import torch
from engine_helpers import tiny_model

from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.norm.rms import add_rmsnorm, rmsnorm
from rlfuse.kernels.rope.rotary import qk_norm_rope, qk_norm_rope_ref, rope_inv_freq
from rlfuse.model import CausalLM, ModelConfig, Packed

DEV = "cuda" if torch.cuda.is_available() else "cpu"
_CASES = [(b, n) for b in ("triton", "torch") for n in ("fast", "exact")]


def _rand(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


def _unfused_add_rmsnorm(h, x, w, eps):
    s = h + x
    return s, rmsnorm(s, w, eps)


def _value_and_grads(fn, leaves, douts):
    outs = fn(*leaves)
    used = [(o, d) for o, d in zip(outs, douts) if d is not None]
    grads = torch.autograd.grad([o for o, _ in used], leaves, [d for _, d in used])
    return [o.detach() for o in outs], grads


@pytest.mark.parametrize("backend,numerics", _CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_is_add_then_rmsnorm(backend, numerics, dtype):
    g = torch.Generator().manual_seed(0)
    T, D = 37, 100  # odd rows, D not a power of two
    h, w = _rand(g, T, D, dtype=dtype, scale=3), (1 + 0.2 * torch.randn(D, generator=g)).to(DEV, dtype)
    x = _rand(g, T, 2 * D, dtype=dtype)[:, ::2]  # strided
    ds, dy = _rand(g, T, D, dtype=dtype), _rand(g, T, D, dtype=dtype)
    with use_backend(backend), use_numerics(numerics):
        with torch.no_grad():
            nograd = add_rmsnorm(h, x, w, 1e-6)
        for douts in ((ds, dy), (None, dy)):  # both outputs used (a layer), y alone (the final norm)
            leaves = [t.clone().requires_grad_() for t in (h, x, w)]
            got = _value_and_grads(lambda a, b, c: add_rmsnorm(a, b, c, 1e-6), leaves, douts)
            want = _value_and_grads(lambda a, b, c: _unfused_add_rmsnorm(a, b, c, 1e-6), leaves, douts)
            for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]]):
                assert torch.equal(a, b)
        for a, b in zip(nograd, want[0]):
            assert torch.equal(a, b)
        full = add_rmsnorm(h, x, w, 1e-6)
        for k in (1, 5, 16):
            for a, b in zip(full, add_rmsnorm(h[:k], x[:k], w, 1e-6)):
                assert torch.equal(a[:k], b)
        with pytest.raises(ValueError, match="one shape and dtype"):
            add_rmsnorm(h, x.float() if dtype != torch.float32 else x.double(), w, 1e-6)


def _qk_inputs(g, T, Hq, Hkv, Dh, dtype):
    # q, k, v as views of one fused projection output (unit stride on Dh only)
    qkv = _rand(g, T, (Hq + 2 * Hkv) * Dh, dtype=dtype, scale=2)
    q, k, v = qkv.split([Hq * Dh, Hkv * Dh, Hkv * Dh], dim=1)
    w = [(1 + 0.3 * torch.randn(Dh, generator=g)).to(DEV, dtype) for _ in range(2)]
    pos = torch.randint(0, 40000, (T,), generator=g).to(DEV)
    return q.view(T, Hq, Dh), k.view(T, Hkv, Dh), v.view(T, Hkv, Dh), w, pos


@pytest.mark.parametrize("backend,numerics", _CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_is_the_unfused_sequence(backend, numerics, dtype, norm, monkeypatch):
    g = torch.Generator().manual_seed(1)
    T, Hq, Hkv, Dh = 21, 4, 2, 32
    q, k, v, w, pos = _qk_inputs(g, T, Hq, Hkv, Dh, dtype)
    inv = rope_inv_freq(Dh, 1e6).to(DEV)
    ws = (*w, 1e-6) if norm else ()
    slots = torch.randperm(64, generator=g)[:T].to(DEV)
    slots[[2, 9]] = -1  # graph-batch padding rows: their cache rows stay untouched
    with use_backend(backend), use_numerics(numerics), torch.no_grad():
        qo, ko = qk_norm_rope(q, k, pos, inv, *ws)
        q_ref, k_ref = qk_norm_rope_ref(q, k, pos, inv, *ws)
        assert torch.equal(qo, q_ref) and torch.equal(ko, k_ref)
        caches = [torch.full((4, 16, Hkv, Dh), 7.0, dtype=dtype, device=DEV) for _ in range(4)]
        qc, none = qk_norm_rope(q, k, pos, inv, *ws, v=v, kv_cache=caches[:2], slot_mapping=slots)
        qc_ref, _ = qk_norm_rope_ref(q, k, pos, inv, *ws, v=v, kv_cache=caches[2:], slot_mapping=slots)
        assert none is None and torch.equal(qc, q_ref) and torch.equal(qc_ref, q_ref)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        flat = caches[0].view(-1, Hkv, Dh)
        assert torch.equal(flat[slots[0]], k_ref[0]) and (flat == 7.0).all(-1).all(-1).sum() == 64 - (T - 2)
        for n in (1, 7, 16):  # batch invariance
            a, b = qk_norm_rope(q[:n], k[:n], pos[:n], inv, *ws)
            assert torch.equal(a, qo[:n]) and torch.equal(b, ko[:n])
        if backend == "triton":  # every head of a token block in one program (the training-size grid)
            from rlfuse.kernels.rope import triton_rotary as R
            monkeypatch.setattr(R, "_MIN_PROGRAMS", 1)
            a, b = qk_norm_rope(q, k, pos, inv, *ws)
            assert torch.equal(a, qo) and torch.equal(b, ko)
            monkeypatch.setattr(R, "_PIN_ROWS", not R._PIN_ROWS)  # mean_square's PIN moves, never changes
            a, b = qk_norm_rope(q, k, pos, inv, *ws)
            assert torch.equal(a, qo) and torch.equal(b, ko)
            caches[0].fill_(7.0), caches[1].fill_(7.0)
            qk_norm_rope(q, k, pos, inv, *ws, v=v, kv_cache=caches[:2], slot_mapping=slots)
            assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    # where autograd records, the op is the unfused ops (and their backward)
    leaves = [t.clone().requires_grad_() for t in (q, k)]
    dq, dk = _rand(g, T, Hq, Dh, dtype=dtype), _rand(g, T, Hkv, Dh, dtype=dtype)
    with use_backend(backend), use_numerics(numerics):
        got = _value_and_grads(lambda a, b: qk_norm_rope(a, b, pos, inv, *ws), leaves, (dq, dk))
        want = _value_and_grads(lambda a, b: qk_norm_rope_ref(a, b, pos, inv, *ws), leaves, (dq, dk))
    for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        assert torch.equal(a, b)
    assert torch.equal(got[0][0], qo)


def _unfused_forward(model, ids, pos, attn):
    """The decoder written with separate residual adds (the layer formula before fusion)."""
    m = model.model
    h = m.embed_tokens(ids)
    inv = model.inv_freq(h.device)
    for layer in m.layers:
        h = h + layer.self_attn(layer.input_layernorm(h), pos, attn, inv)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return m.norm(h)


def _qwen2_model(dtype):
    """No qk-norm, q/k/v biases: the fused op runs RoPE (and the KV store) only."""
    cfg = ModelConfig(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
                      tie_word_embeddings=False, max_position_embeddings=512)
    m = CausalLM(cfg)
    m.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(1))
    return m.to(device=DEV, dtype=dtype).eval()


@pytest.mark.parametrize("backend,numerics,dtype,family", [
    ("triton", "exact", torch.float32, "qwen3"), ("triton", "exact", torch.bfloat16, "qwen3"),
    ("torch", "fast", torch.float32, "qwen3"), ("torch", "fast", torch.bfloat16, "qwen3"),
    ("triton", "fast", torch.bfloat16, "qwen2")])
def test_model_with_fused_kernels_is_the_unfused_model(backend, numerics, dtype, family):
    """Values and every parameter gradient bitwise; the no-grad forward (fused q/k path)
    gives the recorded forward's bits."""
    model = tiny_model(dtype=dtype, device=DEV, std=0.2) if family == "qwen3" else _qwen2_model(dtype)
    g = torch.Generator().manual_seed(2)
    lens = [5, 11]
    ids = torch.randint(0, 128, (sum(lens),), generator=g).to(DEV)
    pos = torch.cat([torch.arange(n) for n in lens]).to(DEV)
    attn = Packed.from_lengths(lens, DEV)
    dout = _rand(g, sum(lens), 64, dtype=dtype)
    grads = []
    with use_backend(backend), use_numerics(numerics):
        with torch.no_grad():
            nograd = model(ids, pos, attn)
        outs = []
        for fwd in (model, lambda *a: _unfused_forward(model, *a)):
            model.zero_grad(set_to_none=True)
            out = fwd(ids, pos, attn)
            out.backward(dout)
            outs.append(out.detach())
            grads.append({n: p.grad for n, p in model.named_parameters()})
    assert torch.equal(outs[0], outs[1]) and torch.equal(nograd, outs[0])
    for name, gr in grads[0].items():
        if name == "lm_head.weight":  # the forward returns hidden states: no gradient reaches it
            assert gr is None and grads[1][name] is None
            continue
        assert torch.equal(gr, grads[1][name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [64, 4096])  # a decode batch; a training-sized pack
def test_cuda_fused_bitwise_at_qwen3_shapes(dtype, T):
    """Compiled kernels: the same bits as the unfused ones at Qwen3-0.6B sizes (the tile
    layouts, and so the reduction order, come from the compiler here)."""
    g = torch.Generator().manual_seed(3)
    h, x = _rand(g, T, 1024, dtype=dtype, scale=3), _rand(g, T, 1024, dtype=dtype)
    w = (1 + 0.2 * torch.randn(1024, generator=g)).to(DEV, dtype)
    ds, dy = _rand(g, T, 1024, dtype=dtype), _rand(g, T, 1024, dtype=dtype)
    q, k, v, wqk, pos = _qk_inputs(g, T, 16, 8, 128, dtype)
    inv = rope_inv_freq(128, 1e6).to(DEV)
    slots = torch.randperm(T + 64, generator=g)[:T].to(DEV)
    with use_backend("triton"):
        leaves = [t.clone().requires_grad_() for t in (h, x, w)]
        got = _value_and_grads(lambda a, b, c: add_rmsnorm(a, b, c, 1e-6), leaves, (ds, dy))
        want = _value_and_grads(lambda a, b, c: _unfused_add_rmsnorm(a, b, c, 1e-6), leaves, (ds, dy))
        for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]]):
            assert torch.equal(a, b)
        with torch.no_grad():
            for ws in ((*wqk, 1e-6), ()):
                qo, ko = qk_norm_rope(q, k, pos, inv, *ws)
                q_ref, k_ref = qk_norm_rope_ref(q, k, pos, inv, *ws)
                assert torch.equal(qo, q_ref) and torch.equal(ko, k_ref)
                caches = [torch.zeros(((T + 64) // 16 + 1, 16, 8, 128), dtype=dtype, device=DEV) for _ in range(4)]
                qk_norm_rope(q, k, pos, inv, *ws, v=v, kv_cache=caches[:2], slot_mapping=slots)
                qk_norm_rope_ref(q, k, pos, inv, *ws, v=v, kv_cache=caches[2:], slot_mapping=slots)
                assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_qk_norm_rope_decode_launch_with_table(cache_dtype):
    """The engine's decode launch (64 tokens, Qwen3-0.6B heads, the cos/sin table, KV store):
    the reference's bits. Its speed (Triton 3.6 once held whole (16, 128) k tiles per thread
    here: ~130 us a launch on an H200, issue 38, docs/perf-log.md 2026-11-28) is measured by
    benchmarks/profile_decode.py under graph replay, not here: an eager launch's time is mostly
    the host's."""
    from rlfuse.kernels.rope.rotary import rope_cos_sin
    g = torch.Generator().manual_seed(5)
    T, Hkv, Dh, page = 64, 8, 128, 256
    q, k, v, wqk, pos = _qk_inputs(g, T, 16, Hkv, Dh, torch.bfloat16)
    inv = rope_inv_freq(Dh, 1e6).to(DEV)
    slots = (torch.randperm(32, generator=g)[:T // 2].repeat_interleave(2) * page
             + torch.arange(T) % 2).to(DEV)
    fp8 = cache_dtype == torch.float8_e4m3fn
    scale = (torch.full((2, Hkv), 0.05, device=DEV), torch.full((2, Hkv), 20.0, device=DEV)) if fp8 else None
    caches = [torch.zeros((32, page, Hkv, Dh), dtype=cache_dtype, device=DEV) for _ in range(4)]
    with use_backend("triton"), torch.no_grad():
        cs = rope_cos_sin(pos, inv)
        qo, _ = qk_norm_rope(q, k, pos, inv, *wqk, 1e-6, v=v, kv_cache=caches[:2], slot_mapping=slots,
                             cos_sin=cs, kv_scale=scale)
        q_ref, _ = qk_norm_rope_ref(q, k, pos, inv, *wqk, 1e-6, v=v, kv_cache=caches[2:], slot_mapping=slots,
                                    cos_sin=cs, kv_scale=scale)
        assert torch.equal(qo, q_ref)
        assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
        assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
