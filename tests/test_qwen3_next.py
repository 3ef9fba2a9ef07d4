"""Qwen3-Next (Qwen3.5's hybrid layers with in_proj_qkvz / in_proj_ba fused per key head;
MoE blocks with a shared expert on the layers decoder_sparse_step / mlp_only_layers make
sparse, dense MLPs on the others) against transformers' Qwen3NextForCausalLM on a tiny
random model (tests/tiny_hf.py QWEN3_NEXT: layers 0, 2, 3 MoE, layer 1 dense, the top-k
weights not renormalized), CPU:

  * config round trip, parameter names and shapes equal transformers', for two layer rules;
  * the fused projections' de-interleave: our mixer equals Qwen3.5's unfused one given the
    same weights split apart (so only the layout differs from the tested Qwen3.5 path);
  * fp32: logits of a packed batch, the loss with the load-balancing term, and the gradient
    of every parameter equal transformers'; norm_topk_prob true gives transformers' logits;
  * bf16: logits and every gradient of the loss no worse than transformers' own bf16 against the
    fp32 gold (tests/test_qwen3_5.py's rule);
  * folders: ours saved loads in transformers with the same tensors and logits; a folder
    with MTP weights loads without them;
  * bad config: one line naming the field;
  * exact numerics: the engine's rollout log-probs equal the trainer's bitwise
    (`rlfuse check`'s settings, torch references);
  * LoRA on the fused projections (by their HF names) and every expert, exported as a PEFT
    folder that PEFT applies;
  * `rlfuse check --tiny --next` builds this family; its whole sweep reads 100% bitwise (slow on
    the CPU, ~2 min; GPU: with its GPU defaults);
  * GPU: bf16 at the 80B-A3B's widths no worse than transformers (compiled Triton kernels).
Fp32 parity runs under use_backend("torch") (the readable references).
Run: python -m pytest -q tests/test_qwen3_next.py  (GPU: python -m pytest -m gpu tests/test_qwen3_next.py)
"""

import argparse
import json
import logging

import peft
import pytest
import torch
import transformers
from engine_helpers import random_prompts
from parity import check_routed_grads
from parity import hf_logits as _hf_logits
from parity import next_token_ce as _ce
from parity import packed_logits as _ours_logits
from safetensors.torch import load_file, save_file
from tiny_hf import QWEN3_NEXT, qwen3_next_model, rel_err

from rlfuse.cli import check, main
from rlfuse.consistency.check import default_sweep, run_setting
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.model import CausalLM, ModelConfig, Packed, load_model, save_model
from rlfuse.model.arch.qwen3_5 import tiny_hybrid_fields
from rlfuse.model.arch.qwen3_next import tiny_next_fields
from rlfuse.model.layers import MLP, FusedGatedDeltaNet, GatedDeltaNet
from rlfuse.model.layers.moe import SparseMoeBlock, moe_blocks
from rlfuse.model.lora import LoRAConfig, attach_lora, init_lora_, lora_modules
from rlfuse.model.lora_peft import read_peft_config, save_peft_adapter

LENS = [5, 70, 11]
FP32_TOL = 1e-4
BF16_VS_GOLD_FACTOR = 1.5  # tests/test_model.py's bf16 rule
E = QWEN3_NEXT["num_experts"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = qwen3_next_model(seed=0)
    folder = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(folder)
    ours = load_model(folder, dtype="float32")
    for b in moe_blocks(ours):  # the router losses' stats (as output_router_logits: true would)
        b.record_stats = True
    return hf, folder, ours


def _seqs(seed, lens=LENS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, QWEN3_NEXT["vocab_size"], (n,), generator=g) for n in lens]


def test_config_and_parameter_names_are_transformers(pair):
    hf, _, ours = pair
    c = ours.config
    assert c.model_type == "qwen3_next" and c.is_hybrid and c.intermediate_size == QWEN3_NEXT["intermediate_size"]
    assert c.moe.mlp_only_layers == (1,) and not c.moe.norm_topk_prob and c.moe.shared_expert_intermediate_size == 40
    assert ModelConfig.from_hf(c.to_hf()) == c
    assert type(transformers.AutoConfig.for_model(**c.to_hf())).__name__ == "Qwen3NextConfig"
    assert [type(layer.mlp) for layer in ours.model.layers] == [SparseMoeBlock, MLP, SparseMoeBlock, SparseMoeBlock]
    assert {n: tuple(p.shape) for n, p in ours.named_parameters()} == \
        {n: tuple(p.shape) for n, p in hf.named_parameters()}


