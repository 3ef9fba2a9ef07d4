"""Qwen3-MoE as a whole model against transformers' Qwen3MoeForCausalLM (tiny, random
weights, CPU): config round trip, fp32 logits, the loss with the load-balancing term and
the gradient of every parameter (router included); loading both checkpoint layouts
(per-expert, as published and as transformers saves; fused 3-D tensors) and saving what
transformers loads back; exact-numerics batch invariance of the whole model; bad input
(a top-k above the expert count, missing or mis-shaped expert tensors, unsupported MoE
features), one ValueError line each naming the field or tensor.

    python -m pytest -q tests/test_moe_model.py
"""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from tiny_hf import randomize_, rel_err

from rlfuse.kernels import use_backend, use_numerics
from rlfuse.model import ModelConfig, Packed, load_model, save_model
from rlfuse.model.layers.moe import SparseMoeBlock, collect_router_stats, load_balancing_loss, moe_blocks

E, K = 6, 2
HF_KW = dict(vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_experts=E,
             num_experts_per_tok=K, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1],
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
             rms_norm_eps=1e-5, tie_word_embeddings=False, router_aux_loss_coef=0.02, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    cfg = transformers.Qwen3MoeConfig(**HF_KW)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomize_(hf, seed=3).eval()
    with torch.no_grad():  # routers wider than the rest: the choice of experts matters
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_pretrained(folder)
    ours = load_model(folder, dtype="float32")
    for b in moe_blocks(ours):  # the router losses' stats (output_router_logits: true in config.json turns it on)
        b.record_stats = True
    return hf, ours, folder


def _ids(seed, B=2, S=9):
    return torch.randint(0, HF_KW["vocab_size"], (B, S), generator=torch.Generator().manual_seed(seed))


def _ours_loss(model, ids):
    B, S = ids.shape
    pos = torch.arange(S).repeat(B)
    logits = model.logits(model(ids.reshape(-1), pos, Packed.from_lengths([S] * B)))
    ce = F.cross_entropy(logits.view(B, S, -1)[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    aux = load_balancing_loss(collect_router_stats(model), E)
    return logits, ce + HF_KW["router_aux_loss_coef"] * aux, aux


def test_config_and_layers(pair):
    hf, ours, folder = pair
    cfg = ours.config
    assert cfg.model_type == "qwen3_moe" and cfg.moe.num_experts == E and cfg.moe.mlp_only_layers == (1,)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == [True, False, True]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert transformers.AutoConfig.for_model(**cfg.to_hf()).to_dict()["num_experts_per_tok"] == K
    assert sorted(n for n, _ in ours.named_parameters()) == sorted(n for n, _ in hf.named_parameters())


def test_fp32_logits_loss_and_grads_match_transformers(pair):
    hf, ours, _ = pair
    ids = _ids(0)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    out = hf(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    with use_backend("torch"):
        logits, loss, aux = _ours_loss(ours, ids)
    loss.backward()
    assert rel_err(logits.detach(), out.logits.detach().reshape(logits.shape)) < 1e-5
    torch.testing.assert_close(aux, out.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, out.loss, rtol=1e-5, atol=1e-6)
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: no gradient"
        assert rel_err(p.grad, hf_params[name].grad) < 1e-5, name


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_exact_numerics_rows_do_not_depend_on_the_batch(pair, backend):
    _, ours, _ = pair
    ids = _ids(1, B=3, S=7)
    with torch.no_grad(), use_backend(backend), use_numerics("exact"):
        full = ours(ids.reshape(-1), torch.arange(7).repeat(3), Packed.from_lengths([7, 7, 7]))
        alone = ours(ids[1], torch.arange(7), Packed.from_lengths([7]))
    assert torch.equal(full[7:14], alone)


def test_save_loads_in_transformers_and_fused_layout_loads(pair, tmp_path):
    hf, ours, folder = pair
    save_model(ours, tmp_path / "saved")
    names = load_file(tmp_path / "saved" / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.5.down_proj.weight" in names and not any("gate_up_proj" in n for n in names)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    want = hf.state_dict()
    for n, t in back.state_dict().items():
        assert torch.equal(t, want[n]), n
    # the fused layout (transformers' in-memory names) loads as well
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((folder / "config.json").read_text())
    save_file({n: t.contiguous() for n, t in hf.state_dict().items()}, fused / "model.safetensors")
    again = load_model(fused, dtype="float32")
    for (n, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


def _folder_with(folder, tmp_path, edit_config=None, edit_tensors=None):
    out = tmp_path / "bad"
    out.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(folder / "model.safetensors")
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(num_experts_per_tok=7), r"field 'num_experts_per_tok' is 7; it must be at most num_experts = 6"),
    (lambda c: c.update(mlp_only_layers=[3]), r"field 'mlp_only_layers' holds \[3\]; expected layer indices in "
                                              r"\[0, num_hidden_layers = 3\)"),
    (lambda c: c.update(shared_expert_intermediate_size=32), r"field 'shared_expert_intermediate_size' is 32; "
                                                             r"shared experts are not supported"),
    (lambda c: c.pop("moe_intermediate_size"), r"missing required field 'moe_intermediate_size'"),
])
def test_bad_moe_config_is_one_line_naming_the_field(pair, tmp_path, edit, message):
    _, _, folder = pair
    with pytest.raises(ValueError, match=message) as e:
        load_model(_folder_with(folder, tmp_path, edit_config=edit))
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"),
     r"missing tensor 'model.layers.2.mlp.experts.3.up_proj.weight' \(expert 3 of num_experts = 6\)"),
    (lambda t: t.update({"model.layers.0.mlp.experts.1.down_proj.weight": torch.zeros(64, 23)}),
     r"tensor 'model.layers.0.mlp.experts.1.down_proj.weight' has shape \(64, 23\), the config expects \(64, 24\)"),
    (lambda t: t.update({"model.layers.0.mlp.experts.6.down_proj.weight": torch.zeros(64, 24)}),
     r"unexpected tensors \['model.layers.0.mlp.experts.6.down_proj.weight'\]"),
])
def test_bad_expert_tensors_are_one_line_naming_the_tensor(pair, tmp_path, edit, message):
    _, _, folder = pair
    with pytest.raises(ValueError, match=message) as e:
        load_model(_folder_with(folder, tmp_path, edit_tensors=edit))
    assert "\n" not in str(e.value)


