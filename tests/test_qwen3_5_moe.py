"""Qwen3.5-MoE (hybrid Gated DeltaNet / gated attention layers, each with an MoE block of
routed experts plus a sigmoid-gated shared expert) against transformers'
Qwen3_5MoeForCausalLM on a tiny random model (tests/tiny_hf.py QWEN3_5_MOE, CPU):

  * config round trip, parameter names and shapes equal transformers';
  * fp32: logits of a packed batch, the loss with the load-balancing term, and the gradient
    of every parameter (routers, shared experts and their gates included) equal transformers';
  * folders: ours saved loads in transformers (per-expert layout) with the same tensors; the
    fused layout loads here; the text tower of a Qwen3_5MoeForConditionalGeneration folder
    gives transformers' logits;
  * bad config: a norm_topk_prob, decoder_sparse_step or mlp_only_layers transformers does not
    honour, a missing shared_expert_intermediate_size: one line naming the field;
  * exact numerics: a sequence packed with others gives the bits it gives alone (torch and
    Triton kernels), and the engine's rollout log-probs equal the trainer's bitwise in
    `rlfuse check`'s settings (the tiny model of `rlfuse check --tiny --moe --hybrid`);
  * LoRA on every projection and every expert exported as a PEFT folder that PEFT applies.
Fp32 parity runs under use_backend("torch") (the readable references).
Run: python -m pytest -q tests/test_qwen3_5_moe.py
"""

import json
import logging

import peft
import pytest
import torch
import transformers
from engine_helpers import random_prompts
from parity import check_routed_grads
from parity import packed_logits as _ours_logits
from safetensors.torch import load_file, save_file
from tiny_hf import QWEN3_5_MOE, qwen3_5_moe_model, rel_err

from rlfuse.consistency.check import default_sweep, run_setting
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.model import CausalLM, ModelConfig, Packed, load_model, save_model
from rlfuse.model.arch.qwen3_5_moe import tiny_hybrid_moe_fields
from rlfuse.model.layers.moe import moe_blocks
from rlfuse.model.lora import LoRAConfig, attach_lora, init_lora_, lora_modules
from rlfuse.model.lora_peft import save_peft_adapter

LENS = [5, 70, 11]
FP32_TOL = 1e-4
E = QWEN3_5_MOE["num_experts"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = qwen3_5_moe_model(seed=0)
    folder = tmp_path_factory.mktemp("qwen3_5_moe")
    hf.save_pretrained(folder)
    ours = load_model(folder, dtype="float32")
    for b in moe_blocks(ours):  # the router losses' stats (as output_router_logits: true would)
        b.record_stats = True
    return hf, folder, ours


def _seqs(seed, lens=LENS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, QWEN3_5_MOE["vocab_size"], (n,), generator=g) for n in lens]


def test_config_and_parameter_names_are_transformers(pair):
    hf, _, ours = pair
    c = ours.config
    assert c.model_type == "qwen3_5_moe_text" and c.is_hybrid and c.intermediate_size is None
    assert c.moe.shared_expert_intermediate_size == 40 and c.moe.norm_topk_prob and c.moe.num_experts == E
    assert ModelConfig.from_hf(c.to_hf()) == c
    assert "intermediate_size" not in c.to_hf() and "mlp_only_layers" not in c.to_hf()
    assert type(transformers.AutoConfig.for_model(**c.to_hf())).__name__ == "Qwen3_5MoeTextConfig"
    assert len(moe_blocks(ours)) == QWEN3_5_MOE["num_hidden_layers"]
    assert {n: tuple(p.shape) for n, p in ours.named_parameters()} == \
        {n: tuple(p.shape) for n, p in hf.named_parameters()}
    with pytest.raises(ValueError, match=r"config field 'intermediate_size' is 64, but Qwen3_5MoeForCausalLM has no "
                                         r"dense MLP"):
        ModelConfig(**tiny_hybrid_moe_fields(intermediate_size=64))


def test_fp32_logits_loss_with_aux_and_every_grad_match_transformers(pair):
    """One batch of same-length rows through transformers (its aux loss counts every row),
    the same rows packed through ours."""
    hf, _, ours = pair
    check_routed_grads(hf, ours, _seqs(1, lens=[33, 33]), QWEN3_5_MOE["router_aux_loss_coef"], E, FP32_TOL)