def test_decoder_sparse_step_picks_the_layers_transformers_does():
    over = dict(decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=4)
    hf_cfg = transformers.Qwen3NextConfig(**{**QWEN3_NEXT, **over})
    ours = CausalLM(ModelConfig.from_hf(hf_cfg.to_dict()))
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert sparse == [type(layer.mlp).__name__ == "Qwen3NextSparseMoeBlock" for layer in hf.model.layers]
    assert sparse == [False, True, False, False]


def test_fused_projections_equal_the_unfused_mixer():
    """The de-interleave is a pure re-layout: the fused mixer, given in_proj_qkvz / in_proj_ba
    assembled from an unfused mixer's four weights, returns its bits in exact numerics (whose
    linear gives each output element the same bits whatever the GEMM's width; torch's CPU
    GEMM may round a (T, 12) product's columns otherwise than a (T, 6) one's)."""
    cfg = ModelConfig(**tiny_hybrid_fields(linear_num_key_heads=2, linear_num_value_heads=6))
    torch.manual_seed(0)
    plain, fused = GatedDeltaNet(cfg, 0), FusedGatedDeltaNet(cfg, 0)
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.3)
        Hk, Dk, Dv, r = 2, 16, 16, 3
        q, k, v = plain.in_proj_qkv.weight.split([Hk * Dk, Hk * Dk, Hk * r * Dv])
        z, b, a = plain.in_proj_z.weight, plain.in_proj_b.weight, plain.in_proj_a.weight
        per_head = lambda w, n: w.reshape(Hk, n, -1)  # noqa: E731  rows of key head h
        fused.in_proj_qkvz.weight.copy_(torch.cat([per_head(q, Dk), per_head(k, Dk), per_head(v, r * Dv),
                                                   per_head(z, r * Dv)], 1).reshape(-1, cfg.hidden_size))
        fused.in_proj_ba.weight.copy_(torch.cat([per_head(b, r), per_head(a, r)], 1).reshape(-1, cfg.hidden_size))
        for name in ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"):
            fused.get_parameter(name).copy_(plain.get_parameter(name))
        x = torch.randn(9, cfg.hidden_size)
        attn = Packed.from_lengths([4, 5])
        with use_backend("torch"):
            torch.testing.assert_close(fused(x, None, attn), plain(x, None, attn), rtol=1e-5, atol=1e-5)
            with use_numerics("exact"):
                assert torch.equal(fused(x, None, attn), plain(x, None, attn))


def test_fp32_logits_loss_with_aux_and_every_grad_match_transformers(pair):
    """One batch of same-length rows through transformers (its aux loss counts every row),
    the same rows packed through ours."""
    hf, _, ours = pair
    check_routed_grads(hf, ours, _seqs(1, lens=[33, 33]), QWEN3_NEXT["router_aux_loss_coef"], E, FP32_TOL)


def test_norm_topk_prob_true_gives_transformers_logits(tmp_path):
    hf = qwen3_next_model(seed=3, norm_topk_prob=True)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype="float32")
    assert ours.config.moe.norm_topk_prob
    seqs = _seqs(3, lens=[7, 20])
    with torch.no_grad(), use_backend("torch"):
        mine = _ours_logits(ours, seqs)
        assert rel_err(mine, _hf_logits(hf, seqs)) < 1e-5


def test_bf16_logits_loss_and_grads_no_worse_than_transformers(pair):
    _, folder, _ = pair
    bf16_no_worse_than_transformers(folder, "cpu", _seqs(2))


def test_saved_folder_loads_in_transformers_with_the_same_logits(pair, tmp_path):
    hf, _, ours = pair
    save_model(ours, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"] and cfg["mlp_only_layers"] == [1]
    names = load_file(tmp_path / "out" / "model.safetensors").keys()
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names
    assert "model.layers.3.mlp.experts.5.down_proj.weight" in names
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    assert type(back).__name__ == "Qwen3NextForCausalLM"
    want = hf.state_dict()
    for n, t in back.state_dict().items():
        assert torch.equal(t, want[n]), n
    seqs = _seqs(4, lens=[6, 40])
    with torch.no_grad(), use_backend("torch"):
        mine = _ours_logits(ours, seqs)
        assert rel_err(_hf_logits(back, seqs), mine) < 1e-5


def test_mtp_weights_are_skipped(pair, tmp_path, caplog):
    _, folder, ours = pair
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="rlfuse.model.weights"):
        again = load_model(tmp_path, dtype="float32")
    assert any("multi-token-prediction head" in r.getMessage() for r in caplog.records), caplog.text
    for (n, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(decoder_sparse_step=0), r"field 'decoder_sparse_step' must be a positive integer"),
    (lambda c: c.update(mlp_only_layers=[9]), r"field 'mlp_only_layers' holds \[9\]; expected layer indices"),
    (lambda c: c.pop("shared_expert_intermediate_size"), r"missing required field 'shared_expert_intermediate_size'"),
    (lambda c: c.pop("intermediate_size"), r"missing required field 'intermediate_size'"),
    (lambda c: c.update(linear_num_value_heads=3), r"field 'linear_num_value_heads' \(3\) must be a multiple of"),
    (lambda c: c.update(attn_output_gate=False), r"field 'attn_output_gate' is False"),
])
def test_bad_config_is_one_line_naming_the_field(pair, tmp_path, edit, message):
    _, folder, _ = pair
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message) as e:
        ModelConfig.from_hf(tmp_path)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


