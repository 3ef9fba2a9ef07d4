"""Fused linear-attention input projections (rlfuse.model.fuse, GatedDeltaNet.in_projections):
Qwen3.5's in_proj_qkv / z / b / a and Qwen3-Next's in_proj_qkvz / ba as one GEMM.

Exact numerics: the fused forward's logits equal the separate projections' bitwise (torch
backend; Triton kernels under the CPU interpreter), the trainer's grad-mode forward equals
the no-grad one, and an exact engine's rollout log-probs equal the trainer's with the
groups fused; fast: close. Gradients: every part's dW and dx within rounding. LoRA on all
four (one rank and scale) stays fused with the separate bits, an adapter bank likewise;
partial adaptation or mixed ranks skip with a logged reason; moving the model falls back
to the separate projections with the one warning; fuse_gathered / unfuse_gathered (FSDP's
wake / sleep) cover the groups. The bf16 check at Qwen3.5-2B / Qwen3-Next widths is `gpu`.
Run: python -m pytest -q tests/test_fuse_hybrid.py
"""

import dataclasses
import logging

import pytest
import torch
from engine_helpers import one_thread, random_prompts  # noqa: F401  (fixture)
from test_fuse import _forward_backward, _inputs  # the same packed batch and loss

from rlfuse.kernels import use_backend, use_numerics
from rlfuse.model import CausalLM, ModelConfig, Packed
from rlfuse.model.arch.qwen3_5 import tiny_hybrid_fields
from rlfuse.model.arch.qwen3_next import tiny_next_fields
from rlfuse.model.fuse import fuse_gathered, fuse_projections, is_fused, unfuse_gathered
from rlfuse.model.lora import LoRAConfig, attach_lora, init_lora_

KINDS = {"qwen3_5": (tiny_hybrid_fields, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
         "qwen3_next": (tiny_next_fields, ("in_proj_qkvz", "in_proj_ba"))}
LAYERS = ("linear_attention", "linear_attention", "full_attention")


def _model(kind="qwen3_5", dtype=torch.float32, seed=0, **over):
    fields = KINDS[kind][0](**{"vocab_size": 96, "num_hidden_layers": 3, "layer_types": LAYERS} | over)
    if kind == "qwen3_next":  # one sparse linear-attention layer, the others dense
        fields["moe"] = {**fields["moe"], "mlp_only_layers": (1, 2)}
    m = CausalLM(ModelConfig(**fields))
    m.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
    return m.to(dtype)


def _gdn(m, i=0):
    return m.model.layers[i].linear_attn


def _pair(kind="qwen3_5", dtype=torch.float32):
    sep, fused = _model(kind, dtype), _model(kind, dtype)
    fuse_projections(fused)
    for i in (0, 1):
        assert _gdn(fused, i).in_proj_fused.live(_gdn(fused, i)) and _gdn(fused, i).in_proj_fused.names == KINDS[kind][1]
    assert _gdn(sep).in_proj_fused is None
    return sep, fused


SLOW = pytest.mark.slow  # the model under the Triton interpreter: ~3.5 s a case; one of each kind runs by default


@pytest.mark.parametrize("kind,backend,dtype", [
    ("qwen3_5", "torch", torch.float32), ("qwen3_next", "torch", torch.float32),
    ("qwen3_5", "triton", torch.bfloat16), ("qwen3_next", "triton", torch.float32),
    pytest.param("qwen3_5", "triton", torch.float32, marks=SLOW),
    pytest.param("qwen3_next", "triton", torch.bfloat16, marks=SLOW)])
def test_fused_forward_equals_separate_bitwise_in_exact_numerics(kind, backend, dtype):
    sep, fused = _pair(kind, dtype)
    ids, pos, attn = _inputs()
    with torch.no_grad(), use_backend(backend), use_numerics("exact"):
        a, b = sep.logits(sep(ids, pos, attn)), fused.logits(fused(ids, pos, attn))
        x = torch.randn(7, sep.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
        parts = zip(_gdn(sep).in_projections(x), _gdn(fused).in_projections(x))
    assert torch.equal(a, b)
    assert all(torch.equal(p, q) for p, q in parts)  # mixed, z, b, a, each bitwise


@pytest.mark.parametrize("kind", KINDS)
def test_fast_close_and_gradients_reach_each_part(kind):
    sep, fused = _pair(kind)
    ids, pos, attn = _inputs()
    W = torch.randn(64, generator=torch.Generator().manual_seed(5))
    outs, grads = [], []
    for m in (sep, fused):
        h = m(ids, pos, attn)  # (T, D) hidden states: the logits are one more exact GEMM
        (h @ W).square().sum().backward()
        outs.append(h.detach())
        grads.append({n: p.grad for n, p in m.named_parameters()})
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert grads[0].keys() == grads[1].keys()
    names = KINDS[kind][1]
    assert all(grads[1][f"model.layers.0.linear_attn.{n}.weight"] is not None for n in names)
    for n, g in grads[0].items():
        if g is None:
            assert grads[1][n] is None, n
            continue
        # fp32 rounding of a different GEMM split, carried through three layers' backward
        torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=2e-5 * g.abs().max().item(), msg=n)
    # one layer's input projections alone: each part's dW rows and dx, to fp32 rounding
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(6), requires_grad=True)
    got = []
    for m in (sep, fused):
        outs = _gdn(m).in_projections(x)
        dys = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7 + i)) for i, o in enumerate(outs)]
        got.append(torch.autograd.grad(outs, [x] + [getattr(_gdn(m), n).weight for n in names], dys))
    for a, b in zip(*got):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6 * a.abs().max().item())


