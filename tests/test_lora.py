"""LoRA: the op (`rlfuse.kernels.linear.lora`, `rlfuse.kernels.linear.triton_lora`), the adapters on the
model (`rlfuse.model.lora`), PEFT folders in and out (`rlfuse.model.lora_peft`), and the
engine running them.

  * op: batch-invariant in exact numerics (torch reference; Triton under the interpreter),
    the torch-backend path is `lora_linear_ref` bitwise, the Triton kernel's fused and split
    plans and tile families agree bitwise; forward and gradients against an fp64 gold with
    one tolerance row per dtype, and no worse than PEFT's own layer in the same dtype;
  * model: forward and gradients equal transformers+PEFT on the same weights (fp32),
    base frozen (no gradient), adapters off = the base model bitwise;
  * PEFT: an adapter PEFT saved loads here with PEFT's logits; ours loads in PEFT with our
    logits; the merged export loads in transformers with the same logits;
  * engine: rollout log-probs == trainer log-probs bitwise in exact numerics with adapters
    over the `rlfuse check` sweep, and after an in-place adapter update in the same engine
    (CUDA graphs: the gpu-marked twin); adapters switched off = the base model.
Run: python -m pytest -q tests/test_lora.py
"""

import json

import peft
import pytest
import torch
import transformers
from engine_helpers import (
    one_thread,  # noqa: F401 (fixture)
    random_prompts,
    tiny_model,
)
from test_model import _hf_logits, _loss, _ours_logits, _seqs
from tiny_hf import FAMILIES, hf_model, rel_err
from torch import nn

from rlfuse.cli import main
from rlfuse.consistency.check import default_sweep, run_setting, trainer_logprobs
from rlfuse.engine import LLM, EngineConfig, SamplingParams
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.linear.lora import lora_linear, lora_linear_ref
from rlfuse.model import load_model
from rlfuse.model.lora import (
    BaseModelView,
    LoRAConfig,
    adapters_off,
    attach_lora,
    init_lora_,
    lora_memory,
    lora_modules,
    lora_parameters,
)
from rlfuse.model.lora_peft import load_peft_adapter, read_peft_config, save_merged, save_peft_adapter

# Relative error (2-norm) against the fp64 gold, per dtype: a few roundings of O(1) values
# (fp32 2^-24, fp16 2^-11, bf16 2^-8), and ours must also be within 1.5x PEFT's own error
# in the same dtype (+ the same slack) -- PEFT runs the same four rounded steps.
GOLD_TOL = {torch.float32: 4 * 2 ** -24, torch.float16: 4 * 2 ** -11, torch.bfloat16: 4 * 2 ** -8}
GRAD_TOL = {torch.float32: 1e-6, torch.float16: 4 * 2 ** -11, torch.bfloat16: 4 * 2 ** -8}
FP32_MODEL_TOL = 1e-5  # as tests/test_model.py: ours vs transformers, fp32 logits and gradients


