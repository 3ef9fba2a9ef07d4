"""MoE in training (issue 36, item 5): every trainer adds the router losses the config asks
for (`layers.moe.RouterLoss`: transformers' load-balancing term, the ST-MoE z-loss) and logs
moe/* every step.
Run: python -m pytest -q tests/test_moe_train.py
"""

from __future__ import annotations

import pytest
import torch
from train_setup import TINY_MODEL, tiny_cfg, tiny_session

from rlfuse.data import PromptStream, build_preference_pairs, build_prompts, build_sft_examples
from rlfuse.kernels import use_backend
from rlfuse.model import CausalLM, ModelConfig, Packed
from rlfuse.model.layers.moe import RouterLoss, load_balancing_loss, moe_blocks, router_stats, router_z_loss
from rlfuse.train.dpo import DPOStep
from rlfuse.train.loop import make_optimizer
from rlfuse.train.ppo import PPOStep, build_critic, make_critic_optimizer
from rlfuse.train.sft import SFTStep

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True}
TINY_MOE = {**TINY_MODEL, "model_type": "qwen3_moe", "moe": MOE}
METRICS = ("moe/aux_loss", "moe/z_loss", "moe/load_max", "moe/load_min")


def _model(**moe):
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=40, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      moe={**MOE, **moe})
    torch.manual_seed(0)
    m = CausalLM(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m


def _forward(m, T=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (T,), generator=g)
    return m(ids, torch.arange(T), Packed.from_lengths([T]))


def test_router_loss_term_is_the_weighted_losses_of_the_last_forward():
    m = _model()
    with use_backend("torch"):
        rl = RouterLoss(m, aux_coef=0.5, z_coef=0.25)
        _forward(m)
        logits = [b.last_router_logits for b in moe_blocks(m)]
        term = rl.term(0.75)
    assert term.requires_grad
    # the same stats recomputed from the recorded logits (values only)
    stats = [router_stats(x, 2) for x in logits]
    want = 0.75 * (0.5 * load_balancing_loss(stats, 4) + 0.25 * router_z_loss(stats))
    torch.testing.assert_close(term.detach(), want, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="no router stats"):
        rl.term(1.0)  # the stats were consumed
    got = rl.metrics()
    assert set(got) == set(METRICS)
    torch.testing.assert_close(got["moe/aux_loss"], load_balancing_loss(stats, 4))
    assert float(got["moe/load_max"]) >= 1.0 >= float(got["moe/load_min"]) >= 0.0
    assert rl.metrics() == {}  # reset


def test_a_padding_micro_batch_adds_no_load():
    """Data-parallel padding micro-batches repeat real rows at zero weight: `term(pad=True)`
    consumes their stats but leaves the loads (moe/load_max, moe/load_min) to the real ones,
    or the ranks' summed loads would count those rows twice (PPO on 2 ranks: 4e-2 off)."""
    m = _model()
    with use_backend("torch"):
        rl = RouterLoss(m, aux_coef=0.0, z_coef=0.0)
        _forward(m, seed=1)
        rl.term(1.0)
        want = rl.metrics()
        for seed, pad in ((1, False), (2, True)):
            _forward(m, seed=seed)
            rl.term(0.0 if pad else 1.0, pad=pad)
        got = rl.metrics()
    assert torch.equal(got["moe/load_max"], want["moe/load_max"])
    assert torch.equal(got["moe/load_min"], want["moe/load_min"])


def test_router_loss_follows_transformers_switch_and_skips_dense_models():
    assert RouterLoss.for_model(_model()).aux_coef == 0.0  # output_router_logits false: transformers adds nothing
    on = RouterLoss.for_model(_model(output_router_logits=True, router_aux_loss_coef=0.02))
    assert on.aux_coef == 0.02
    assert RouterLoss.for_model(_model(), aux_coef=0.1, z_coef=0.001).z_coef == 0.001
    dense = CausalLM(ModelConfig(model_type="qwen3", vocab_size=40, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    assert RouterLoss.for_model(dense) is None


def test_the_router_gradient_carries_the_aux_term(tmp_path):
    """The same SFT step with and without the aux coefficient: the routers' gradients differ
    by the aux term's gradient, the experts' are unchanged (the aux loss reads the router only)."""
    grads = {}
    for coef in (0.0, 10.0):
        cfg = tiny_cfg(tmp_path / str(coef), "optim.max_grad_norm=0",  # no clipping: the raw gradients
                       model={"random_init": TINY_MOE, "router_aux_loss_coef": coef})
        ses = tiny_session(cfg, need_target=True)
        ex = build_sft_examples(ses.train_rows[:8], ses.tokenizer, cfg.data, cfg.sft.max_seq_len)
        tr = SFTStep(cfg, ses.model, make_optimizer(ses.model, cfg), PromptStream(ex, seed=0))
        tr.optimizer.step = lambda *a, **k: None  # keep the gradients: read them below
        tr.optimizer.zero_grad = lambda *a, **k: None
        m = tr.train_step(ex, 0)
        assert all(k in m for k in METRICS) and float(m["moe/aux_loss"]) > 0
        grads[coef] = {n: p.grad.clone() for n, p in ses.model.named_parameters() if p.grad is not None}
    routers = [n for n in grads[0.0] if n.endswith("mlp.gate.weight")]
    assert routers and all(not torch.equal(grads[0.0][n], grads[10.0][n]) for n in routers)
    for n in ("model.norm.weight", "model.layers.0.mlp.experts.down_proj"):
        assert torch.equal(grads[0.0][n], grads[10.0][n]), n


@pytest.mark.parametrize("stage", ["grpo", "ppo", "dpo"])
def test_rl_and_preference_steps_log_moe_metrics_and_add_the_terms(tmp_path, stage):
    """GRPO, PPO and DPO steps on a tiny Qwen3-MoE: moe/* every step, finite, and the aux and
    z coefficients reach the loss (a large z coefficient moves the routers' weights more)."""
    from rlfuse.train.grpo import GRPOStep
    moved = {}
    for z in (0.0, 100.0):
        over = {"model": {"random_init": TINY_MOE, "router_z_loss_coef": z, "router_aux_loss_coef": 0.01}}
        if stage == "dpo":
            cfg = tiny_cfg(tmp_path / f"{z}", "dpo.steps=2", "dpo.batch_size=4", **over,
                           data={"train": "builtin:arithmetic_pref", "train_size": 20},
                           rewards=[{"name": "arithmetic"}])
        else:
            cfg = tiny_cfg(tmp_path / f"{z}", **over, ppo={"steps": 2, "prompts_per_step": 2,
                                                          "samples_per_prompt": 2, "max_new_tokens": 3})
        ses = tiny_session(cfg)
        opt = make_optimizer(ses.model, cfg)
        if stage == "dpo":
            tr = DPOStep(cfg, ses.model, opt, build_preference_pairs(ses.train_rows, ses.tokenizer, cfg.data, cfg.dpo))
        else:
            stream = PromptStream(build_prompts(ses.train_rows, ses.tokenizer, cfg.data), seed=0)
            if stage == "grpo":
                tr = GRPOStep(cfg, ses.model, ses.sampler, ses.rewards(), stream, opt)
            else:
                critic = build_critic(cfg, ses.model)
                tr = PPOStep(cfg, ses.model, ses.sampler, ses.rewards(), stream, opt, critic,
                             make_critic_optimizer(critic, cfg))
        router0 = ses.model.model.layers[0].mlp.gate.weight.detach().clone()
        m = tr.step(0)
        assert all(k in m and torch.isfinite(torch.as_tensor(m[k])) for k in METRICS), sorted(m)
        moved[z] = float((ses.model.model.layers[0].mlp.gate.weight.detach() - router0).norm())
    assert moved[100.0] != moved[0.0]


def test_router_loss_under_gradient_checkpointing_keeps_the_gradients(tmp_path):
    """Activation checkpointing recomputes each layer in backward; the router term is taken
    from the first forward's stats, so every gradient is the same bits as without it."""
    grads = {}
    for ckpt in (False, True):
        cfg = tiny_cfg(tmp_path / str(ckpt), "optim.max_grad_norm=0",
                       model={"random_init": TINY_MOE, "router_aux_loss_coef": 1.0, "router_z_loss_coef": 0.1,
                              "gradient_checkpointing": ckpt})
        ses = tiny_session(cfg, need_target=True)
        ex = build_sft_examples(ses.train_rows[:8], ses.tokenizer, cfg.data, cfg.sft.max_seq_len)
        tr = SFTStep(cfg, ses.model, make_optimizer(ses.model, cfg), PromptStream(ex, seed=0))
        tr.optimizer.step = lambda *a, **k: None  # keep the gradients: read them below
        tr.optimizer.zero_grad = lambda *a, **k: None
        m = tr.train_step(ex, 0)
        grads[ckpt] = ({n: p.grad.clone() for n, p in ses.model.named_parameters() if p.grad is not None},
                       float(m["moe/aux_loss"]))
    assert grads[False][1] == grads[True][1]
    for n, g in grads[False][0].items():
        assert torch.equal(g, grads[True][0][n]), n
