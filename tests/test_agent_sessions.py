"""Your own agent through the training process's server (rollout.agent): the merge rule,
token-exact recording, bitwise log-probs, faults, OpenAI's error shape, one GRPO step.

A tiny random model (qwen2-style ChatML tokenizer of the multi-turn tests) answers an
`openai.AsyncOpenAI` client over httpx's ASGI transport; nothing listens on a port.
Run: python -m pytest -q tests/test_agent_sessions.py
"""

import asyncio

import openai
import pytest
import torch
from agent_setup import WorkerEngine, chat_tokenizer
from engine_helpers import (
    one_thread,  # noqa: F401 (fixture)
    tiny_model,
)

from rlfuse.data import Prompt
from rlfuse.engine import LLM, EngineConfig
from rlfuse.kernels import use_backend
from rlfuse.rollout.agent.recording import AgentSession, Call, Segment
from rlfuse.run.config import RolloutConfig
from rlfuse.serve.agent_check import agent_setting
from rlfuse.serve.agents import MODEL_NAME, AgentSampler, EngineBase


@pytest.fixture(scope="module")
def setup():
    tok = chat_tokenizer("qwen2")
    return tiny_model(vocab=tok.vocab_size, std=0.05), tok


def _rows(*texts):
    return [Prompt(ids=[], text=t, columns={"prompt": t}, where="test") for t in texts]


def _sampler(setup, agent, numerics="exact", **rollout):
    model, tok = setup
    llm = LLM(model, tok, EngineConfig(max_num_seqs=8, numerics=numerics, seed=0))
    cfg = RolloutConfig(**{"max_turns": 4, "max_turn_tokens": 12, "max_total_tokens": 200, "agent": "x",
                           **rollout})
    return AgentSampler(EngineBase(llm), tok, cfg, agent)


def _call(prompt, out):
    return Call([], prompt, out, [0.5] * len(out), "stop", "", "", [], None, None)


def test_segments_merge_extending_calls_and_split_the_others():
    ses = AgentSession()
    ses.record(_call([1, 2], [3, 4]))
    ses.record(_call([1, 2, 3, 4, 9], [5]))      # extends: one segment, 9 is context
    ses.record(_call([1, 2, 7], [8]))            # edited history: a new segment
    ses.record(_call([1, 2, 3, 4, 9, 5, 6], [0]))  # extends the first one again
    a, b = ses.segments()
    assert a == Segment([1, 2], [3, 4, 9, 5, 6, 0], [1, 1, 0, 1, 0, 1], [.5, .5, 0, .5, 0, .5], 3)
    assert (b.prompt_ids, b.token_ids, b.loss_mask, b.calls) == ([1, 2, 7], [8], [1], 1)


def test_agent_calls_are_recorded_token_exact_and_merged(setup):
    async def agent(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        for _ in range(3):
            r = await client.chat.completions.create(model=MODEL_NAME, messages=messages)
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "content": "408"})
        return 1.0

    with use_backend("torch"):
        sampler = _sampler(setup, agent)
        samples = sampler.episodes(_rows("What is 12 * 34?", "hi"), n=2, temperature=1.0, seed=3)
    m = sampler.last_metrics
    assert len(samples) == 4 and all(s.env_reward == 1.0 for s in samples)
    assert m["rollout/agent_calls_per_episode"] == 3 and m["rollout/agent_merged_frac"] == pytest.approx(2 / 3)
    assert m["rollout/agent_split_samples"] == 0 and m["rollout/agent_rerendered_tokens"] == 0
    assert m["rollout/agent_tokens_trained"] == m["rollout/agent_tokens_sampled"] > 0
    for s, ses in zip(samples, sampler.last_sessions):
        # the model tokens of the sample are exactly the sampled ids, call after call
        model_ids = [t for t, k in zip(s.token_ids, s.loss_mask.tolist()) if k]
        assert model_ids == [t for c in ses.calls for t in c.output_ids]
        assert s.prompt_ids == ses.calls[0].prompt_ids
        for a, b in zip(ses.calls, ses.calls[1:]):  # each prompt = the last one + its output + the observation
            assert b.prompt_ids[:len(a.prompt_ids) + len(a.output_ids)] == a.prompt_ids + a.output_ids


