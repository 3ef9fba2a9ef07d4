"""An agent on a Qwen3-style thinking template (tests/chat_templates.QWEN3_THINK) through the
session server, with a model that writes a <think> block every turn (issue 35's target: 0
re-tokenized tokens and tokens trained == sampled "including with a Qwen3 thinking template
that strips earlier reasoning"):
  * tool results between calls: the template keeps the reasoning, the calls merge into one
    sample whose model tokens are the sampled ids;
  * a new user message between calls: the template strips the earlier reasoning, every call
    starts its own sample; each is trained on exactly its sampled ids, the stripped history
    is context only.
Run: python -m pytest -q tests/test_agent_thinking.py
"""

import pytest
from agent_setup import WorkerEngine, chat_tokenizer

from rlfuse.data import Prompt
from rlfuse.run.config import RolloutConfig
from rlfuse.serve import AgentSampler
from rlfuse.serve.agents import MODEL_NAME, EngineBase

REASONING = "I should multiply the numbers first."
ANSWER = "The answer is 408."


def _agent(role):
    async def agent(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        for _ in range(3):
            r = await client.chat.completions.create(model=MODEL_NAME, messages=messages)
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": role, "content": "You are a helpful assistant." if role == "user" else "408"})
        return 1.0
    return agent


@pytest.mark.parametrize("role", ["tool", "user"])
def test_thinking_template_trains_exactly_the_sampled_ids(role):
    tok = chat_tokenizer("qwen3")
    engine = WorkerEngine(tok, lambda ids, k: f"<think>\n{REASONING}\n</think>\n\n{ANSWER}")
    cfg = RolloutConfig(max_turns=4, max_turn_tokens=64, max_total_tokens=1024, agent="x")
    sampler = AgentSampler(EngineBase(engine), tok, cfg, _agent(role))
    samples = sampler.episodes([Prompt([], "What is 12 * 34?", {"prompt": "What is 12 * 34?"}, "t")], n=2,
                               temperature=1.0, seed=0)
    m = sampler.last_metrics
    assert m["rollout/agent_failed_frac"] == 0 and m["rollout/agent_calls_per_episode"] == 3, m
    assert m["rollout/agent_tokens_trained"] == m["rollout/agent_tokens_sampled"] > 0, m
    for s, ses in zip(samples, sampler.last_sessions):
        segs = ses.segments()
        pieces = [*(s.split_parts or []), s]
        assert len(pieces) == len(segs)
        if role == "tool":  # append-only: one sample, reasoning kept, the sampled ids reused
            assert len(segs) == 1 and ses.rerendered_tokens == 0
            last = tok.decode(ses.calls[2].prompt_ids, skip_special_tokens=False)
            assert last.count(REASONING) == 2 and last.count(ANSWER) == 2
            seg = segs[0]
            model = [t for t, k in zip(seg.token_ids, seg.loss_mask) if k]
            assert model == [t for c in ses.calls for t in c.output_ids]
            assert [lp for lp, k in zip(seg.logprobs, seg.loss_mask) if k] == [lp for c in ses.calls
                                                                              for lp in c.logprobs]
            continue
        # a new user turn: the template drops the earlier <think> blocks, so no call extends another
        # each fresh render writes every earlier turn back as its text (context, counted per call)
        assert len(segs) == 3 and ses.rerendered_tokens == sum(len(c.output_ids) for i in range(3)
                                                               for c in ses.calls[:i])
        for seg, piece, c in zip(segs, pieces, ses.calls):
            assert seg.token_ids == c.output_ids and seg.loss_mask == [1] * len(c.output_ids)  # sampled ids only
            assert seg.logprobs == c.logprobs and piece.token_ids == c.output_ids
            assert piece.loss_mask.tolist() == [1.0] * len(c.output_ids)
        last = tok.decode(ses.calls[2].prompt_ids, skip_special_tokens=False)
        assert last.count(ANSWER) == 2 and REASONING not in last  # the history is the answers, stripped
