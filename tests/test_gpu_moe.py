"""GPU checks of the MoE kernels at a Qwen3-30B-A3B layer's shape (D 2048, 128 experts of
width 768, top-8), bf16, compiled Triton:
  * the experts MLP (forward, dx, both weight gradients, the routing weights' gradient)
    no worse than the eager per-expert reference against a float64 gold result, up to a
    rounding or two;
  * batch invariance in exact numerics: a prefix, a single token and a permutation of
    the batch give the same bits (routing and output);
  * each expert's rows of the grouped GEMM equal the exact linear's bits;
  * the routed forward captures in a CUDA graph (no host sync) and replays to eager's bits.
Qwen3.5-MoE's block (`SparseMoeBlock` with a gated shared expert) at Qwen3.5-35B-A3B's shape
(D 2048, 256 experts of width 512, top-8, shared expert 512), bf16:
  * output and every gradient (router, experts, shared expert and its gate, dx) no worse
    than transformers' `Qwen3_5MoeSparseMoeBlock` in bf16 against the same block in float64;
  * batch invariance in exact numerics, and CUDA-graph capture;
  * `rlfuse check --tiny --hybrid --moe --numerics exact` (the tiny Qwen3.5-MoE) reads 100%.

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_moe.py
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from rlfuse.cli import main
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.linear import linear
from rlfuse.kernels.linear.triton_gemm import linear_exact_triton
from rlfuse.kernels.moe import experts_mlp, grouped_linear, route
from rlfuse.model import ModelConfig
from rlfuse.model.arch.qwen3_5_moe import moe_with_shared_expert, tiny_hybrid_moe_fields

pytestmark = pytest.mark.gpu

D, I, E, K, T = 2048, 768, 128, 8, 384


def _weights(seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    router = torch.randn(E, D, device="cuda", generator=g) * 0.02
    gate_up = torch.randn(E, 2 * I, D, device="cuda", generator=g) * 0.02
    down = torch.randn(E, D, I, device="cuda", generator=g) * 0.02
    return [t.to(dtype) for t in (router, gate_up, down)]


def _x(n, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, D, device="cuda", generator=g).bfloat16()


def _moe(x, router, gate_up, down):
    r = route(linear(x, router), K, True)
    return experts_mlp(x, gate_up, down, r), r


def _per_expert(x, gate_up, down, r, dtype):
    """The experts MLP computed per expert in `dtype` with eager ops (reference or gold)."""
    xs = x.to(dtype)[r.order // K]
    out_rows = torch.zeros(xs.shape[0], D, dtype=dtype, device=x.device)
    for e, (a, b) in enumerate(zip(r.offsets[:-1].tolist(), r.offsets[1:].tolist())):
        if b > a:
            h = xs[a:b] @ gate_up[e].to(dtype).t()
            out_rows[a:b] = (F.silu(h[:, :I]) * h[:, I:]) @ down[e].to(dtype).t()
    w = r.weights.to(dtype)
    return (w[:, :, None] * out_rows[r.slot_pos]).sum(1)


def test_experts_mlp_no_worse_than_eager():
    router, gate_up, down = _weights()
    x = _x(T)
    dout = _x(T, seed=2)
    leaves = [x, gate_up, down]
    with use_backend("triton"), use_numerics("exact"):
        r = route(linear(x, router), K, True)
    weights = r.weights.detach().clone().requires_grad_()
    r = type(r)(weights, r.experts, r.order, r.offsets, r.slot_pos)

    def run(fn, dtype):
        ins = [t.detach().to(dtype).requires_grad_() for t in leaves]
        w = weights.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
        rr = type(r)(w, r.experts, r.order, r.offsets, r.slot_pos)
        out = fn(ins[0], ins[1], ins[2], rr)
        return [out, *torch.autograd.grad(out, [*ins, w], dout.to(out.dtype))]

    with use_backend("triton"), use_numerics("exact"):
        ours = run(experts_mlp, torch.bfloat16)
    ref = run(lambda a, b, c, rr: _per_expert(a, b, c, rr, torch.bfloat16), torch.bfloat16)
    gold = run(lambda a, b, c, rr: _per_expert(a, b, c, rr, torch.float64), torch.float64)
    for name, o, rf, gd in zip(("out", "dx", "d gate_up", "d down", "d weights"), ours, ref, gold):
        err = (o.double() - gd).abs().max().item()
        err_ref = (rf.double() - gd).abs().max().item()
        scale = gd.abs().max().item()
        assert err <= 2 * err_ref + 1.6e-2 * scale, (name, err, err_ref, scale)


def test_batch_invariance_in_exact_numerics():
    params = _weights()
    x = _x(T)
    perm = torch.randperm(T, device="cuda")
    with torch.no_grad(), use_backend("triton"), use_numerics("exact"):
        full, r = _moe(x, *params)
        for n in (1, 7, 64):
            part, rp = _moe(x[:n], *params)
            assert torch.equal(rp.experts, r.experts[:n]) and torch.equal(part, full[:n]), n
        one, _ = _moe(x[100:101], *params)
        assert torch.equal(one, full[100:101])
        assert torch.equal(_moe(x[perm], *params)[0], full[perm])


def test_grouped_rows_equal_the_exact_linear():
    _, gate_up, _ = _weights()
    x = _x(T)
    offsets = torch.tensor([0] + [T // 4] * 64 + [T // 2] * 63 + [T], device="cuda")  # experts 0, 64, 127 hold rows
    with torch.no_grad(), use_backend("triton"), use_numerics("exact"):
        y = grouped_linear(x, gate_up, offsets)
        for e in (0, 64, 127):
            a, b = offsets[e].item(), offsets[e + 1].item()
            assert torch.equal(y[a:b], linear_exact_triton(x[a:b], gate_up[e])), e


def test_routed_forward_captures_in_a_cuda_graph():
    params = _weights()
    x = _x(64)
    with torch.no_grad(), use_backend("triton"), use_numerics("exact"):
        eager, _ = _moe(x, *params)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up (compiles) outside the capture
            _moe(x, *params)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured, _ = _moe(x, *params)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, eager)


# ------------------------------------------------------------------ Qwen3.5-MoE's block
Q35 = dict(hidden_size=2048, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=256,
           num_experts_per_tok=8)


def _q35_blocks(seed=0):
    """(ours bf16, transformers' bf16, transformers' float64) with the same random weights."""
    import transformers

    cfg = transformers.Qwen3_5MoeTextConfig(**Q35, num_hidden_layers=1, vocab_size=256, num_attention_heads=2,
                                            num_key_value_heads=1, head_dim=64)
    hf = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeSparseMoeBlock(cfg).cuda()
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, device="cuda", generator=g) * (0.5 if name == "gate.weight" else 0.02))

    moe = {k: v for k, v in Q35.items() if k != "hidden_size"} | {"norm_topk_prob": True}
    ours = moe_with_shared_expert(ModelConfig(**tiny_hybrid_moe_fields(hidden_size=Q35["hidden_size"], moe=moe)), 0)
    ours.cuda().load_state_dict(hf.state_dict())
    gold = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeSparseMoeBlock(cfg).cuda()
    gold.load_state_dict(hf.state_dict())
    return ours.bfloat16(), hf.bfloat16(), gold.double()


def test_qwen3_5_moe_block_no_worse_than_transformers():
    ours, hf, gold = _q35_blocks()
    x = _x(T)
    dout = _x(T, seed=2)

    def run(block, dtype):
        xi = x.detach().to(dtype).requires_grad_()
        block.zero_grad(set_to_none=True)
        out = block(xi[None])[0]
        out.backward(dout.to(dtype))
        return {"out": out.detach(), "dx": xi.grad, **{n: p.grad for n, p in block.named_parameters()}}

    with use_backend("triton"), use_numerics("exact"):
        mine = run(ours, torch.bfloat16)
    ref, want = run(hf, torch.bfloat16), run(gold, torch.float64)
    for name, gd in want.items():
        err = (mine[name].double() - gd).abs().max().item()
        err_ref = (ref[name].double() - gd).abs().max().item()
        scale = gd.abs().max().item()
        assert err <= 2 * err_ref + 1.6e-2 * scale, (name, err, err_ref, scale)


def test_qwen3_5_moe_block_batch_invariant_and_graph_captured():
    ours, _, _ = _q35_blocks()
    x = _x(T)
    with torch.no_grad(), use_backend("triton"), use_numerics("exact"):
        full = ours(x)
        for n in (1, 7, 64):
            assert torch.equal(ours(x[:n]), full[:n]), n
        perm = torch.randperm(T, device="cuda")
        assert torch.equal(ours(x[perm]), full[perm])
        xs = x[:64].clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ours(xs)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ours(xs)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, full[:64])


def test_check_tiny_hybrid_moe_on_the_gpu(tmp_path, capsys):
    """`rlfuse check --tiny --hybrid --moe --numerics exact` with its GPU defaults."""
    rc = main(["check", "--tiny", "--hybrid", "--moe", "--numerics", "exact", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((tmp_path / "check.json").read_text())
    assert all(row["bitwise_frac"] == 1.0 and row["tokens"] > 0 for row in report["settings"]), out
