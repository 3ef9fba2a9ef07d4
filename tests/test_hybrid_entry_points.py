"""Every entry point on a hybrid model (issue 34, item 5): rlfuse's tiny Qwen3.5 (three Gated
DeltaNet layers, one gated full-attention layer) saved as an HF folder with a byte tokenizer,
through the Python API's four trainers (SFT, then GRPO, DPO and PPO on the same tensors, the
engine generating the rollouts), `rlfuse eval`, and one chat request to `rlfuse serve`'s
app. `rlfuse generate` and `rlfuse check --hybrid`: tests/test_engine_hybrid.py. A few steps
each: these prove the paths run on a hybrid model, not that they learn (tests/test_demo_hybrid.py).
Run: python -m pytest -q tests/test_hybrid_entry_points.py
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import one_thread  # noqa: F401 (fixture)
from serve_helpers import write_model_folder

from rlfuse import DPOTrainer, GRPOTrainer, PPOTrainer, SFTConfig, SFTTrainer
from rlfuse.cli import main

SMALL = {"model": {"dtype": "float32", "device": "cpu"}, "engine": {"max_num_seqs": 8, "max_model_len": 64},
         "data": {"max_prompt_len": 16},
         "optim": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"},
         "logging": {"tensorboard": False, "progress": False}, "checkpoint": {"save_final": False}}
SFT_ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(3) for b in range(3)]
GRPO_ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("hybrid_model"), hybrid=True)


def _moved(before, model) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def test_api_sft_grpo_dpo_ppo_and_generate(folder, tmp_path):
    sft = SFTTrainer(str(folder), train_dataset=SFT_ROWS, config=SMALL, run_dir=tmp_path / "sft",
                     args=SFTConfig(steps=1, batch_size=4, micro_batch_tokens=64))
    assert sft.model.config.is_hybrid
    before = _snapshot(sft.model)
    assert sft.train()["steps"] == 1 and _moved(before, sft.model)

    def codes(prompts, completions, **kw):  # varies within every group (sampled text differs)
        return [float(sum(map(ord, c)) % 97) for c in completions]
    grpo = GRPOTrainer(sft, reward_funcs=[codes], train_dataset=GRPO_ROWS, config=SMALL, run_dir=tmp_path / "grpo",
                       args={"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4})
    before = _snapshot(grpo.model)
    res = grpo.train()
    assert res["steps"] == 1 and _moved(before, grpo.model)
    assert all(torch.isfinite(torch.as_tensor(v)) for k, v in res["history"][0].items() if k.startswith("loss"))

    pairs = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a in range(2) for b in range(2)]
    dpo = DPOTrainer(grpo, train_dataset=pairs, config=SMALL, run_dir=tmp_path / "dpo", args={"steps": 1, "batch_size": 4})
    before = _snapshot(dpo.model)
    assert dpo.train()["steps"] == 1 and _moved(before, dpo.model)

    ppo = PPOTrainer(dpo, reward_funcs=[codes], train_dataset=GRPO_ROWS, config=SMALL, run_dir=tmp_path / "ppo",
                     args={"steps": 1, "prompts_per_step": 2, "max_new_tokens": 4})
    before = _snapshot(ppo.model)
    assert ppo.model is sft.model and ppo.train()["steps"] == 1 and _moved(before, ppo.model)
    texts = ppo.generate(["1+2=", "2+0="], max_tokens=4)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert ppo.generate("1+2=", max_tokens=4) == texts[:1]  # greedy: the same again


def test_eval_cli_on_a_hybrid_checkpoint(folder, tmp_path):
    from train_setup import tiny_recipe

    recipe = tiny_recipe(tmp_path / "recipe.yaml", engine={"max_num_seqs": 8, "max_model_len": 64})
    assert main(["eval", str(recipe), "--checkpoint", str(folder), "--run-dir", str(tmp_path / "eval"),
                 "--limit", "4"]) == 0
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["num_problems"] == 4.0


def test_serve_answers_a_chat_request(folder):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    openai = pytest.importorskip("openai")
    from serve_helpers import LocalServer

    from rlfuse.api import load_model
    from rlfuse.engine import LLM, EngineConfig
    from rlfuse.serve import build_app

    model, tok = load_model(folder, device="cpu")
    llm = LLM(model, tok, EngineConfig(max_model_len=256, max_num_seqs=4))
    with LocalServer(build_app(llm, "tiny35")) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "Hi"}]
        r = client.chat.completions.create(model="tiny35", messages=msgs, max_tokens=6, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
        # the conversation's next turn continues the finished sequence's state (a parked sequence)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "Ok"}]
        r2 = client.chat.completions.create(model="tiny35", messages=msgs, max_tokens=6, temperature=0)
        assert r2.usage.completion_tokens >= 1 and llm.scheduler.parked.taken == 1