def tiny(dtype=torch.float32, seed=0) -> CausalLM:
    """`tiny_next_fields`' model, vocab 128, routers 5x wider."""
    m = CausalLM(ModelConfig(**tiny_next_fields(vocab_size=128)))
    m.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for b in moe_blocks(m):
            b.gate.weight.mul_(5)
    return m.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_rollout_log_probs_equal_the_trainers(dtype):
    """`rlfuse check`'s chunked-prefill and combined settings on the tiny Qwen3-Next, exact
    numerics, torch references: every sampled token's engine log-prob equals the trainer's."""
    m = tiny(dtype)
    prompts = random_prompts([14, 30, 33, 7, 40, 3])
    sweep = {s.name: s for s in default_sweep(6, small_pool_blocks=6, chunk_tokens=16)}
    with use_backend("torch"):
        for name in ("chunked prefill", "combined"):
            r = run_setting(m, prompts, sweep[name], numerics="exact", max_tokens=6, temperature=1.0)
            assert r.tokens > 0 and r.bitwise_frac == 1.0 and r.max_abs == 0.0, (name, r.row(), r.first_diff)


def test_lora_all_linear_adapts_the_fused_projections(pair):
    _, folder, _ = pair
    ours = load_model(folder, dtype="float32")
    attach_lora(ours, LoRAConfig(rank=2, alpha=4.0))
    names = dict(lora_modules(ours))
    assert {n.rsplit(".", 1)[-1] for n in names if ".linear_attn." in n} == {"in_proj_qkvz", "in_proj_ba", "out_proj"}
    assert "model.layers.1.mlp.gate_proj" in names and "model.layers.0.mlp.shared_expert.up_proj" in names