def test_trainer_forward_equals_engine_forward_and_updates_reach_the_buffer():
    """The grad-mode forward (the trainer's) and the no-grad one (the engine's) give the same
    bits; an optimizer's in-place step on one part is read by the fused GEMM."""
    sep, fused = _pair()
    ids, pos, attn = _inputs()
    with use_numerics("exact"):
        with torch.no_grad():
            ref = fused(ids, pos, attn)
        h = fused(ids, pos, attn)
        h.sum().backward()
        assert torch.equal(h.detach(), ref)
        with torch.no_grad():
            for m in (sep, fused):
                _gdn(m).in_proj_b.weight.add_(0.05)
                _gdn(m, 1).in_proj_z.weight.mul_(1.5)
            assert torch.equal(sep(ids, pos, attn), fused(ids, pos, attn))
            assert _gdn(fused).in_proj_fused.live(_gdn(fused))


def test_state_dict_keeps_names_and_moving_falls_back_with_one_warning(caplog):
    sep, fused = _pair("qwen3_next")
    assert list(fused.state_dict()) == list(sep.state_dict())
    assert all(torch.equal(fused.state_dict()[k], v) for k, v in sep.state_dict().items())
    sep, fused = sep.double(), fused.double()
    ids, pos, attn = _inputs()
    # the first stale group of the process warns, later ones debug-log (another test may have warned first)
    with caplog.at_level(logging.DEBUG, logger="rlfuse.model.fuse"), torch.no_grad(), use_numerics("exact"):
        assert torch.equal(sep(ids, pos, attn), fused(ids, pos, attn))
    assert "fused in_proj_qkvz/in_proj_ba of FusedGatedDeltaNet no longer covers its parameters" in caplog.text
    assert not is_fused(fused)
    assert fuse_projections(fused) > 0 and _gdn(fused).in_proj_fused.live(_gdn(fused))


def _lora_pair(kind="qwen3_5", fuse_first=True, cfg=None):
    cfg = cfg or LoRAConfig(rank=4, alpha=8.0)
    sep, fused = _model(kind), _model(kind)
    if fuse_first:  # the engine fused the base model, then adapters came (attach_lora drops the groups)
        fuse_projections(fused)
    for m in (sep, fused):
        attach_lora(m, cfg)
        init_lora_(m, seed=2, b_std=0.2)
    fuse_projections(fused)
    return sep, fused


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_lora_on_all_four_stays_fused_bitwise_and_gradients_reach_each_adapter(kind, numerics):
    sep, fused = _lora_pair(kind)
    g = _gdn(fused)
    assert g.in_proj_fused.adapted and g.in_proj_fused.live(g)
    ids, pos, attn = _inputs()
    with use_numerics(numerics):
        outs, grads = _forward_backward((sep, fused), ids, pos, attn)
        with torch.no_grad():
            nograd = fused(ids, pos, attn)
            base = _model(kind)(ids, pos, attn)
    if numerics == "exact":
        assert torch.equal(outs[0], outs[1]) and torch.equal(nograd, outs[1])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nograd, outs[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base, outs[0])  # the adapters apply
    assert grads[0].keys() == grads[1].keys()
    assert all(f"model.layers.0.linear_attn.{n}.lora_{ab}" in grads[0] for n in KINDS[kind][1] for ab in "AB")
    for n, gr in grads[0].items():
        torch.testing.assert_close(grads[1][n], gr, rtol=1e-4, atol=1e-5 * gr.abs().max().item(), msg=n)


