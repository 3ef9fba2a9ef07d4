"""Real agent harnesses, unchanged, trained through the training process's server
(rlfuse.recipes.agent_harnesses): a plain `openai` loop, the OpenAI Agents SDK, LangGraph's
prebuilt ReAct agent over langchain-openai.

  * a scripted engine (it writes the calculator call, then the tool's result as the answer)
    checks each harness's round trip: the tool call reaches the harness as OpenAI
    `tool_calls`, the result comes back, the second call reuses the sampled ids and merges;
  * one GRPO step on the tiny random model per harness: every sampled token is trained,
    none re-rendered, the trainer's log-probs equal the rollout's (exact numerics);
  * (slow) each harness learns the calculator task over 3 seeds, as `rlfuse demo --agent`.
Run: python -m pytest -q tests/test_agent_harnesses.py   (slow: -m slow)
"""

import json
import math
import string

import pytest
import torch
from agent_setup import WorkerEngine
from train_setup import one_thread

from rlfuse.data import Prompt
from rlfuse.recipes.agent_demo import agent_config, run_agent_demo
from rlfuse.recipes.agent_harnesses import CALCULATOR
from rlfuse.rollout import char_chat_tokenizer
from rlfuse.run.config import RolloutConfig, replace
from rlfuse.serve import AgentSampler, EngineBase, agent_sampler
from rlfuse.train import open_session, run_grpo, run_ppo

HARNESSES = ["openai_loop", "agents_sdk", "langgraph"]
NEEDS = {"agents_sdk": "agents", "langgraph": "langgraph.prebuilt"}


def _harness(name):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    return f"rlfuse.recipes.agent_harnesses:{name}"


def _policy(tok):
    def policy(ids, k):
        text = tok.decode(ids, skip_special_tokens=False)
        if "<r>" not in text:  # no tool result yet: call the calculator on the problem
            expr = text.split("<u>")[-1].split("<a>")[0].rstrip("=")
            return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expr
        return text.split("<r>")[-1].split("<a>")[0]  # answer with the tool's result
    return policy


@pytest.mark.parametrize("name", HARNESSES)
def test_harness_round_trip_is_recorded_token_exact(name):
    spec = _harness(name)
    tok = char_chat_tokenizer(string.printable, [CALCULATOR])
    cfg = RolloutConfig(max_turns=4, max_turn_tokens=64, max_total_tokens=256, agent=spec)
    sampler = AgentSampler(EngineBase(WorkerEngine(tok, _policy(tok))), tok, cfg, spec)
    rows = [Prompt([], p, {"prompt": p, "answer": str(eval(p[:-1]))}, "t") for p in ("12*34=", "7*8=")]
    samples = sampler.episodes(rows, n=2, temperature=1.0, seed=0)
    m = sampler.last_metrics
    assert m["rollout/agent_failed_frac"] == 0, m
    assert m["rollout/agent_calls_per_episode"] == 2 and m["rollout/agent_merged_frac"] == 0.5, m
    assert m["rollout/agent_rerendered_tokens"] == 0 and m["rollout/agent_split_samples"] == 0
    assert m["rollout/agent_tokens_trained"] == m["rollout/agent_tokens_sampled"] > 0
    for s, ses, row in zip(samples, sampler.last_sessions, [r.columns for r in rows for _ in range(2)]):
        first, second = ses.calls
        assert [c.name for c in first.tool_calls] == ["calculator"] and second.text == row["answer"] == s.text
        assert second.prompt_ids[:len(first.prompt_ids) + len(first.output_ids)] == \
            first.prompt_ids + first.output_ids  # the sampled ids reused, not the text re-encoded
        obs = tok.decode(second.prompt_ids[len(first.prompt_ids) + len(first.output_ids):], skip_special_tokens=False)
        assert obs == f"<r>{row['answer']}<a>", obs
        model_ids = [t for t, k in zip(s.token_ids, s.loss_mask.tolist()) if k]
        assert model_ids == first.output_ids + second.output_ids
        assert torch.equal(s.logprobs[s.loss_mask.bool()], torch.tensor(first.logprobs + second.logprobs))


@pytest.mark.parametrize("name", HARNESSES)
def test_one_grpo_step_through_a_harness(tmp_path, name):
    spec = _harness(name)
    cfg = agent_config("ci", str(tmp_path), 0)
    tok = open_session(replace(cfg, **{"logging.run_dir": str(tmp_path / "tok")})).tokenizer  # calculator tokens
    cfg = replace(cfg, **{"rollout.tools": [], "rollout.agent": spec, "grpo.steps": 1, "grpo.prompts_per_step": 2,
                          "grpo.group_size": 2, "grpo.check_every": 1, "data.eval_size": 2,
                          "engine.numerics": "exact"})
    with one_thread():
        res = run_grpo(cfg, session=open_session(cfg, tokenizer=tok, sampler_factory=agent_sampler))
    h = res["history"][-1]
    assert float(h["rollout/agent_tokens_trained"]) == float(h["rollout/agent_tokens_sampled"]) > 0, h
    assert float(h["rollout/agent_rerendered_tokens"]) == 0
    assert float(h["mismatch/full_max_abs"]) == 0.0 and float(h["mismatch/max_abs"]) == 0.0, h


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", HARNESSES)
def test_each_harness_learns_the_calculator(tmp_path, name, seed):
    """As tests/test_agent_learning.py, GRPO through each harness, unchanged (1.5-3.5 min a
    seed on 2 cores)."""
    _harness(name)  # skips when the harness's library is absent
    with one_thread():
        res = run_agent_demo("ci", str(tmp_path), seed=seed, echo=lambda s: None, harness=name)
    summary = json.dumps({k: v for k, v in res.items() if k != "grpo_history"})
    margin = 2 * math.sqrt(2) * math.sqrt(0.25 / res["eval_problems"])
    assert res["accuracy_grpo"] - res["accuracy_sft"] > margin, summary
    assert res["accuracy_grpo"] > res["accuracy_no_tool"] + 3 * margin, summary
    hist = res["grpo_history"]
    assert all(float(h["rollout/agent_calls_per_episode"]) > 1.5 for h in hist), summary  # episodes call the tool
    assert all(float(h["rollout/agent_tokens_trained"]) == float(h["rollout/agent_tokens_sampled"]) for h in hist)
    # the demo runs fast numerics: the SDK's and LangGraph's re-rendered turns split an episode into
    # samples whose shared trunk the trainer packs once (other GEMM shapes than the engine's), so the
    # log-probs agree to rounding (6e-6..9e-6 seen); bitwise in exact numerics is what
    # test_one_grpo_step_through_a_harness checks for each harness
    assert max(float(h["mismatch/max_abs"]) for h in hist) < 1e-4, summary


def test_one_ppo_step_through_the_plain_loop(tmp_path):
    cfg = agent_config("ci", str(tmp_path), 0)
    tok = open_session(replace(cfg, **{"logging.run_dir": str(tmp_path / "tok")})).tokenizer
    cfg = replace(cfg, **{"rollout.tools": [], "rollout.agent": _harness("openai_loop"), "ppo.steps": 1,
                          "ppo.prompts_per_step": 2, "ppo.samples_per_prompt": 2, "data.eval_size": 2,
                          "engine.numerics": "exact"})
    with one_thread():
        res = run_ppo(cfg, session=open_session(cfg, tokenizer=tok, sampler_factory=agent_sampler))
    h = res["history"][-1]
    assert float(h["rollout/agent_tokens_trained"]) == float(h["rollout/agent_tokens_sampled"]) > 0, h
    assert math.isfinite(float(h["value_loss"] if "value_loss" in h else h["loss"])), h
