"""LoRA on the routed experts (issue 36, item 5; `lora.experts`): per-expert A/B applied
inside the grouped GEMMs' path, in the trainer and in the engine's rollout (the bug class
of unsloth-zoo PR#1250, where expert adapters were silently ignored by the engine).
Run: python -m pytest -q tests/test_moe_lora.py
"""

from __future__ import annotations

import pytest
import torch

from rlfuse.engine.config import EngineConfig, SamplingParams
from rlfuse.engine.llm import LLM
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.moe import ExpertLoRA, experts_mlp, route
from rlfuse.model import CausalLM, ModelConfig, Packed
from rlfuse.model.lora import (
    LoRAConfig,
    LoRAExperts,
    adapters_off,
    attach_lora,
    expert_lora_modules,
    init_lora_,
    lora_parameters,
)

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True}


def _model():
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=48, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=128, moe=MOE, torch_dtype="float32")
    torch.manual_seed(0)
    m = CausalLM(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def test_expert_lora_equals_the_per_expert_reference_in_float64():
    """experts_mlp with adapters == a loop over tokens and their experts with W + s B A."""
    g = torch.Generator().manual_seed(1)
    T, D, I, E, k, R = 7, 8, 6, 3, 2, 4
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    gu, dn = torch.randn(E, 2 * I, D, generator=g, dtype=torch.float64), torch.randn(E, D, I, generator=g, dtype=torch.float64)
    ad = [torch.randn(s, generator=g, dtype=torch.float64) for s in ((E, R, D), (E, 2 * I, R), (E, R, I), (E, D, R))]
    r = route(torch.randn(T, E, generator=g, dtype=torch.float64), k, True)
    with use_backend("torch"):
        out = experts_mlp(x, gu, dn, r, ExpertLoRA(*ad, scale=0.5))
    want = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(r.experts[t, j])
            h = (gu[e] + 0.5 * ad[1][e] @ ad[0][e]) @ x[t]
            a = torch.nn.functional.silu(h[:I]) * h[I:]
            want[t] += r.weights[t, j] * ((dn[e] + 0.5 * ad[3][e] @ ad[2][e]) @ a)
    # the routing weights and the combine are fp32 (kernels.moe.combine); the adapters move out by O(1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="lora.down_B is"):
        experts_mlp(x, gu, dn, r, ExpertLoRA(*ad[:3], ad[3][:, :, :2], scale=0.5))


def test_attach_lora_on_experts_trains_their_adapters():
    m = _model()
    names = attach_lora(m, LoRAConfig(rank=4, experts=True))
    assert sum(n.endswith(".experts") for n in names) == 2 and len(expert_lora_modules(m)) == 2
    trained = {n for n, _ in lora_parameters(m)}
    assert "model.layers.1.mlp.experts.down_B" in trained and "model.layers.1.mlp.experts.gate_up_A" in trained
    assert not m.model.layers[0].mlp.experts.gate_up_proj.requires_grad  # the base stays frozen
    init_lora_(m, seed=3, b_std=0.1)
    ids = torch.arange(1, 12)
    with use_backend("torch"):
        h = m(ids, torch.arange(11), Packed.from_lengths([11]))
        h.square().sum().backward()
        with torch.no_grad(), adapters_off(m):
            base = m(ids, torch.arange(11), Packed.from_lengths([11]))
    assert not torch.equal(h.detach(), base)
    ex = m.model.layers[1].mlp.experts
    assert isinstance(ex, LoRAExperts) and ex.gate_up_B.grad is not None and ex.down_A.grad.abs().sum() > 0
    # the merged weights reproduce the adapted output
    gu, dn = ex.merged()
    assert gu.shape == ex.gate_up_proj.shape and dn.shape == ex.down_proj.shape
    with pytest.raises(ValueError, match="no MoE layers"):
        dense = CausalLM(ModelConfig(model_type="qwen3", vocab_size=48, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
        attach_lora(dense, LoRAConfig(rank=4, experts=True))


@pytest.mark.parametrize("eager", [True, False])
def test_expert_adapters_are_applied_in_the_rollout(eager):
    """A nonzero expert adapter changes the engine's sampled log-probs, and in exact numerics
    they equal the trainer's teacher-forced log-probs bitwise (the adapter is not dropped by
    the engine's path). Only the experts carry an adapter here (attention adapters B = 0)."""
    m = _model()
    attach_lora(m, LoRAConfig(rank=4, experts=True, targets=["q_proj"]))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=5, ignore_eos=True)
    with use_backend("torch"):
        llm = LLM(m, None, EngineConfig(max_model_len=64, max_num_seqs=4, numerics="exact", enforce_eager=eager,
                                        enable_prefix_caching=False))
        before = llm.generate(prompts, params)
        with torch.no_grad():
            for _, ex in expert_lora_modules(m):  # only the experts' B: the attention adapter stays 0
                ex.gate_up_B.normal_(0, 0.5)
                ex.down_B.normal_(0, 0.5)
        after = llm.generate(prompts, params)
        for b, a in zip(before, after):
            # same seeds: the first token is drawn from changed probabilities; its log-prob must differ
            assert a.logprobs[0] != b.logprobs[0]
            ids = a.prompt_token_ids + a.output_token_ids
            P = len(a.prompt_token_ids)
            with use_numerics("exact"), torch.no_grad():  # the trainer's forward in the engine's numerics
                h = m(torch.tensor(ids), torch.arange(len(ids)), Packed.from_lengths([len(ids)]))
                lp = m.token_logprobs(h[P - 1:len(ids) - 1], torch.tensor(ids[P:]), 1.0)
            assert torch.equal(lp.float(), a.logprobs)


def test_expert_adapters_round_trip_and_merge(tmp_path):
    """save_peft_adapter writes the expert adapters into the PEFT folder and loading puts
    them back; the merged export equals the adapted model's output (and loads in transformers)."""
    import json

    import transformers

    from rlfuse.model.lora_peft import EXPERT_TARGETS, load_peft_adapter, save_merged, save_peft_adapter
    m = _model()
    attach_lora(m, LoRAConfig(rank=4, experts=True, dropout=0.1))
    init_lora_(m, seed=3, b_std=0.2)
    save_peft_adapter(m, tmp_path / "ad")
    peft_cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert peft_cfg["target_parameters"] == list(EXPERT_TARGETS) and peft_cfg["lora_dropout"] == 0.0
    back = _model()
    eff = load_peft_adapter(back, tmp_path / "ad")
    assert eff.experts
    for (n, a), (_, b) in zip(lora_parameters(m), lora_parameters(back)):
        assert torch.equal(a, b), n
    ids = torch.arange(1, 10)
    with use_backend("torch"), torch.no_grad():
        want = m(ids, torch.arange(9), Packed.from_lengths([9]))
        assert torch.equal(back(ids, torch.arange(9), Packed.from_lengths([9])), want)
        save_merged(m, tmp_path / "merged")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        ours = m.token_logprobs(want[:-1], ids[1:], 1.0)
        logits = hf(ids[None]).logits[0, :-1].double()
        theirs = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
    torch.testing.assert_close(theirs.float(), ours.float(), rtol=1e-4, atol=1e-4)
    dense = _model()
    attach_lora(dense, LoRAConfig(rank=4))  # no expert adapters: the folder's are refused, not ignored
    with pytest.raises(ValueError, match=r"holds expert adapters .* but the model has none \(lora.experts\)"):
        from rlfuse.model.lora_peft import load_peft_weights
        load_peft_weights(dense, tmp_path / "ad")


def _logits(model, ids):
    with use_backend("torch"), torch.no_grad():
        return model.logits(model(ids, torch.arange(len(ids)), Packed.from_lengths([len(ids)])))


def test_expert_adapters_load_in_peft_and_transformers(tmp_path):
    """The exported folder (PEFT's target_parameters layout for the 3-D expert tensors) is
    what PEFT 0.21 + transformers 5 apply: their logits equal ours with nonzero adapters on
    the attention projections and on every expert (and differ from the base model's)."""
    import peft
    import transformers

    from rlfuse.model import save_model
    from rlfuse.model.lora_peft import save_peft_adapter
    m = _model()
    save_model(m, tmp_path / "base")
    attach_lora(m, LoRAConfig(rank=3, alpha=6.0, experts=True))
    init_lora_(m, seed=5, b_std=0.3)
    save_peft_adapter(m, tmp_path / "ad")
    ids = torch.arange(3, 14)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        base = hf(ids[None]).logits[0]
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "ad")(ids[None]).logits[0]
    mine = _logits(m, ids)
    assert (theirs - mine).abs().max() < 1e-4 * mine.abs().max()
    assert (base - mine).abs().max() > 1e-2 * mine.abs().max()  # the adapters matter


def test_a_peft_made_expert_adapter_loads_here(tmp_path):
    """An adapter PEFT itself made (target_parameters on the experts, target_modules on the
    attention) loads into rlfuse with PEFT's logits: the stacking and nesting conventions
    are PEFT's, not only our own round trip."""
    import peft
    import transformers

    from rlfuse.model import load_model, save_model
    from rlfuse.model.lora_peft import load_peft_adapter
    save_model(_model(), tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    torch.manual_seed(0)  # PEFT draws A and B from the global generator
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                 target_parameters=["mlp.experts.gate_up_proj",
                                                                    "mlp.experts.down_proj"],
                                                 init_lora_weights=False))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)
    pm.save_pretrained(tmp_path / "ad")
    ours = load_model(tmp_path / "base", dtype="float32")
    cfg = load_peft_adapter(ours, tmp_path / "ad")
    assert cfg.experts and set(cfg.targets) == {"q_proj", "v_proj"} and len(expert_lora_modules(ours)) == 2
    ids = torch.arange(2, 12)
    with torch.no_grad():
        theirs = pm(ids[None]).logits[0]
    mine = _logits(ours, ids)
    assert (theirs - mine).abs().max() < 1e-4 * mine.abs().max()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_expert_lora_is_batch_invariant_in_exact_numerics(backend):
    """A token's rows with expert adapters do not depend on the other tokens of the batch
    (a prefix alone, and the batch reversed), on both backends (Triton under the interpreter)."""
    g = torch.Generator().manual_seed(4)
    T, D, I, E, k, R = 9, 32, 16, 4, 2, 4
    x = torch.randn(T, D, generator=g)
    gu, dn = torch.randn(E, 2 * I, D, generator=g) * 0.2, torch.randn(E, D, I, generator=g) * 0.2
    ad = [torch.randn(s, generator=g) * 0.2 for s in ((E, R, D), (E, 2 * I, R), (E, R, I), (E, D, R))]
    logits = torch.randn(T, E, generator=g)
    lora = ExpertLoRA(*ad, scale=2.0)
    with use_backend(backend), use_numerics("exact"):
        full = experts_mlp(x, gu, dn, route(logits, k, True), lora)
        head = experts_mlp(x[:4], gu, dn, route(logits[:4], k, True), lora)
        rev = experts_mlp(x.flip(0), gu, dn, route(logits.flip(0), k, True), lora)
        base = experts_mlp(x, gu, dn, route(logits, k, True))
    assert torch.equal(full[:4], head) and torch.equal(full, rev.flip(0))
    assert not torch.equal(full, base)
