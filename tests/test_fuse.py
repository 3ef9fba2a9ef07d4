"""Fused projections (rlfuse.model.fuse): q/k/v and gate/up as one GEMM each.

Exact numerics: the fused forward equals the separate projections bitwise (torch backend
and the Triton kernels under the CPU interpreter); fast: close. Training gradients reach
each HF-named parameter; in-place updates of a part are seen by the fused GEMM; save/load
keeps HF names; anything that moves the parameters after fusing falls back to separate
GEMMs (one warning); fully LoRA-adapted groups stay fused, with the separate projections'
bits; partly adapted groups stay separate. Engine-level equalities with fusion on (a CPU
engine fuses only when asked; CUDA engines by default): greedy == naive generate
(tests/test_engine.py, the "fused" case), exact rollout == trainer log-probs
(tests/test_exact_engine.py), the `gpu` tests here and in tests/test_exact_engine.py.
Run: python -m pytest -q tests/test_fuse.py
"""

import logging

import pytest
import torch
from safetensors import safe_open

import rlfuse.model.fuse as fuse_mod
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.activation.glu import swiglu, swiglu_packed
from rlfuse.kernels.linear.gemm import linear, linear_fused, linear_fused_parts
from rlfuse.model import CausalLM, ModelConfig, Packed, load_model, save_model
from rlfuse.model.fuse import fuse_projections, groups_of
from rlfuse.model.fuse_sharded import JoinedLinear
from rlfuse.model.lora import LoRAConfig, attach_lora

BACKENDS = ("torch", "triton")


def _model(model_type="qwen3", dtype=torch.float32, seed=0):
    qwen3 = model_type == "qwen3"
    cfg = ModelConfig(model_type=model_type, vocab_size=96, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      qk_norm=qwen3, attention_bias=not qwen3, tie_word_embeddings=False,
                      max_position_embeddings=256)
    m = CausalLM(cfg)
    m.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
    if not qwen3:  # nonzero q/k/v biases, so the fused bias is exercised
        with torch.no_grad():
            for n, p in m.named_parameters():
                if n.endswith("proj.bias"):
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    return m.to(dtype)


def _inputs(lengths=(5, 9, 1), seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return ids, pos, Packed.from_lengths(list(lengths))


def _forward_backward(models, ids, pos, attn):
    """Each model's output and trainable gradients under one fixed loss (the same W for all)."""
    W = torch.randn(models[0].config.hidden_size, generator=torch.Generator().manual_seed(5))
    outs, grads = [], []
    for m in models:
        h = m(ids, pos, attn)
        (h @ W).square().sum().backward()
        outs.append(h.detach())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    return outs, grads


def _pair(model_type="qwen3", dtype=torch.float32):
    a, b = _model(model_type, dtype), _model(model_type, dtype)
    assert fuse_projections(b) == 4  # 2 layers x (q/k/v, gate/up)
    return a, b


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type,dtype", [("qwen3", torch.float32), ("qwen2", torch.float32),
                                              ("qwen3", torch.bfloat16)])
def test_fused_forward_equals_separate_bitwise_in_exact_numerics(backend, model_type, dtype):
    if backend == "torch" and dtype == torch.bfloat16:
        pytest.skip("the torch backend's exact path is fp32 products either way; bf16 runs under Triton")
    sep, fused = _pair(model_type, dtype)
    ids, pos, attn = _inputs()
    with torch.no_grad(), use_backend(backend), use_numerics("exact"):
        a, b = sep(ids, pos, attn), fused(ids, pos, attn)
    assert fused.model.layers[0].self_attn.qkv_fused.live(fused.model.layers[0].self_attn)
    assert torch.equal(a, b)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
def test_fused_forward_close_in_fast_numerics_and_gradients_reach_each_part(model_type):
    sep, fused = _pair(model_type)
    ids, pos, attn = _inputs()
    W = torch.randn(64, generator=torch.Generator().manual_seed(5))
    outs, grads = [], []
    for m in (sep, fused):
        h = m(ids, pos, attn)
        (h @ W).square().sum().backward()
        outs.append(h.detach())
        grads.append({n: p.grad for n, p in m.named_parameters()})
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert grads[0].keys() == grads[1].keys()
    for n, g in grads[0].items():
        if g is None:  # the LM head: the loss reads hidden states
            assert grads[1][n] is None, n
            continue
        assert grads[1][n] is not None and grads[1][n].shape == g.shape, n
        # fp32 rounding of a different GEMM split (dx is one GEMM over the fused N)
        torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=1e-6 * g.abs().max().item(), msg=n)