def _op_inputs(dtype, M=37, K=48, N=40, r=4, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s, a=0.1: (a * torch.randn(*s, generator=g)).to(dtype)  # noqa: E731
    return t(M, K, a=1.0), t(N, K), (t(N) if bias else None), t(r, K), t(N, r)


def _gold(x, w, b, a, bb, s):
    x, w, a, bb = (v.double() for v in (x, w, a, bb))
    y = x @ w.T + s * (x @ a.T) @ bb.T
    return y if b is None else y + b.double()


# ------------------------------------------------------------------ the op
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_exact_lora_linear_is_batch_invariant(backend, dtype, bias):
    x, w, b, a, bb = _op_inputs(dtype, bias=bias)
    with use_backend(backend), use_numerics("exact"):
        full = lora_linear(x, w, b, a, bb, 2.0)
        for k in (1, 3, 16, 36):
            assert torch.equal(lora_linear(x[:k], w, b, a, bb, 2.0), full[:k]), k
        assert torch.equal(lora_linear(x[:36].view(4, 9, -1), w, b, a, bb, 2.0).view(36, -1), full[:36])
        for k in (1, 3, 16, 36):  # rows moved within a tile
            assert torch.equal(lora_linear(x[k:], w, b, a, bb, 2.0), full[k:]), k
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))
        assert torch.equal(lora_linear(x[perm], w, b, a, bb, 2.0), full[perm])
    if backend == "torch":
        assert torch.equal(full, lora_linear_ref(x, w, b, a, bb, 2.0))
    assert rel_err(full, _gold(x, w, b, a, bb, 2.0)) < GOLD_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_lora_plans_and_tile_families_agree_bitwise(dtype):
    """The fused base + expand GEMM: fused and split plans, narrow and wide tiles (16-bit),
    the same bits; K spans several chunks with a ragged tail, the rank is not a power of 2."""
    from rlfuse.kernels.linear.triton_gemm import EXACT_BLOCK_K, EXACT_CHUNK_K
    from rlfuse.kernels.linear.triton_lora import lora_expand_triton
    x, w, b, a, bb = _op_inputs(dtype, M=70, K=600, N=48, r=5, seed=4)
    z = (x.float() @ a.float().T).to(dtype)
    fused = lora_expand_triton(x, w, b, z, bb, 1.5, plan="fused")
    assert torch.equal(lora_expand_triton(x, w, b, z, bb, 1.5, plan="split"), fused)
    for k in (1, 5, 33):
        assert torch.equal(lora_expand_triton(x[k:], w, b, z[k:], bb, 1.5, plan="split"), fused[k:])
    if dtype == torch.bfloat16:
        narrow = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=EXACT_BLOCK_K, CHUNK_K=EXACT_CHUNK_K, num_warps=4,
                      num_stages=3)
        wide = dict(narrow, BLOCK_M=128, BLOCK_N=128, num_warps=8)
        assert torch.equal(lora_expand_triton(x, w, b, z, bb, 1.5, tiles=wide, plan="fused"), fused)
        assert torch.equal(lora_expand_triton(x, w, b, z, bb, 1.5, tiles=narrow, plan="split"), fused)
    gold = x.double() @ w.double().T + b.double() + 1.5 * z.double() @ bb.double().T  # z as given
    assert rel_err(fused, gold) < GOLD_TOL[dtype]


def _peft_layer(w, b, a, bb, scale, dtype):
    """PEFT's LoRA layer on an nn.Linear holding the same weights."""
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)

    m = Holder()
    r = a.shape[0]
    m = peft.inject_adapter_in_model(peft.LoraConfig(r=r, lora_alpha=scale * r, target_modules=["proj"]), m)
    with torch.no_grad():
        m.proj.base_layer.weight.copy_(w)
        if b is not None:
            m.proj.base_layer.bias.copy_(b)
        m.proj.lora_A["default"].weight.copy_(a)
        m.proj.lora_B["default"].weight.copy_(bb)
    m = m.to(dtype)
    return m.proj, (m.proj.lora_A["default"].weight, m.proj.lora_B["default"].weight)