def test_a_scripted_openai_agent_logprobs_equal_the_trainers_bitwise(setup):
    model, tok = setup
    with use_backend("torch"):
        r = agent_setting(model, tok, numerics="exact", seed=1)
        st = r.engine_stats
        assert st["rollout/agent_split_samples"] >= 1 and st["rollout/agent_merged_frac"] > 0.3, st
        assert r.tokens > 100 and r.bitwise_frac == 1.0 and r.first_diff is None, r


def test_faults_fail_the_episode_with_reward_zero(setup):
    async def agent(client, row):
        p = row["prompt"]
        if p == "raise":
            raise RuntimeError("agent bug")
        if p == "hang":
            await asyncio.sleep(60)
        if p == "none":
            return 1.0
        messages = [{"role": "user", "content": p}]
        for _ in range(10):  # past max_turns: the 4th call is refused
            r = await client.chat.completions.create(model=MODEL_NAME, messages=messages)
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": "again"})
        return 1.0

    with use_backend("torch"):
        sampler = _sampler(setup, agent, max_turns=3, agent_timeout_s=3.0)  # the others end well before
        samples = sampler.episodes(_rows("raise", "hang", "none", "loop"), n=1, temperature=1.0, seed=0)
    m = sampler.last_metrics
    assert [s.failed for s in sampler.last_sessions] == ["raised", "timeout", "no_calls", "max_turns"]
    assert all(s.env_reward == 0.0 and s.text == "" for s in samples)
    assert m["rollout/agent_failed_frac"] == 1.0 and m["rollout/agent_failed_timeout"] == 1
    assert len(sampler.last_sessions[3].calls) == 3


@pytest.mark.gpu
def test_the_decode_graphs_are_captured_before_the_worker_thread_starts(setup):
    """On a GPU the rollout captures the decode CUDA graphs on the calling thread, for the
    batch of all its sessions, before the engine worker thread runs: none is captured inside
    the rollout (where the worker would capture while agents wait)."""
    import copy
    import threading

    model, tok = setup
    llm = LLM(copy.deepcopy(model).cuda(), tok, EngineConfig(max_num_seqs=8, seed=0))
    decode, seen = llm.runner.decode, []
    assert decode is not None and decode.use_graphs and not decode.graphs
    capture = llm.capture_graphs

    def spy(up_to=None):
        capture(up_to=up_to)
        seen.append((threading.current_thread() is threading.main_thread(), up_to, len(decode.graphs)))
    llm.capture_graphs = spy

    async def agent(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        for _ in range(2):
            r = await client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6)
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "content": "408"})
        return 1.0

    cfg = RolloutConfig(max_turns=4, max_turn_tokens=12, max_total_tokens=200, agent="x")
    sampler = AgentSampler(EngineBase(llm), tok, cfg, agent)
    sampler.episodes(_rows("What is 12 * 34?", "hi"), n=2, temperature=1.0, seed=0)
    assert sampler.last_metrics["rollout/agent_failed_frac"] == 0
    assert len(seen) == 1 and seen[0][:2] == (True, 4) and seen[0][2] > 0, seen
    assert len(decode.graphs) == seen[0][2]  # the rollout's decode batches (<= 4) used those graphs only

def test_bad_requests_get_openais_errors(setup):
    seen = {}

    async def agent(client, row):
        msgs = [{"role": "user", "content": row["prompt"]}]
        for name, kw in (("model", dict(model="gpt-4o", messages=msgs)),
                         ("param", dict(model=MODEL_NAME, messages=msgs, temperature=-1)),
                         ("long", dict(model=MODEL_NAME, messages=[{"role": "user", "content": "x " * 3000}]))):
            try:
                await client.chat.completions.create(**kw)
            except openai.APIStatusError as e:
                seen[name] = (e.status_code, e.body.get("code"), e.body.get("param"))
        return 0.0

    with use_backend("torch"):
        _sampler(setup, agent).episodes(_rows("hi"), n=1, temperature=1.0, seed=0)
    assert seen["model"][0] == 404 and seen["model"][1] == "model_not_found"
    assert seen["param"][0] == 400 and "temperature" in seen["param"][2]
    assert seen["long"][:2] == (400, "context_length_exceeded")