@SLOW
@pytest.mark.parametrize("kind", KINDS)
def test_lora_group_under_triton_equals_separate_bitwise(kind):
    """The 4-part (Qwen3.5) and 2-part (Qwen3-Next) LoRA group through the Triton kernels, bf16."""
    sep, fused = _lora_pair(kind)
    sep, fused = sep.bfloat16(), fused.bfloat16()
    fuse_projections(fused)  # .bfloat16() moved the buffers: fuse again
    assert _gdn(fused).in_proj_fused.adapted and _gdn(fused).in_proj_fused.live(_gdn(fused))
    ids, pos, attn = _inputs()
    with torch.no_grad(), use_backend("triton"), use_numerics("exact"):
        assert torch.equal(sep(ids, pos, attn), fused(ids, pos, attn))


@pytest.mark.parametrize("targets,why", [(("in_proj_qkv", "in_proj_z"), "some adapted, some not"),
                                         (None, "different rank")])
def test_partly_adapted_or_mixed_rank_groups_stay_separate_with_a_reason(targets, why, caplog):
    cfg = LoRAConfig(rank=4, targets=targets) if targets else LoRAConfig(rank=4)
    sep, fused = _model(), _model()
    for m in (sep, fused):
        attach_lora(m, cfg)
        if targets is None:  # in_proj_b at rank 2: what a per-module rank pattern would give
            from rlfuse.model.lora import LoRALinear
            gdn = _gdn(m)
            gdn.in_proj_b = LoRALinear(gdn.in_proj_b, dataclasses.replace(cfg, rank=2))
        init_lora_(m, seed=2, b_std=0.2)
    with caplog.at_level(logging.INFO, logger="rlfuse.model.fuse"):
        fuse_projections(fused)
    assert _gdn(fused).in_proj_fused is None
    assert "linear_attn.in_proj_qkv/in_proj_z/in_proj_b/in_proj_a" in caplog.text and why in caplog.text
    ids, pos, attn = _inputs()
    with torch.no_grad(), use_numerics("exact"):
        assert torch.equal(sep(ids, pos, attn), fused(ids, pos, attn))


def test_adapter_bank_stays_fused_and_equals_separate_bitwise(tmp_path):
    from rlfuse.model.lora_bank import adapter_rows, load_adapter_bank
    from rlfuse.model.lora_peft import save_peft_adapter
    folders = {}
    for i, name in enumerate(("math", "code")):
        m = _model()
        attach_lora(m, LoRAConfig(rank=4, alpha=4.0 * (i + 1)))
        init_lora_(m, seed=10 + i, b_std=0.3)
        save_peft_adapter(m, tmp_path / name)
        folders[name] = tmp_path / name
    sep, fused = _model(), _model()
    for m in (sep, fused):
        load_adapter_bank(m, folders)
    fuse_projections(fused)
    g = _gdn(fused)
    assert g.in_proj_fused.adapted and g.in_proj_fused.live(g)
    ids, pos, attn = _inputs()
    rows = torch.tensor([0] * 5 + [1] * 9 + [-1], dtype=torch.int32)
    with torch.no_grad(), use_numerics("exact"):
        with adapter_rows(sep, rows):
            a = sep(ids, pos, attn)
        with adapter_rows(fused, rows):
            b = fused(ids, pos, attn)
        base = _model()(ids, pos, attn)
    assert torch.equal(a, b)
    assert torch.equal(a[14:], base[14:]) and not torch.equal(a[:14], base[:14])