def test_saved_folder_loads_in_transformers_and_the_fused_layout_loads(pair, tmp_path):
    hf, folder, ours = pair
    save_model(ours, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForCausalLM"] and "intermediate_size" not in cfg
    names = load_file(tmp_path / "out" / "model.safetensors").keys()
    assert "model.layers.3.mlp.experts.5.down_proj.weight" in names
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert type(back).__name__ == "Qwen3_5MoeForCausalLM"
    want = hf.state_dict()
    for n, t in back.state_dict().items():
        assert torch.equal(t, want[n]), n
    fused = tmp_path / "fused"  # transformers' in-memory names: (E, 2I, D) / (E, D, I) tensors
    fused.mkdir()
    (fused / "config.json").write_text((folder / "config.json").read_text())
    save_file({n: t.contiguous() for n, t in hf.state_dict().items()}, fused / "model.safetensors")
    again = load_model(fused, dtype="float32")
    for (n, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


def test_text_tower_of_a_multimodal_folder(pair, tmp_path, caplog):
    hf, _, _ = pair
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    cfg = transformers.Qwen3_5MoeConfig(text_config=hf.config.to_dict(), vision_config=vision,
                                        tie_word_embeddings=False)
    mm = transformers.Qwen3_5MoeForConditionalGeneration(cfg).eval()
    mm.model.language_model.load_state_dict(hf.model.state_dict())
    mm.lm_head.load_state_dict(hf.lm_head.state_dict())
    mm.save_pretrained(tmp_path / "mm")
    tensors = load_file(tmp_path / "mm" / "model.safetensors")
    assert any(n.startswith("model.language_model.layers.") for n in tensors)
    with caplog.at_level(logging.INFO, logger="rlfuse.model.weights"):
        ours = load_model(tmp_path / "mm", dtype="float32")
    assert ours.config.model_type == "qwen3_5_moe_text"
    assert any("vision tower" in r.getMessage() for r in caplog.records), caplog.text
    seqs = _seqs(4, lens=[6, 40])
    with torch.no_grad(), use_backend("torch"):
        mine = _ours_logits(ours, seqs)
    theirs = torch.cat([hf(input_ids=s[None]).logits[0] for s in seqs])
    assert rel_err(mine, theirs) < 1e-5


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(norm_topk_prob=False), r"field 'norm_topk_prob' is False; qwen3_5_moe_text always has "
                                               r"norm_topk_prob = True"),
    (lambda c: c.update(decoder_sparse_step=2), r"field 'decoder_sparse_step' is 2; qwen3_5_moe_text always has"),
    (lambda c: c.update(mlp_only_layers=[1]), r"field 'mlp_only_layers' is \(1,\); qwen3_5_moe_text always has "
                                              r"mlp_only_layers = \[\]"),
    (lambda c: c.pop("shared_expert_intermediate_size"), r"missing required field 'shared_expert_intermediate_size'"),
    (lambda c: c.update(num_experts_per_tok=7), r"field 'num_experts_per_tok' is 7; it must be at most num_experts"),
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
    """`rlfuse check --tiny --moe --hybrid`'s model, vocab 128, routers 5x wider."""
    m = CausalLM(ModelConfig(**tiny_hybrid_moe_fields(vocab_size=128)))
    m.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for b in moe_blocks(m):
            b.gate.weight.mul_(5)
    return m.to(dtype).eval()


# Triton under the interpreter: ~8 s of kernel set-up on 2 cores, so slow here; the GPU tests
# (tests/test_gpu_moe.py) run the same check on the compiled kernels
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_exact_numerics_a_sequence_packed_with_others_equals_it_alone(backend):
    m = tiny()
    lens = (4, 6, 3)
    seqs = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in lens]
    with torch.no_grad(), use_backend(backend), use_numerics("exact"):
        full = m(torch.cat(seqs), torch.cat([torch.arange(len(s)) for s in seqs]), Packed.from_lengths(lens))
        alone = m(seqs[1], torch.arange(6), Packed.from_lengths([6]))
    assert torch.equal(full[4:10], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_rollout_log_probs_equal_the_trainers(dtype):
    """`rlfuse check`'s chunked-prefill and combined settings on the tiny Qwen3.5-MoE, exact
    numerics, torch references: every sampled token's engine log-prob equals the trainer's."""
    m = tiny(dtype)
    prompts = random_prompts([14, 30, 33, 7, 40, 3])
    sweep = {s.name: s for s in default_sweep(6, small_pool_blocks=6, chunk_tokens=16)}
    with use_backend("torch"):
        for name in ("chunked prefill", "combined"):
            r = run_setting(m, prompts, sweep[name], numerics="exact", max_tokens=6, temperature=1.0)
            assert r.tokens > 0 and r.bitwise_frac == 1.0 and r.max_abs == 0.0, (name, r.row(), r.first_diff)


def test_lora_on_every_projection_and_expert_loads_in_peft(pair, tmp_path):
    """Adapters on every projection (the shared expert's included) and on every routed
    expert, exported as a PEFT folder: PEFT 0.21 + transformers apply it with our logits."""
    _, folder, _ = pair
    ours = load_model(folder, dtype="float32")
    attach_lora(ours, LoRAConfig(rank=2, alpha=4.0, experts=True))
    assert {n.rsplit(".", 2)[-2] for n, _ in lora_modules(ours) if "mlp." in n} == {"shared_expert"}
    init_lora_(ours, seed=5, b_std=0.2)
    save_peft_adapter(ours, tmp_path / "adapter")
    seqs = _seqs(6, lens=[9, 30])
    with torch.no_grad(), use_backend("torch"):
        mine = _ours_logits(ours, seqs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        base = torch.cat([hf(input_ids=s[None]).logits[0] for s in seqs])
        pm = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter")
        theirs = torch.cat([pm(input_ids=s[None]).logits[0] for s in seqs])
    assert rel_err(theirs, mine) < 1e-5
    assert rel_err(base, mine) > 1e-2  # the adapters matter
