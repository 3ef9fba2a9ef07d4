"""Two GRPO steps on the real SmolLM2-135M-Instruct (CPU, float32) with the engine:
rewards computed, losses finite, weights changed in place, and the engine's next rollout
uses the changed weights (its log-probs equal the updated model's teacher-forced ones)."""

import pytest
import torch
from train_setup import one_thread

from rlfuse.data.prompts import PromptStream, build_prompts
from rlfuse.engine.naive import teacher_forced_logprobs
from rlfuse.run.config.run_config import load_config
from rlfuse.train.grpo import GRPOStep
from rlfuse.train.loop import make_optimizer
from rlfuse.train.session import open_session

pytestmark = pytest.mark.slow

# a content-dependent reward so every group has variance (a 135M model rarely solves anything)
REWARD = "def digits(prompts, completions, **kw):\n    return [sum(c.isdigit() for c in s) / 16 for s in completions]\n"


def test_two_grpo_steps_on_smollm2(smollm2_dir, tmp_path):
    with one_thread():
        _two_steps(smollm2_dir, tmp_path)


def _two_steps(smollm2_dir, tmp_path):
    (tmp_path / "rw.py").write_text(REWARD)
    cfg = load_config({
        "model": {"path": str(smollm2_dir), "dtype": "float32", "device": "cpu"},
        "data": {"train": "builtin:arithmetic", "task": {"digits": 2, "ops": "+"}, "train_size": 50, "eval_size": 4,
                 "use_chat_template": True, "prompt_template": "What is {prompt} Reply with the number only.",
                 "max_prompt_len": 128},
        "rewards": [{"name": "arithmetic"}, {"name": f"{tmp_path}/rw.py:digits"}],
        "optim": {"lr": 1e-5, "schedule": "constant"},
        "grpo": {"steps": 2, "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 12, "loss_type": "dapo"},
        "engine": {"max_num_seqs": 8, "max_model_len": 256},
        "logging": {"run_dir": str(tmp_path), "tensorboard": False, "progress": False},
    })
    ses = open_session(cfg)
    model, tok, engine = ses.model, ses.tokenizer, ses.sampler
    params = dict(model.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    w0 = {n: params[n].detach().clone() for n in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight")}
    probe = [tok.apply_chat_template([{"role": "user", "content": "What is 12+30?"}], tokenize=True)]
    before = engine.generate(probe, n=1, temperature=0.0, max_tokens=6, seed=0)[0]

    prompts = build_prompts(ses.train_rows, tok, cfg.data)
    tr = GRPOStep(cfg, model, engine, ses.rewards(), PromptStream(prompts, seed=0), make_optimizer(model, cfg))
    for step in range(2):
        m = tr.step(step)
        assert torch.isfinite(torch.as_tensor(m["loss"])) and float(m["grad_norm"]) > 0
        assert "reward/digits" in m and "reward/arithmetic" in m
        assert float(m["mismatch/max_abs"]) < 1e-3, m["mismatch/max_abs"]  # engine vs trainer log-probs, fp32
    assert all(p.data_ptr() == ptrs[n] for n, p in params.items())
    assert any(not torch.equal(params[n], w) for n, w in w0.items())

    after = engine.generate(probe, n=1, temperature=0.0, max_tokens=6, seed=0)[0]
    with torch.no_grad():
        tf_after = teacher_forced_logprobs(model, probe, [after.token_ids])[0]
        tf_old_tokens = teacher_forced_logprobs(model, probe, [before.token_ids])[0]
    torch.testing.assert_close(after.logprobs, tf_after, rtol=0, atol=1e-3)  # the engine runs the new weights
    assert not torch.allclose(tf_old_tokens, before.logprobs, rtol=0, atol=1e-6)  # ... which changed the policy