def test_model_config_from_plain_dicts():
    """A recipe's model.random_init (YAML: nested dicts and lists) builds the same config."""
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=32, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      moe={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                           "mlp_only_layers": [0]})
    assert cfg.moe.mlp_only_layers == (0,) and not cfg.moe.is_sparse(0) and cfg.moe.is_sparse(1)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    with pytest.raises(ValueError, match=r"config field 'moe' must be given for model_types \['qwen3_5_moe_text', 'qwen3_moe', 'qwen3_next'\] and only"):
        ModelConfig(model_type="qwen3", vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, moe=cfg.moe)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_batch(pair, backend):
    _, ours, _ = pair
    with torch.no_grad(), use_backend(backend), use_numerics("exact"):
        h = ours(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), Packed.from_lengths([]))
    assert h.shape == (0, HF_KW["hidden_size"])


def test_activation_checkpointing_keeps_loss_and_aux_gradients(pair):
    """Router stats recorded inside a checkpointed layer still carry the aux loss's
    gradient (the recompute rebuilds what backward needs): the same gradients as without."""
    _, ours, _ = pair
    ids = _ids(5)
    grads = []
    for ckpt in (False, True):
        ours.zero_grad(set_to_none=True)
        ours.gradient_checkpointing = ckpt
        with use_backend("torch"):
            _, loss, _ = _ours_loss(ours, ids)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in ours.named_parameters()})
    ours.gradient_checkpointing = False
    for n, g in grads[0].items():
        assert torch.equal(g, grads[1][n]), n


def test_lora_on_a_moe_model_says_the_experts_get_none(pair, caplog):
    import copy
    import logging

    from rlfuse.model.lora import LoRAConfig, attach_lora
    _, ours, _ = pair
    for blk in moe_blocks(ours):
        blk.last_stats = None  # graph tensors of an earlier test's forward: deepcopy refuses them
    model = copy.deepcopy(ours)
    with caplog.at_level(logging.WARNING):
        names = attach_lora(model, LoRAConfig(rank=4))
    assert any("self_attn" in n for n in names) and not any("experts" in n for n in names)
    assert "the routed experts and routers of 2 MoE layers get no adapter" in caplog.text
    assert not model.model.layers[0].mlp.experts.gate_up_proj.requires_grad