def test_fuse_gathered_covers_the_linear_attention_groups():
    """FSDP's wake / sleep (`GatheredSampler`), on stand-in gathered tensors: each group's
    tensors move into the fused buffer (their own storage freed), the forward keeps its
    bits; `unfuse_gathered` points the parameters back and puts back what the groups held (none here)."""
    sep, m = _model(), _model()
    params = {n: p for n, p in m.named_parameters()}
    own = {n: p.data for n, p in params.items()}  # what FSDP's all-gather would hand over
    restore = fuse_gathered(m)
    # (not `len(restore)` inside the assert: pytest's report would print tensors whose storage is freed)
    groups = sorted(attr for _, attr, _, _ in restore)
    assert groups == ["gate_up_fused"] * 3 + ["in_proj_fused"] * 2  # (GatedAttention is not a fused kind)
    g = _gdn(m)
    assert g.in_proj_fused.live(g) and g.in_proj_qkv.weight.data_ptr() == g.in_proj_fused.weight.data_ptr()
    assert own["model.layers.0.linear_attn.in_proj_a.weight"].untyped_storage().size() == 0
    ids, pos, attn = _inputs()
    with torch.no_grad(), use_numerics("exact"):
        assert torch.equal(m(ids, pos, attn), sep(ids, pos, attn))
    unfuse_gathered(restore)
    assert g.in_proj_fused is None and not is_fused(m)
    assert all(params[n].data.data_ptr() == t.data_ptr() for n, t in own.items())


def test_exact_rollout_log_probs_equal_the_trainers_with_fused_groups():
    """`rlfuse check`'s combined setting on the tiny hybrid with the engine fusing (its
    static decode step runs the fused group): every engine log-prob equals the trainer's."""
    from rlfuse.consistency.check import default_sweep, run_setting
    model = _model(vocab_size=128).eval()
    prompts = random_prompts([14, 30, 7, 3])
    s = {s.name: s for s in default_sweep(4, small_pool_blocks=6, chunk_tokens=16)}["combined"]
    s = dataclasses.replace(s, engine={**s.engine, "fuse_projections": True})
    with use_backend("torch"):
        r = run_setting(model, prompts, s, numerics="exact", max_tokens=6, temperature=1.0)
    assert is_fused(model) and _gdn(model).in_proj_fused.live(_gdn(model))
    assert r.tokens > 0 and r.bitwise_frac == 1.0 and r.max_abs == 0.0, (r.row(), r.first_diff)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,value_heads", [("qwen3_5", 16), ("qwen3_next", 32)])
def test_gpu_fused_in_projections_bitwise_at_real_widths(kind, value_heads):
    """Qwen3.5-2B's linear-attention widths (hidden 2048, 16 key heads x 128, 16 value heads
    x 128; Qwen3-Next: 32 value heads), bf16, exact numerics, compiled Triton GEMMs: the
    fused group's outputs equal the separate projections bitwise, at decode and prefill row
    counts, and the layer's forward likewise."""
    over = dict(hidden_size=2048, intermediate_size=64, linear_num_key_heads=16, linear_key_head_dim=128,
                linear_num_value_heads=value_heads, linear_value_head_dim=128, num_attention_heads=16,
                num_key_value_heads=2, head_dim=128)
    sep, fused = (_model(kind, torch.bfloat16, **over).cuda() for _ in range(2))
    fuse_projections(fused)
    gs, gf = _gdn(sep), _gdn(fused)
    assert gf.in_proj_fused.live(gf)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad(), use_backend("triton"), use_numerics("exact"):
        for M in (1, 37, 64, 256, 1000):
            x = torch.randn(M, 2048, device="cuda", generator=g).to(torch.bfloat16)
            for p, q in zip(gs.in_projections(x), gf.in_projections(x)):
                assert torch.equal(p, q), M
        ids, pos, attn = _inputs((300, 17, 1))
        ids, pos, attn = ids.cuda(), pos.cuda(), Packed.from_lengths([300, 17, 1], device="cuda")
        assert torch.equal(sep(ids, pos, attn), fused(ids, pos, attn))