def test_exact_log_probs_match_between_grad_and_no_grad_forward():
    """The trainer's forward (grad mode, the fused autograd function) and the engine's
    (no grad) give the same bits in exact numerics, checkpointed or not."""
    _, m = _pair()
    ids, pos, attn = _inputs()
    with use_numerics("exact"):
        with torch.no_grad():
            ref = m(ids, pos, attn)
        assert torch.equal(m(ids, pos, attn), ref)
        m.gradient_checkpointing = True
        h = m(ids, pos, attn)
        h.sum().backward()
    assert torch.equal(h.detach(), ref)
    assert m.model.layers[1].mlp.gate_proj.weight.grad is not None


def test_linear_fused_gradients_equal_separate_linears():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(11, 32, generator=g, requires_grad=True)
    buf, bbuf = torch.randn(40, 32, generator=g), torch.randn(40, generator=g)
    ws = [torch.nn.Parameter(w) for w in buf.split([24, 8, 8])]
    bs = [torch.nn.Parameter(b) for b in bbuf.split([24, 8, 8])]
    for w, v in zip(ws, buf.split([24, 8, 8])):
        w.data = v
    for b, v in zip(bs, bbuf.split([24, 8, 8])):
        b.data = v
    dy = torch.randn(11, 40, generator=g)
    for numerics in ("fast", "exact"):
        with use_numerics(numerics):
            y = linear_fused(x, buf, bbuf, tuple(ws), tuple(bs))
            got = torch.autograd.grad(y, [x, *ws, *bs], dy)
            ys = [linear(x, w, b) for w, b in zip(ws, bs)]
            ref = torch.autograd.grad(ys, [x, *ws, *bs], list(dy.split([24, 8, 8], -1)))
        if numerics == "exact":
            assert torch.equal(y, torch.cat(ys, -1))
        for a, r in zip(got, ref):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("numerics", ["fast", "exact"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joined_parts_equal_linear_fused_over_a_buffer_bitwise(numerics, bias, dtype):
    """linear_fused_parts (parts held apart, joined per call: an FSDP-gathered model) vs
    linear_fused over a buffer the parts are views of: forward and every gradient bitwise;
    both within rounding of a float64 reference. Odd sizes, a non-contiguous 3-d input."""
    g = torch.Generator().manual_seed(11)
    sizes, K = [13, 5, 7], 19
    buf, bbuf = torch.randn(sum(sizes), K, generator=g), torch.randn(sum(sizes), generator=g)
    x0 = torch.randn(5, 3, K, generator=g).to(dtype).transpose(0, 1)  # (3, 5, K), non-contiguous
    dy = torch.randn(3, 5, sum(sizes), generator=g).to(dtype)
    buf, bbuf = buf.to(dtype), bbuf.to(dtype)
    views = [torch.nn.Parameter(w) for w in buf.split(sizes)]
    for p, v in zip(views, buf.split(sizes)):
        p.data = v  # views of the buffer, as rlfuse.model.fuse makes them
    bviews = [torch.nn.Parameter(b) for b in bbuf.split(sizes)] if bias else None
    for p, v in zip(bviews or [], bbuf.split(sizes)):
        p.data = v
    apart = [torch.nn.Parameter(w.clone()) for w in buf.split(sizes)]  # own storage each
    bapart = [torch.nn.Parameter(b.clone()) for b in bbuf.split(sizes)] if bias else None
    bt = (lambda ps: tuple(ps)) if bias else (lambda ps: None)
    cases = ((views, bviews, lambda x: linear_fused(x, buf, bbuf if bias else None, tuple(views), bt(bviews))),
             (apart, bapart, lambda x: linear_fused_parts(x, tuple(apart), bt(bapart))))
    res = []
    with use_numerics(numerics):
        for ws, bs, y_fn in cases:
            x = x0.detach().requires_grad_(True)
            y = y_fn(x)
            res.append((y.detach(), torch.autograd.grad(y, [x, *ws, *(bs or [])], dy)))
            with torch.no_grad():
                assert torch.equal(y_fn(x), y)  # the no-grad path: the same GEMM
    (y_f, g_f), (y_p, g_p) = res
    assert torch.equal(y_p, y_f)
    assert len(g_p) == len(g_f) == 1 + len(sizes) * (1 + bias)
    for a, b in zip(g_p, g_f):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # float64 gold: y = x W^T + b, dx = dy W, dW = dy^T x, db = sum dy
    x64, dy64, w64 = x0.double().reshape(-1, K), dy.double().reshape(-1, sum(sizes)), buf.double()
    y64 = x64 @ w64.T + (bbuf.double() if bias else 0)
    gold = [(dy64 @ w64).view(x0.shape), *(dy64.T @ x64).split(sizes), *(dy64.sum(0).split(sizes) if bias else [])]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(y_p.double(), y64.view(3, 5, -1), **tol)
    for a, r in zip(g_p, gold):
        torch.testing.assert_close(a.double(), r, **tol)


def test_joined_parts_keep_no_joined_copy_for_backward():
    """What linear_fused_parts saves for backward is x and the parts themselves (FSDP's
    gathered tensors), never the joined (sum N_i, K) weight: no second copy of the model's
    projection weights between forward and backward."""
    ws = tuple(torch.nn.Parameter(torch.randn(n, 8)) for n in (5, 3, 3))
    bs = tuple(torch.nn.Parameter(torch.randn(n)) for n in (5, 3, 3))
    x = torch.randn(4, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = linear_fused_parts(x, ws, bs)
    assert len(saved) == 1 + len(ws) and saved[0] is x and all(a is b for a, b in zip(saved[1:], ws))
    y.sum().backward()
    assert all(w.grad is not None and b.grad is not None for w, b in zip(ws, bs))


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
def test_joined_groups_on_a_plain_model_equal_the_fused_model_bitwise(model_type):
    """JoinedLinear (rlfuse.model.fuse_sharded: FSDP's gathered parts) is live on plain
    tensors; on a one-process model it must give fuse_projections' forward and gradients."""
    joined, fused = _pair(model_type)
    for m in joined.modules():
        for attr, names in groups_of(m):
            setattr(m, attr, JoinedLinear(m, names))
    attn0 = joined.model.layers[0].self_attn
    assert attn0.qkv_fused.live(attn0)
    for numerics in ("fast", "exact"):
        with use_numerics(numerics):
            for m in (joined, fused):
                m.zero_grad(set_to_none=True)
            outs, grads = _forward_backward([joined, fused], *_inputs())
        assert torch.equal(outs[0], outs[1])
        for n, gr in grads[1].items():
            assert (gr is None and grads[0][n] is None) or torch.equal(grads[0][n], gr), (numerics, n)


def test_in_place_updates_of_a_part_reach_the_fused_gemm():
    sep, fused = _pair()
    ids, pos, attn = _inputs()
    with torch.no_grad():
        for m in (sep, fused):  # what the optimizer does: p.copy_(master) / p.add_()
            m.model.layers[0].self_attn.k_proj.weight.add_(0.05)
            m.model.layers[1].mlp.up_proj.weight.copy_(m.model.layers[1].mlp.up_proj.weight * 1.5)
            m.load_state_dict({"model.layers.1.self_attn.v_proj.weight":
                               torch.full((32, 64), 0.01)}, strict=False)
        with use_numerics("exact"):
            assert torch.equal(sep(ids, pos, attn), fused(ids, pos, attn))


def test_save_load_round_trip_keeps_hf_names(tmp_path):
    _, m = _pair("qwen2")
    save_model(m, tmp_path / "ck")
    with safe_open(tmp_path / "ck" / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.1.mlp.up_proj.weight" in names
        assert not any("fused" in n for n in names)
        for n, p in m.named_parameters():
            assert torch.equal(f.get_tensor(n), p.detach()), n
    assert names == {n for n, _ in m.named_parameters()}
    back = load_model(tmp_path / "ck", dtype=torch.float32)
    ids, pos, attn = _inputs()
    with torch.no_grad(), use_numerics("exact"):
        assert torch.equal(back(ids, pos, attn), m(ids, pos, attn))


def test_moving_the_model_after_fusing_falls_back_to_separate_gemms(caplog, monkeypatch):
    monkeypatch.setattr(fuse_mod, "_stale_warned", [False])  # the process's first stale group warns
    sep, fused = _pair()
    sep, fused = sep.double(), fused.double()
    ids, pos, attn = _inputs()
    with caplog.at_level(logging.WARNING, logger="rlfuse.model.fuse"), torch.no_grad(), use_numerics("exact"):
        assert torch.equal(sep(ids, pos, attn), fused(ids, pos, attn))
    assert "no longer covers its parameters" in caplog.text
    assert fuse_projections(fused) == 4  # fusing again re-groups the moved parameters


def test_partly_adapted_groups_stay_separate_and_adapters_apply(caplog):
    ids, pos, attn = _inputs()
    cfg = LoRAConfig(rank=4, targets=["q_proj", "up_proj"])
    # adapters attached before fusing: the partly adapted groups are skipped
    a = _model()
    attach_lora(a, cfg)
    assert fuse_projections(a) == 0
    # adapters attached after fusing: attach_lora drops the groups it adapts (no stale warning)
    b = _model()
    fuse_projections(b)
    with caplog.at_level(logging.WARNING, logger="rlfuse.model.fuse"):
        attach_lora(b, cfg)
        b(ids, pos, attn)
    assert "no longer covers" not in caplog.text and b.model.layers[0].self_attn.qkv_fused is None
    for m in (a, b):
        for mod in m.modules():
            if hasattr(mod, "lora_B"):
                torch.nn.init.normal_(mod.lora_B, std=0.1, generator=torch.Generator().manual_seed(1))
    c = _model()
    with torch.no_grad(), use_numerics("exact"):
        ya, yb, yc = a(ids, pos, attn), b(ids, pos, attn), c(ids, pos, attn)
    assert torch.equal(ya, yb)
    assert not torch.equal(ya, yc)  # the adapters changed the output


def _lora_pair(model_type="qwen3", dtype=torch.float32, fuse_first=False):
    """(separate, fused) models with the same random all-linear adapters (B nonzero)."""
    from rlfuse.model.lora import init_lora_
    sep, fused = _model(model_type, dtype), _model(model_type, dtype)
    if fuse_first:  # the bench's order: the engine fused the base model, then adapters came
        fuse_projections(fused)
    for m in (sep, fused):
        attach_lora(m, LoRAConfig(rank=4, alpha=8.0))
        init_lora_(m, seed=2, b_std=0.2)
    assert fuse_projections(fused) == 4
    return sep, fused


@pytest.mark.parametrize("backend,model_type,dtype", [
    ("torch", "qwen2", torch.float32),
    # the kernels' bitwise promises run in the default suite (tests/test_lora_bank.py); the model under the
    # interpreter takes ~9 s
    pytest.param("triton", "qwen3", torch.bfloat16, marks=pytest.mark.slow)])
def test_lora_groups_fused_equal_separate_bitwise_in_exact_numerics(backend, model_type, dtype):
    sep, fused = _lora_pair(model_type, dtype, fuse_first=True)
    ids, pos, attn = _inputs()
    attn0 = fused.model.layers[0].self_attn
    assert attn0.qkv_fused.adapted and attn0.qkv_fused.live(attn0)
    with torch.no_grad(), use_backend(backend), use_numerics("exact"):
        a, b = sep(ids, pos, attn), fused(ids, pos, attn)
        c = _model(model_type, dtype)(ids, pos, attn)
    assert torch.equal(a, b) and not torch.equal(a, c)  # the adapters apply, with the separate bits


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_lora_fused_gradients_reach_each_adapter_and_updates_are_seen(numerics):
    sep, fused = _lora_pair()
    ids, pos, attn = _inputs()
    with use_numerics(numerics):
        outs, grads = _forward_backward((sep, fused), ids, pos, attn)
        if numerics == "exact":
            assert torch.equal(outs[0], outs[1])
            with torch.no_grad():
                assert torch.equal(fused(ids, pos, attn), outs[1])  # the engine's no-grad forward: same bits
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    with torch.no_grad(), use_numerics(numerics):  # fast: the shrink joined to the base GEMM (W and A one buffer)
        torch.testing.assert_close(fused(ids, pos, attn), outs[0], rtol=1e-5, atol=1e-5)
    o = fused.model.layers[0].self_attn.o_proj
    ptrs = (o.weight.data_ptr(), o.lora_A.data_ptr(), fused.model.layers[0].self_attn.q_proj.lora_A.data_ptr())
    assert o.is_joined() and fuse_projections(fused) == 0  # a second engine moves nothing the first one reads
    assert ptrs == (o.weight.data_ptr(), o.lora_A.data_ptr(), fused.model.layers[0].self_attn.q_proj.lora_A.data_ptr())
    assert grads[0].keys() == grads[1].keys() and any("k_proj.lora_A" in n for n in grads[0])
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-4, atol=1e-5 * g.abs().max().item(), msg=n)
    with torch.no_grad():  # the optimizer's in-place step on one part reaches the fused buffers
        for m in (sep, fused):
            m.model.layers[0].self_attn.k_proj.lora_B.add_(0.1)
            m.model.layers[1].mlp.up_proj.lora_A.mul_(1.5)
        with use_numerics("exact"):
            assert torch.equal(sep(ids, pos, attn), fused(ids, pos, attn))


def test_lora_adapter_saved_from_a_fused_model_loads_back(tmp_path):
    """A and B are views of the fused / joined buffers: the PEFT folder still holds exactly them."""
    from rlfuse.model.lora_peft import load_peft_adapter, save_peft_adapter
    sep, fused = _lora_pair()
    save_peft_adapter(fused, tmp_path / "a")
    back = _model()
    load_peft_adapter(back, tmp_path / "a")
    ids, pos, attn = _inputs()
    with torch.no_grad(), use_numerics("exact"):
        assert torch.equal(back(ids, pos, attn), sep(ids, pos, attn))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_swiglu_packed_equals_swiglu_bitwise(backend, numerics):
    g = torch.Generator().manual_seed(9)
    gu = (torch.randn(13, 2 * 1100, generator=g) * 3).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(13, 1100, generator=g).to(torch.bfloat16)
    with use_backend(backend), use_numerics(numerics):
        y = swiglu_packed(gu)
        (d_packed,) = torch.autograd.grad(y, gu, dy)
        gate, up = gu.detach().chunk(2, -1)
        gate, up = gate.contiguous().requires_grad_(), up.contiguous().requires_grad_()
        y_ref = swiglu(gate, up)
        dg, du = torch.autograd.grad(y_ref, (gate, up), dy)
    assert torch.equal(y, y_ref)
    assert torch.equal(d_packed, torch.cat([dg, du], -1))
    with pytest.raises(ValueError, match="halves"):
        swiglu_packed(gu[:, :7])


@pytest.mark.gpu
def test_gpu_split_last_plan_and_fused_projections_are_bitwise():
    """On the GPU (compiled kernels, real concurrency): the one-launch split plan equals
    the fused plan at decode shapes, repeated (a missed arrival or a stale partial would
    show as a mismatch), eager and replayed from a CUDA graph; the fused q/k/v and gate/up
    GEMMs equal the separate ones (auto plans on both sides); swiglu_packed equals swiglu."""
    from rlfuse.kernels.linear.triton_gemm import linear_exact_triton
    dev, bf16 = "cuda", torch.bfloat16
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, bf16)

    for M in (1, 37, 64, 256):
        for N, K in ((1024, 2048), (1024, 3072), (2048, 1024), (4096, 1024)):
            x, w = rand(M, K), rand(N, K, scale=K ** -0.5)
            ref = linear_exact_triton(x, w, plan="fused")
            for _ in range(20):
                assert torch.equal(linear_exact_triton(x, w, plan="split_last"), ref), (M, N, K)
            assert torch.equal(linear_exact_triton(x, w, plan="split"), ref), (M, N, K)
            assert torch.equal(linear_exact_triton(x, w), ref), (M, N, K)
    # a CUDA graph replays the one-launch split (its counters must be back at zero each time)
    x_s, w = rand(64, 2048), rand(1024, 2048, scale=2048 ** -0.5)
    linear_exact_triton(x_s, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_s = linear_exact_triton(x_s, w)
    for _ in range(10):
        x_s.copy_(rand(64, 2048))
        graph.replay()
        assert torch.equal(y_s, linear_exact_triton(x_s, w, plan="fused"))
    # fused projections at the Qwen3-0.6B shapes
    D, I = 1024, 3072
    parts = [rand(2048, D, scale=D ** -0.5), rand(1024, D, scale=D ** -0.5), rand(1024, D, scale=D ** -0.5)]
    gate_up = [rand(I, D, scale=D ** -0.5), rand(I, D, scale=D ** -0.5)]
    for M in (1, 64, 256, 1000):
        x = rand(M, D)
        with use_numerics("exact"):
            for ws in (parts, gate_up):
                assert torch.equal(linear(x, torch.cat(ws)), torch.cat([linear(x, w) for w in ws], -1)), M
        gu = rand(M, 2 * I, scale=3.0)
        assert torch.equal(swiglu_packed(gu), swiglu(gu[:, :I].contiguous(), gu[:, I:].contiguous()))


def test_reference_model_of_a_fused_policy_is_fused():
    from rlfuse.train.loop import reference_model
    sep, fused = _pair()
    assert not reference_model(sep).model.layers[0].self_attn.qkv_fused
    ref = reference_model(fused)
    ids, pos, attn = _inputs()
    with torch.no_grad():
        assert torch.equal(ref(ids, pos, attn), fused(ids, pos, attn))
    assert ref.model.layers[0].mlp.gate_up_fused.live(ref.model.layers[0].mlp)