def test_lora_on_the_fused_projections_and_every_expert_loads_in_peft(pair, tmp_path):
    """Adapters on the attention, the fused in_proj_qkvz / in_proj_ba (transformers' and
    PEFT's names), out_proj and every routed expert, exported as a PEFT folder: PEFT +
    transformers apply it with our logits. (Not the dense or shared-expert MLPs: PEFT reads
    gate/up/down_proj targets of this family as the experts', `ArchSpec.peft_maps_mlp_targets`.)"""
    _, folder, _ = pair
    ours = load_model(folder, dtype="float32")
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj")
    attach_lora(ours, LoRAConfig(rank=2, alpha=4.0, experts=True, targets=targets))
    init_lora_(ours, seed=5, b_std=0.2)
    save_peft_adapter(ours, tmp_path / "adapter")
    assert set(read_peft_config(tmp_path / "adapter")[0].targets) == set(targets)
    seqs = _seqs(6, lens=[9, 30])
    with torch.no_grad(), use_backend("torch"):
        mine = _ours_logits(ours, seqs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        base = _hf_logits(hf, seqs)
        theirs = _hf_logits(peft.PeftModel.from_pretrained(hf, tmp_path / "adapter"), seqs)
    assert rel_err(theirs, mine) < 1e-5
    assert rel_err(base, mine) > 1e-2  # the adapters matter


def test_check_cli_next_flag(tmp_path, capsys):
    """`rlfuse check --tiny --next` builds the tiny Qwen3-Next (fast part: the model);
    with --hybrid it is refused in one line."""
    p = argparse.ArgumentParser()
    check.add_arguments(p)
    model, tok = check._model(p.parse_args(["--tiny", "--next"]), "cpu")
    assert model.config.model_type == "qwen3_next" and tok is None
    assert isinstance(model.model.layers[0].linear_attn, FusedGatedDeltaNet)
    assert main(["check", "--tiny", "--next", "--hybrid", "--out", str(tmp_path / "o")]) != 0
    assert "--next picks the tiny Qwen3-Next" in capsys.readouterr().err


@pytest.mark.slow
def test_check_cli_tiny_next_is_bitwise(tmp_path, capsys):
    """`rlfuse check --tiny --next` in exact numerics reads 100% in every setting (CPU, small sweep)."""
    rc = main(["check", "--tiny", "--next", "--numerics", "exact", "--max-batch", "4", "--max-tokens", "6",
               "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr()
    report = json.loads((tmp_path / "check.json").read_text())
    assert len(report["settings"]) >= 12
    assert all(r["bitwise_frac"] == 1.0 and r["tokens"] > 0 for r in report["settings"])


@pytest.mark.gpu
def test_check_tiny_next_on_the_gpu(tmp_path, capsys):
    """`rlfuse check --tiny --next --numerics exact` with its GPU defaults (compiled Triton)."""
    rc = main(["check", "--tiny", "--next", "--numerics", "exact", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((tmp_path / "check.json").read_text())
    assert all(row["bitwise_frac"] == 1.0 and row["tokens"] > 0 for row in report["settings"]), out


def test_a_published_config_reads(tmp_path):
    """Qwen3-Next-80B-A3B's config.json (transformers 4.57's layout: rope_theta and
    partial_rotary_factor at the top level, full_attention_interval, no layer_types)."""
    published = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_bias": False,
        "decoder_sparse_step": 1, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
        "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 512,
        "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10,
        "num_hidden_layers": 48, "num_key_value_heads": 2, "output_router_logits": False,
        "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936}
    (tmp_path / "config.json").write_text(json.dumps(published))
    c = ModelConfig.from_hf(tmp_path)
    assert c.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",) and len(c.layer_types) == 48
    assert (c.rotary_dim, c.rope_theta, c.moe.num_experts, c.moe.norm_topk_prob) == (64, 1e7, 512, True)
    assert all(c.moe.is_sparse(i) for i in range(48))
    back = transformers.AutoConfig.for_model(**c.to_hf())
    assert back.layer_types == list(c.layer_types) and back.rope_parameters["partial_rotary_factor"] == 0.25


def bf16_no_worse_than_transformers(folder, device: str, seqs) -> None:
    """The bf16 rule of `test_bf16_logits_loss_and_grads_no_worse_than_transformers` for the
    folder's model on `device` (our kernels: the device's default backend)."""
    seqs = [s.to(device) for s in seqs]
    load = lambda dt: transformers.Qwen3NextForCausalLM.from_pretrained(  # noqa: E731
        folder, dtype=dt, attn_implementation="eager").to(device).eval()
    gold_model, hf16 = load(torch.float32), load(torch.bfloat16)
    ours16 = load_model(folder, device=device, dtype="bfloat16")
    gold, theirs, mine = _hf_logits(gold_model, seqs), _hf_logits(hf16, seqs), _ours_logits(ours16, seqs).float()
    for logits in (gold, theirs, mine):
        _ce(logits, seqs).backward()
    err_hf, err_ours = rel_err(theirs, gold), rel_err(mine, gold)
    assert err_ours <= BF16_VS_GOLD_FACTOR * err_hf + 2 ** -8, (err_ours, err_hf)
    gold_grads, hf_grads = dict(gold_model.named_parameters()), dict(hf16.named_parameters())
    for name, p in ours16.named_parameters():
        g_gold = gold_grads[name].grad
        err_hf, err_ours = rel_err(hf_grads[name].grad, g_gold), rel_err(p.grad, g_gold)
        assert err_ours <= BF16_VS_GOLD_FACTOR * err_hf + 2 ** -8, (name, err_ours, err_hf)


# the 80B-A3B's widths, two layers, 16 of its 512 experts (top-4 of them)
WIDE = dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=16,
            num_key_value_heads=2, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_num_key_heads=16, linear_num_value_heads=32, layer_types=["linear_attention", "full_attention"],
            moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=16, num_experts_per_tok=4,
            mlp_only_layers=[], norm_topk_prob=True)


@pytest.mark.gpu
def test_gpu_bf16_at_qwen3_next_widths_no_worse_than_transformers(tmp_path):
    """A 2-layer Qwen3-Next at the 80B-A3B's widths (`WIDE`: D 2048, 16 key / 32 value heads
    of 128 in the Gated DeltaNet, 16 query / 2 KV heads of 256 in the gated attention),
    bf16 on the GPU with the compiled Triton kernels: logits and every gradient no worse
    than transformers' own bf16 against its fp32 run, over sequences crossing 64-token
    chunk boundaries."""
    qwen3_next_model(seed=7, router_std=0.05, **WIDE).save_pretrained(tmp_path)
    bf16_no_worse_than_transformers(tmp_path, "cuda", _seqs(8, lens=[5, 300, 70]))
