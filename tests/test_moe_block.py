"""The MoE block (rlfuse.model.layers.moe) against transformers 5.24's Qwen3MoeSparseMoeBlock on
random weights: output, router logits, the gradient of the input and of every parameter
(fp32 tight, bf16 loose), on both backends and numerics; the load-balancing loss against
transformers' `load_balancing_loss_func` (value and gradient, with and without a mask);
the z-loss, the metrics and the per-expert checkpoint layout.

    python -m pytest -q tests/test_moe_block.py
"""

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from rlfuse.kernels import use_backend, use_numerics
from rlfuse.model.layers.moe import (
    SparseMoeBlock,
    collect_router_stats,
    fuse_expert_tensors,
    load_balancing_loss,
    moe_metrics,
    router_stats,
    router_z_loss,
    split_expert_tensors,
)

D, I, E, K = 48, 24, 6, 2


def _pair(dtype, seed=0, norm=True):
    cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                         norm_topk_prob=norm, vocab_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16)
    cfg._experts_implementation = "eager"  # what the model class sets; a standalone block warns without it
    torch.manual_seed(seed)
    ref = hf.Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    ours = SparseMoeBlock(hidden_size=D, moe_intermediate_size=I, num_experts=E, top_k=K, norm_topk_prob=norm)
    assert sorted(n for n, _ in ours.named_parameters()) == sorted(n for n, _ in ref.named_parameters())
    ours.load_state_dict(ref.state_dict())
    return ref.to(dtype), ours.to(dtype)


def _run(block, x, dout):
    x = x.detach().clone().requires_grad_()
    out = block(x)
    names, params = zip(*sorted(block.named_parameters()))  # by name: the two blocks list them in other orders
    grads = torch.autograd.grad(out, [x, *params], dout)
    return out, grads


SETTINGS = [("torch", "fast"), ("torch", "exact"), ("triton", "fast"), ("triton", "exact")]


@pytest.mark.parametrize("backend,numerics", SETTINGS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)])
def test_block_matches_transformers(backend, numerics, dtype, tol):
    ref, ours = _pair(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, D, generator=g).to(dtype)
    dout = torch.randn(2, 9, D, generator=g).to(dtype)
    out_ref, grads_ref = _run(ref, x, dout)
    logits_ref = ref.gate(x.view(-1, D))[0]
    with use_backend(backend), use_numerics(numerics):
        out, grads = _run(ours, x, dout)
    _, _, experts_ref = ref.gate(x.view(-1, D))
    # the same experts (as sets: transformers' top-k is not ordered by index on ties)
    assert torch.equal(ours.last_load, torch.bincount(experts_ref.reshape(-1), minlength=E))
    assert out.dtype == dtype
    for ours_t, ref_t in [(out, out_ref), (ours.last_router_logits, logits_ref), *zip(grads, grads_ref)]:
        scale = ref_t.detach().abs().max().item()
        err = (ours_t.detach().double() - ref_t.detach().double()).abs().max().item()
        assert err <= tol * max(1.0, scale), (err, scale)


def test_block_without_norm_topk_prob():
    ref, ours = _pair(torch.float32, seed=3, norm=False)
    x = torch.randn(13, D)
    with use_backend("torch"), use_numerics("exact"):
        out = ours(x)
    torch.testing.assert_close(out, ref(x[None])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_balancing_loss_matches_transformers(masked, dtype):
    g = torch.Generator().manual_seed(4)
    B, S = 3, 7
    layers = [(torch.randn(B * S, E, generator=g) * 2).to(dtype).requires_grad_() for _ in range(3)]
    mask = (torch.rand(B, S, generator=g) > 0.3).long() if masked else None
    ref = hf.load_balancing_loss_func(tuple(layers), E, K, mask)
    stats = [router_stats(l, K, None if mask is None else mask.reshape(-1)) for l in layers]
    ours = load_balancing_loss(stats, E)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    for a, b in zip(torch.autograd.grad(ours, layers), torch.autograd.grad(ref, layers)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_router_stats_recorded_in_training_only_and_metrics():
    _, ours = _pair(torch.float32, seed=5)
    x = torch.randn(11, D)
    ours(x)
    assert ours.last_stats is None  # recorded only when asked (the config's output_router_logits)
    ours.record_stats = True
    with torch.no_grad():
        ours(x)
    assert ours.last_stats is None and int(ours.last_load.sum()) == 11 * K
    ours(x)
    stats = collect_router_stats(ours)
    assert len(stats) == 1
    logits = x @ ours.gate.weight.t()
    z = (torch.logsumexp(logits.double(), -1) ** 2).mean()
    torch.testing.assert_close(router_z_loss(stats).double(), z, rtol=1e-5, atol=1e-6)
    m = moe_metrics(ours)
    load = ours.last_load.float()
    torch.testing.assert_close(m["moe/load_max/layer_0"], load.max() / load.mean())
    torch.testing.assert_close(m["moe/load_min"], load.min() / load.mean())
    torch.testing.assert_close(m["moe/aux_loss"], load_balancing_loss(stats, E).detach())


@pytest.mark.parametrize("k", [0, E + 1])
def test_block_rejects_top_k_above_the_expert_count(k):
    with pytest.raises(ValueError, match=r"'num_experts_per_tok' is .*; expected an integer in \[1, num_experts = 6\]"):
        SparseMoeBlock(hidden_size=D, moe_intermediate_size=I, num_experts=E, top_k=k, norm_topk_prob=True)


def test_per_expert_layout_round_trip_and_errors():
    _, ours = _pair(torch.float32, seed=6)
    gu, dn = ours.experts.gate_up_proj.detach(), ours.experts.down_proj.detach()
    flat = split_expert_tensors("mlp.", gu, dn)
    assert len(flat) == 3 * E and flat["mlp.experts.2.up_proj.weight"].shape == (I, D)
    fused = fuse_expert_tensors(flat.get, "mlp.", E, D, I)
    assert torch.equal(fused["mlp.experts.gate_up_proj"], gu) and torch.equal(fused["mlp.experts.down_proj"], dn)
    missing = {k: v for k, v in flat.items() if k != "mlp.experts.4.down_proj.weight"}
    with pytest.raises(ValueError, match=r"missing tensor 'mlp.experts.4.down_proj.weight' \(expert 4 of num_experts = 6\)"):
        fuse_expert_tensors(missing.get, "mlp.", E, D, I)
    bad = {**flat, "mlp.experts.1.gate_proj.weight": torch.zeros(I + 1, D)}
    with pytest.raises(ValueError, match=r"tensor 'mlp.experts.1.gate_proj.weight' has shape \(25, 48\), the config expects \(24, 48\)"):
        fuse_expert_tensors(bad.get, "mlp.", E, D, I)