def test_a_bad_session_body_gets_openais_400(setup):
    """The session route parses its body itself (one pydantic pass): invalid JSON, an unknown
    field, a lone surrogate (not valid Unicode) and a missing field each answer a 400 in
    OpenAI's shape, before any session or engine work."""
    import httpx

    from rlfuse.serve.session import serve_app
    _, tok = setup
    app = serve_app(WorkerEngine(tok, lambda ids, k: "hi"), MODEL_NAME)
    bodies = {"json": b'{"model": ', "field": b'{"model": "m", "messages": [{"role": "user"}], "bogus": 1}',
              "surrogate": b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
              "missing": b'{"model": "m"}'}

    async def post_all():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as http:
            return {k: await http.post("http://x/sessions/s/v1/chat/completions", content=b,
                                       headers={"content-type": "application/json"}) for k, b in bodies.items()}
    got = asyncio.run(post_all())
    assert all(r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error" for r in got.values())
    assert got["field"].json()["error"]["param"] == "bogus" and "unknown field" in got["field"].json()["error"]["message"]
    assert "not valid JSON" in got["json"].json()["error"]["message"]
    assert "not valid JSON" in got["surrogate"].json()["error"]["message"]
    assert got["missing"].json()["error"]["param"] == "messages"

def test_rlfuse_serve_mounts_sessions_with_streaming_and_n(setup):
    """`rlfuse serve`'s app (serve_app) answers the session routes: a session opens on its
    first call, n > 1 records every choice, a streamed answer parses in the openai client, and
    the trajectory route returns the recorded samples, token-exact."""
    import httpx

    from rlfuse.serve import serve_app

    model, tok = setup
    with use_backend("torch"):
        app = serve_app(LLM(model, tok, EngineConfig(max_num_seqs=8, numerics="exact", seed=0)), "tiny")
        worker = app.state.serve.worker.start()

        async def main():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=None) as http:
                client = openai.AsyncOpenAI(base_url="http://x/sessions/s1/v1", api_key="-", http_client=http,
                                            max_retries=0)
                msgs = [{"role": "user", "content": "hi"}]
                r = await client.chat.completions.create(model="tiny", messages=msgs, n=3, max_tokens=5)
                assert [c.index for c in r.choices] == [0, 1, 2]
                msgs.append(r.choices[1].message.model_dump(exclude_none=True))
                msgs.append({"role": "user", "content": "again"})
                chunks = [c async for c in await client.chat.completions.create(
                    model="tiny", messages=msgs, max_tokens=5, stream=True)]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert chunks[-1].choices[0].finish_reason in ("stop", "length")
                traj = (await http.get("http://x/sessions/s1/trajectory")).json()
                missing = (await http.get("http://x/sessions/nope/trajectory")).status_code
                return r, text, traj, missing

        try:
            r, text, traj, missing = asyncio.run(main())
        finally:
            worker.stop()
    assert missing == 404 and traj["calls"] == 4 and traj["rerendered_tokens"] == 0
    # choice 1's turn was continued: its sample holds the second call too; choices 0 and 2 stand alone
    samples = traj["samples"]
    assert len(samples) == 3 and sorted(sum(s["loss_mask"]) > 0 for s in samples) == [True] * 3
    longest = max(samples, key=lambda s: len(s["token_ids"]))
    assert longest["calls"] == 2 and all(s["calls"] == 1 for s in samples if s is not longest)
    assert isinstance(text, str)


def test_failed_episode_drop_leaves_it_out_of_loss_and_baseline(setup):
    from rlfuse.train.advantages import drop_rewards

    async def agent(client, row):
        if row["prompt"] == "raise":
            raise RuntimeError("agent bug")
        await client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])
        return 1.0 if row["prompt"] == "good" else 0.0

    with use_backend("torch"):
        samples = _sampler(setup, agent, failed_episode="drop").episodes(_rows("good", "raise"), n=1,
                                                                        temperature=1.0, seed=0)
    assert [s.dropped for s in samples] == [False, True] and float(samples[1].loss_mask.sum()) == 0
    r = drop_rewards(torch.tensor([1.0, 0.0, 0.5, 0.0]), [False, True, False, False], 2)
    assert r.tolist() == [1.0, 1.0, 0.5, 0.0]  # the dropped one takes its group's mean: advantage 0 for all
    with pytest.raises(ValueError, match="rollout.failed_episode"):
        from rlfuse.run.config.run_config import load_config
        load_config({"rollout": {"failed_episode": "skip"}}, [])