@pytest.mark.parametrize("numerics, backend", [("fast", "torch"), ("exact", "torch"), ("exact", "triton")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lora_linear_forward_and_grads_vs_gold_and_peft(numerics, backend, dtype):
    x, w, b, a, bb = _op_inputs(dtype, seed=2)
    layer, (pa, pb) = _peft_layer(w, b, a, bb, 2.0, dtype)
    xs = [x.clone().requires_grad_(True) for _ in range(3)]
    a_, bb_ = a.clone().requires_grad_(True), bb.clone().requires_grad_(True)
    dy = torch.randn(x.shape[0], w.shape[0], generator=torch.Generator().manual_seed(3))
    with use_backend(backend), use_numerics(numerics):
        y = lora_linear(xs[0], w, b, a_, bb_, 2.0)
    yp = layer(xs[1])
    x64, a64, b64 = (v.detach().double().requires_grad_(True) for v in (x, a, bb))
    y64 = x64 @ w.double().T + b.double() + 2.0 * (x64 @ a64.T) @ b64.T
    (y * dy.to(dtype)).sum().backward()
    (yp * dy.to(dtype)).sum().backward()
    (y64 * dy.to(dtype).double()).sum().backward()
    ours, theirs = rel_err(y, y64), rel_err(yp, y64)
    assert ours < GOLD_TOL[dtype] and ours <= 1.5 * theirs + GOLD_TOL[dtype] / 4, (ours, theirs)
    for name, g_ours, g_peft, g_gold in (("x", xs[0].grad, xs[1].grad, x64.grad), ("A", a_.grad, pa.grad, a64.grad),
                                         ("B", bb_.grad, pb.grad, b64.grad)):
        e, ep = rel_err(g_ours, g_gold), rel_err(g_peft, g_gold)
        assert e < GRAD_TOL[dtype] and e <= 1.5 * ep + GRAD_TOL[dtype] / 4, (name, e, ep)


def test_lora_linear_rejects_mismatched_shapes_and_dtypes():
    x, w, b, a, bb = _op_inputs(torch.float32)
    with pytest.raises(ValueError, match="expected weight"):
        lora_linear(x, w, b, a.T, bb, 1.0)
    with pytest.raises(ValueError, match="one dtype"):
        lora_linear(x, w, b, a.bfloat16(), bb, 1.0)


# ------------------------------------------------------------------ the model vs transformers + PEFT
@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    hf = hf_model(request.param, seed=FAMILIES.index(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return request.param, hf, folder


def _randomize_adapters(model, seed=5):
    """B = 0 after init leaves the model unchanged: draw B too, so a wrong adapter shows."""
    init_lora_(model, seed, b_std=0.2)


def test_peft_adapter_loads_with_peft_logits_and_grads(pair, tmp_path):
    family, hf, folder = pair
    pcfg = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"],
                           init_lora_weights=False, task_type="CAUSAL_LM")
    pm = peft.get_peft_model(hf, pcfg)  # init_lora_weights=False: B is random too
    pm.save_pretrained(tmp_path / "adapter")
    ours = load_model(folder, dtype="float32")
    cfg = load_peft_adapter(ours, tmp_path / "adapter")
    assert (cfg.rank, cfg.alpha, cfg.targets) == (4, 12, ("q_proj", "v_proj", "down_proj"))
    assert len(lora_modules(ours)) == 3 * hf.config.num_hidden_layers
    seqs = _seqs(hf.config.vocab_size, seed=4)
    with use_backend("torch"):
        loss = _loss(_ours_logits(ours, seqs), seqs)
        loss.backward()
    theirs = _hf_logits(pm, seqs)
    _loss(theirs, seqs).backward()
    with torch.no_grad(), use_backend("torch"):
        assert rel_err(_ours_logits(ours, seqs), theirs) < FP32_MODEL_TOL
    peft_params = dict(pm.named_parameters())
    for name, p in lora_parameters(ours):
        g = peft_params[f"base_model.model.{name}.default.weight"].grad
        assert p.grad is not None and rel_err(p.grad, g) < FP32_MODEL_TOL, name
    # frozen base: no gradient, nothing but A and B trainable
    assert all(p.grad is None and not p.requires_grad for n, p in ours.named_parameters() if ".lora_" not in n)
    pm.unload()  # leave the shared transformers model as it was


def test_our_adapter_and_merged_export_load_in_transformers(pair, tmp_path):
    family, hf, folder = pair
    ours = load_model(folder, dtype="float32")
    cfg = LoRAConfig(rank=3, alpha=5.0)
    attach_lora(ours, cfg)
    _randomize_adapters(ours)
    save_peft_adapter(ours, tmp_path / "adapter")
    seqs = _seqs(hf.config.vocab_size, seed=6)
    with torch.no_grad(), use_backend("torch"):
        mine = _ours_logits(ours, seqs)
        with adapters_off(ours):
            base_mine = _ours_logits(ours, seqs)
    with torch.no_grad():
        pm = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter")
        assert rel_err(_hf_logits(pm, seqs), mine) < FP32_MODEL_TOL
        pm.unload()
        assert rel_err(_hf_logits(hf, seqs), base_mine) < FP32_MODEL_TOL
        assert rel_err(mine, base_mine) > 1e-2  # the adapter matters
    save_merged(ours, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert rel_err(_hf_logits(merged.eval(), seqs), mine) < FP32_MODEL_TOL
    # the exported folder reads back as the same config, and loads here with the same logits
    again = load_model(folder, dtype="float32")
    assert load_peft_adapter(again, tmp_path / "adapter") == LoRAConfig(rank=3, alpha=5.0,
                                                                         path=str(tmp_path / "adapter"))
    with torch.no_grad(), use_backend("torch"):
        assert torch.equal(_ours_logits(again, seqs), mine)


# ------------------------------------------------------------------ adapters on our model
def test_attach_freezes_the_base_and_adapters_off_is_the_base_model_bitwise():
    model = tiny_model(dtype=torch.bfloat16)
    ids = torch.tensor(random_prompts([9, 5])[0] + random_prompts([9, 5])[1])
    pos = torch.cat([torch.arange(9), torch.arange(5)])
    from rlfuse.model import Packed
    attn = Packed.from_lengths([9, 5])
    with torch.no_grad(), use_numerics("exact"), use_backend("torch"):
        before = model(ids, pos, attn)
        names = attach_lora(model, LoRAConfig(rank=2, targets=["q_proj", "v_proj"]))
        assert torch.equal(model(ids, pos, attn), before)  # B = 0: a fresh adapter changes nothing
        _randomize_adapters(model)
        on = model(ids, pos, attn)
        with adapters_off(model):
            assert torch.equal(model(ids, pos, attn), before)
        assert torch.equal(BaseModelView(model).eval()(ids, pos, attn), before)
        assert torch.equal(model(ids, pos, attn), on) and not torch.equal(on, before)
    assert names == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [n for n, _ in lora_parameters(model)] and len(trainable) == 8
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    mem = lora_memory(model)
    assert mem["lora/trainable_params"] == sum(p.numel() for _, p in lora_parameters(model))
    assert mem["lora/saved_train_state_gib"] > 0
    with pytest.raises(ValueError, match="already has LoRA"):
        attach_lora(model, LoRAConfig())


@pytest.mark.parametrize("bad, match", [(dict(rank=0), "lora.rank"), (dict(alpha=-1.0), "lora.alpha"),
                                        (dict(dropout=1.0), "lora.dropout"), (dict(targets="all"), "lora.targets"),
                                        (dict(targets=["q_proj", "lm_head"]), "unknown projection"),
                                        (dict(targets=[]), "non-empty")])
def test_config_errors_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(**bad)


def test_peft_folder_errors(tmp_path):
    model = tiny_model()
    cfg = LoRAConfig(rank=2)
    attach_lora(model, cfg)
    save_peft_adapter(model, tmp_path / "a")
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_peft_config(tmp_path)
    d = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**d, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora = True is not supported"):
        read_peft_config(tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="lora.rank = 4 but the adapter"):
        load_peft_adapter(tiny_model(), tmp_path / "a", LoRAConfig(rank=4))
    assert load_peft_adapter(tiny_model(), tmp_path / "a", LoRAConfig(dropout=0.1)).dropout == 0.1


# ------------------------------------------------------------------ the engine with adapters
PROMPT_LENS = [14, 30, 33, 7, 40, 3, 18, 9]


def _lora_model(dtype):
    model = tiny_model(dtype=dtype)
    attach_lora(model, LoRAConfig(rank=4))
    _randomize_adapters(model)
    return model


def _sweep(tokens):
    """`rlfuse check`'s sweep (as tests/test_exact_engine.py sizes it): {name: Setting}."""
    need = max(PROMPT_LENS[:2]) + tokens
    return {s.name: s for s in default_sweep(8, small_pool_blocks=2 * -(-need // 16), chunk_tokens=16)}


def test_exact_rollout_equals_trainer_with_lora_bf16():
    """The sweep in bf16 (fp32: `rlfuse check --tiny --lora-rank` below)."""
    model = _lora_model(torch.bfloat16)
    prompts = random_prompts(PROMPT_LENS)
    with use_backend("torch"):
        for s in _sweep(12).values():
            r = run_setting(model, prompts, s, numerics="exact", max_tokens=12, temperature=1.0)
            assert r.bitwise_frac == 1.0 and r.max_abs == 0.0, (s.name, r.row(), r.first_diff)
        # an optimizer-like in-place update of the adapters is seen by the next rollout
        with torch.no_grad():
            for _, p in lora_parameters(model):
                p.mul_(1.5)
        r2 = run_setting(model, prompts, _sweep(12)["combined"], numerics="exact", max_tokens=12, temperature=1.0)
        assert r2.bitwise_frac == 1.0, (r2.row(), r2.first_diff)
        assert r2.sequences != r.sequences  # the update changed the rollouts


def test_check_cli_with_a_random_adapter(tmp_path, capsys):
    rc = main(["check", "--tiny", "--lora-rank", "4", "--numerics", "exact", "--max-batch", "4", "--max-tokens", "6",
               "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr()
    report = json.loads((tmp_path / "check.json").read_text())
    # the 8 single-turn settings and the multi-turn row, each with the adapter on
    assert report["adapter"] == "random rank 4" and len(report["settings"]) == 13
    assert all(row["bitwise_frac"] == 1.0 and row["tokens"] > 0 for row in report["settings"])
    assert "LoRA on 14 projections" in capsys.readouterr().out


def test_exact_rollout_equals_trainer_with_lora_triton():
    model = _lora_model(torch.float32)
    with use_backend("triton"):
        r = run_setting(model, random_prompts(PROMPT_LENS), _sweep(4)["batch 1"], numerics="exact", max_tokens=4,
                        temperature=0.8)
    assert r.bitwise_frac == 1.0, (r.row(), r.first_diff)


def test_engine_follows_the_adapter_switch():
    """One engine, static decode buffers and the prefix cache on: generating with adapters
    off gives the base model's tokens and log-probs (cache and graphs dropped on the
    switch), and back on gives the adapted model's again."""
    base = tiny_model()
    model = _lora_model(torch.float32)
    prompts = random_prompts([12, 12])
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)
    cfg = EngineConfig(max_num_seqs=4, numerics="exact", seed=0)

    def rows(outs):
        return [(list(o.output_token_ids), o.logprobs.tolist()) for o in outs]

    def run(m):
        return rows(LLM(m, config=cfg).generate(prompts, params))

    with use_backend("torch"):
        want_base, want_lora = run(base), run(model)
        llm = LLM(model, config=cfg)
        first = rows(llm.generate(prompts, params))
        with adapters_off(model):
            off = rows(llm.generate(prompts, params))
        back = rows(llm.generate(prompts, params))
    assert first == want_lora and back == want_lora
    assert off == want_base and off != want_lora


def test_gradient_checkpointing_and_dropout_with_adapters():
    """Activation checkpointing recomputes the adapters' forward in backward: the same A, B
    gradients. Dropout acts in training forwards that record gradients only."""
    from rlfuse.model import Packed
    model = tiny_model()
    attach_lora(model, LoRAConfig(rank=2, dropout=0.5))
    _randomize_adapters(model)
    ids = torch.tensor(random_prompts([11])[0])
    pos, attn = torch.arange(11), Packed.from_lengths([11])
    model.eval()
    with torch.no_grad():
        want = model(ids, pos, attn)
    model.train()
    with torch.no_grad():  # e.g. a rollout on a model left in train mode: no dropout
        assert torch.equal(model(ids, pos, attn), want)
    assert not torch.equal(model(ids, pos, attn), want)  # a training forward drops
    model.eval()  # no dropout: compare gradients with and without checkpointing
    grads = []
    for ckpt in (False, True):
        model.gradient_checkpointing = ckpt
        model.zero_grad(set_to_none=True)
        with use_numerics("exact"), use_backend("torch"):
            model(ids, pos, attn).square().sum().backward()
        grads.append([p.grad.clone() for _, p in lora_parameters(model)])
        assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _one_engine_sees_in_place_updates(device, dtype, backend):
    """One engine (decode graphs on CUDA, static buffers on the CPU) generates, A and B are
    updated in place (as the optimizer does), it generates again: both rollouts equal the
    trainer's log-probs bitwise, the update changed them, and no graph was re-captured."""
    model = tiny_model(dtype=dtype, device=device)
    attach_lora(model, LoRAConfig(rank=8))
    _randomize_adapters(model)
    prompts = random_prompts(PROMPT_LENS)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=3, ignore_eos=True)
    rolls = []
    with use_backend(backend):
        llm = LLM(model, config=EngineConfig(max_num_seqs=16, numerics="exact", seed=0))
        for step in range(2):
            outs = llm.generate(prompts, params)
            graphs = dict(llm.runner.graphs)
            seqs = [(list(o.prompt_token_ids), list(o.output_token_ids)) for o in outs]
            with use_numerics("exact"):
                train = trainer_logprobs(model, seqs, 1.0)
            assert all(torch.equal(t, o.logprobs) for t, o in zip(train, outs)), step
            rolls.append(seqs)
            with torch.no_grad():
                for n, p in lora_parameters(model):
                    if n.endswith("lora_B"):
                        p.neg_()
    assert rolls[0] != rolls[1]
    assert llm.stats.decode_steps > 0 and dict(llm.runner.graphs) == graphs  # the same graph objects
    if device == "cuda":
        assert llm.stats.graph_steps > 0


def test_one_engine_sees_in_place_adapter_updates():
    _one_engine_sees_in_place_updates("cpu", torch.float32, "torch")


@pytest.mark.gpu
def test_cuda_graphs_see_in_place_adapter_updates_gpu():
    _one_engine_sees_in_place_updates("cuda", torch.bfloat16, "triton")


def test_critic_from_a_lora_policy_copies_the_base_trunk():
    from rlfuse.model.scalar_head import ScalarHeadModel
    base = ScalarHeadModel.from_causal_lm(tiny_model())
    policy = _lora_model(torch.float32)
    critic = ScalarHeadModel.from_causal_lm(policy)
    assert all(torch.equal(a, b) for a, b in zip(critic.state_dict().values(), base.state_dict().values()))
