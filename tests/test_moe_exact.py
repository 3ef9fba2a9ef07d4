"""Exact routing on a tiny Qwen3-MoE (CPU): the engine's rollout log-probs equal the
trainer's bitwise in `rlfuse.consistency.check`'s settings, and every token picks the
same experts in every layer whether it runs alone or packed with other sequences
(`routing_mismatch` reads 0); fast numerics on the same model must show a log-prob
difference somewhere, so the comparison can fail.

    python -m pytest -q tests/test_moe_exact.py
"""

import pytest
import torch
from engine_helpers import (
    one_thread,  # noqa: F401 (fixture)
    random_prompts,
)

from rlfuse.consistency.check import default_sweep, run_setting
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.moe import routing_mismatch
from rlfuse.model import CausalLM, ModelConfig, Packed
from rlfuse.model.layers.moe import moe_blocks

PROMPT_LENS = [14, 30, 7, 18]


def tiny_moe(dtype=torch.float32, seed=0) -> CausalLM:
    """hidden 64, 2 layers (both sparse), 8 experts of width 32, top-2, vocab 128."""
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      tie_word_embeddings=False, max_position_embeddings=512,
                      moe=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True))
    m = CausalLM(cfg)
    m.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # a wider router: close second choices are rarer, the choice matters more
        for b in moe_blocks(m):
            b.gate.weight.mul_(5)
    return m.to(dtype).eval()


def _sweep(tokens):
    need = max(PROMPT_LENS) + tokens
    return {s.name: s for s in default_sweep(4, small_pool_blocks=2 * -(-need // 16), chunk_tokens=16)}


@pytest.mark.parametrize("dtype,names", [(torch.float32, ("batch 1", "combined")), (torch.bfloat16, None)])
def test_engine_and_trainer_logprobs_bitwise_in_exact_numerics(dtype, names):
    model = tiny_moe(dtype)
    prompts = random_prompts(PROMPT_LENS)
    sweep = _sweep(8)
    with use_backend("torch"):
        for name, setting in sweep.items():  # bf16: every setting of `rlfuse check`
            if names and name not in names:
                continue
            r = run_setting(model, prompts, setting, numerics="exact", max_tokens=8, temperature=1.0)
            assert r.tokens > 0 and r.bitwise_frac == 1.0 and r.max_abs == 0.0, (name, r.row(), r.first_diff)


def test_fast_numerics_differs_so_the_comparison_can_fail():
    model = tiny_moe()
    with use_backend("torch"):
        r = run_setting(model, random_prompts(PROMPT_LENS), _sweep(8)["combined"], numerics="fast", max_tokens=8,
                        temperature=1.0)
    assert r.bitwise_frac < 1.0


def test_engine_and_trainer_bitwise_on_triton_kernels():
    """The Triton path (interpreter on CPU): grouped GEMMs, routing and combine kernels."""
    model = tiny_moe()
    with use_backend("triton"):
        r = run_setting(model, random_prompts(PROMPT_LENS[:2]), _sweep(4)["batch 1"], numerics="exact",
                        max_tokens=4, temperature=1.0)
    assert r.bitwise_frac == 1.0, (r.row(), r.first_diff)


def _experts_per_layer(model, ids_list):
    ids = torch.cat(ids_list)
    pos = torch.cat([torch.arange(len(s)) for s in ids_list])
    with torch.no_grad():
        model(ids, pos, Packed.from_lengths([len(s) for s in ids_list]))
    return [b.last_experts for b in moe_blocks(model)]


def test_routing_alone_equals_routing_packed_in_exact_numerics():
    """(the Triton kernels' batch invariance: tests/test_kernel_moe.py, tests/test_moe_model.py)"""
    model = tiny_moe(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in (9, 5, 12)]
    with use_backend("torch"), use_numerics("exact"):
        packed = _experts_per_layer(model, seqs)
        alone = [_experts_per_layer(model, [s]) for s in seqs]
    for layer, experts in enumerate(packed):
        rows = torch.cat([a[layer] for a in alone])
        assert routing_mismatch(experts, rows) == 0.0
        assert torch.equal(experts, rows)


def test_routing_mismatch_counts_sets_not_order():
    a = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    b = torch.tensor([[1, 0], [2, 4], [4, 5], [7, 1]])  # row 0: same set; rows 1 and 3 differ
    assert routing_mismatch(a, b) == 0.5
    assert routing_mismatch(a, a) == 0.0


def test_drift_probe_on_a_sparse_model():
    """The layer-wise probe hooks a sparse block's router logits and output; fast numerics
    differs somewhere, exact numerics nowhere."""
    from rlfuse.consistency.drift import layer_drift
    model = tiny_moe()
    prompt, completion = random_prompts([12, 6], seed=3)
    with use_backend("torch"):
        fast = layer_drift(model, prompt, completion, 5, numerics="fast")
        exact = layer_drift(model, prompt, completion, 5, numerics="exact")
    assert {op for _, op, _ in exact.ops} >= {"mlp.router_logits", "mlp"}
    assert fast.first_divergence is not None
    assert exact.first_divergence is None and exact.logprob_delta == 0.0


def test_check_cli_tiny_moe_builds_the_sparse_model(capsys):
    """`rlfuse check --tiny --moe` checks a Qwen3-MoE (its sweep is the one above; the full
    CLI run with multi-turn episodes costs ~10 s on a CPU: `rlfuse check --tiny --moe`)."""
    import argparse

    from rlfuse.cli import check, main
    p = argparse.ArgumentParser()
    check.add_arguments(p)
    model, _ = check._model(p.parse_args(["--tiny", "--moe"]), "cpu")
    assert model.config.model_type == "qwen3_moe" and len(moe_blocks(model)) == 2
    assert main(["check", "some/folder", "--moe"]) != 0
    assert "--moe picks the --tiny model's kind" in capsys.readouterr().err


def test_sft_and_grpo_steps_on_a_tiny_moe(tmp_path):
    """The trainers run a Qwen3-MoE from model.random_init (the recipe's nested `moe`
    dict); a GRPO step in exact numerics logs mismatch/max_abs = 0; the final folder loads
    in transformers as Qwen3MoeForCausalLM."""
    import transformers

    from rlfuse.recipes.demo import demo_config
    from rlfuse.run.config import replace
    from rlfuse.train import run_grpo, run_sft
    init = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True))
    changes = {"model.random_init": init, "model.device": "cpu", "sft.steps": 3, "grpo.steps": 2,
               "grpo.prompts_per_step": 4, "grpo.group_size": 4, "logging.progress": False,
               "logging.tensorboard": False, "engine.numerics": "exact", "data.eval_size": 8,
               "data.train_size": 64}
    cfg = demo_config("ci", run_dir=str(tmp_path / "sft"))
    sft = run_sft(replace(cfg, **changes))
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in sft["history"])
    grpo = run_grpo(replace(cfg, **{**changes, "logging.run_dir": str(tmp_path / "grpo")}))
    assert [h["mismatch/max_abs"] for h in grpo["history"]] == [0.0, 0.0]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "grpo" / "final")
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
