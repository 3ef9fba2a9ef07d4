"""Exact routing (issue 36, item 4): the engine records each sampled token's top-k experts
per MoE layer (`Completion.routing`), and the GRPO step logs moe/routing_mismatch against
the trainer's routing of the same rows: 0 in exact numerics, nonzero when the router the
trainer sees differs from the rollout's.
Run: python -m pytest -q tests/test_moe_routing_record.py
"""

from __future__ import annotations

import pytest
import torch
from train_setup import TINY_MODEL, tiny_cfg

from rlfuse.engine.config import EngineConfig, SamplingParams
from rlfuse.engine.llm import LLM
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.model import CausalLM, ModelConfig, Packed
from rlfuse.model.layers.moe import moe_blocks

MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True}


def _model():
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=48, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=128, moe=MOE, torch_dtype="float32")
    torch.manual_seed(0)
    m = CausalLM(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


@pytest.mark.parametrize("eager", [True, False])  # False: the static (graph-bookkeeping) decode path on CPU
def test_engine_records_the_routing_the_teacher_forced_forward_picks(eager):
    m = _model()
    with use_backend("torch"):
        llm = LLM(m, None, EngineConfig(max_model_len=64, max_num_seqs=8, numerics="exact", enforce_eager=eager))
        prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=3, ignore_eos=True))
        for c in outs:
            n = len(c.output_token_ids)
            assert c.routing is not None and c.routing.shape == (n, 2, 2) and c.routing.dtype == torch.int16
            ids = c.prompt_token_ids + c.output_token_ids
            with use_numerics("exact"), torch.no_grad():  # the trainer's forward in the engine's numerics
                m(torch.tensor(ids), torch.arange(len(ids)), Packed.from_lengths([len(ids)]))
            P = len(c.prompt_token_ids)
            want = torch.stack([b.last_experts[P - 1:P - 1 + n] for b in moe_blocks(m)], 1)
            assert torch.equal(c.routing.long(), want)
        off = LLM(m, None, EngineConfig(max_model_len=64, max_num_seqs=8, record_routing=False, enforce_eager=True))
        assert off.generate([[1, 2]], SamplingParams(max_tokens=2))[0].routing is None
    assert all(b.routing_buffer is None for b in moe_blocks(m))  # installed only around the engine's forwards


def _grpo_step(tmp_path, perturb: bool):
    from rlfuse.data import PromptStream, build_prompts
    from rlfuse.train.grpo import GRPOStep
    from rlfuse.train.loop import make_optimizer
    from rlfuse.train.session import open_session
    init = {**TINY_MODEL, "model_type": "qwen3_moe", "num_hidden_layers": 2, "moe": MOE}
    cfg = tiny_cfg(tmp_path, "engine.numerics=exact", "engine.enforce_eager=true", "engine.max_num_seqs=16",
                   model={"random_init": init})
    ses = open_session(cfg)
    prompts = build_prompts(ses.train_rows, ses.tokenizer, cfg.data)
    tr = GRPOStep(cfg, ses.model, ses.sampler, ses.rewards(), PromptStream(prompts, seed=0),
                  make_optimizer(ses.model, cfg))
    if perturb:  # the trainer's router differs from the rollout's: what replay would hide
        generate = ses.sampler.generate

        def generate_then_perturb(*a, **k):
            out = generate(*a, **k)
            with torch.no_grad():
                for b in moe_blocks(ses.model):
                    b.gate.weight.add_(torch.randn_like(b.gate.weight))
            return out
        ses.sampler.generate = generate_then_perturb
    return tr.step(0)


def test_grpo_logs_routing_mismatch_zero_in_exact_numerics_and_nonzero_with_a_perturbed_router(tmp_path):
    exact = _grpo_step(tmp_path / "exact", perturb=False)
    assert float(exact["moe/routing_mismatch"]) == 0.0
    assert float(exact["mismatch/max_abs"]) == 0.0
    perturbed = _grpo_step(tmp_path / "perturbed", perturb=True)
    assert float(perturbed["moe/routing_mismatch"]) > 0.0
