"""Multi-turn bookkeeping with a scripted policy (no model) on Llama, Qwen2 and Qwen3 templates.

At every turn the ids given to the engine must equal encoding the chat template's rendering
of the whole conversation so far (the model's turns as it wrote them, the tool results, the
generation prompt): the append-only rule, checked on ids. Loss masks cover exactly the
model's tokens; the engine's log-probs land on them; metrics count turns, tool calls, errors,
timeouts and truncation; templates that are not append-only raise TemplateError naming the fix.
Run: python -m pytest -q tests/test_rollout_multi_turn.py
"""

import asyncio
import json
import time

import pytest
from agent_setup import ScriptedEngine, chat_tokenizer
from chat_templates import QWEN3_THINK, QWEN_LIKE

from rlfuse.rollout import ChatRenderer, Step, TemplateError, ToolEnv, ToolRunner, calculator, run_episodes
from rlfuse.rollout.agent.tool_calls import ToolCall, format_tool_call
from rlfuse.rollout.agent.tools import Tool
from rlfuse.run.config import RolloutConfig


def lookup(city: str, metric: bool = True) -> str:
    """Look up a city's temperature.

    Args:
        city: the city's name.
        metric: Celsius if true, else Fahrenheit.
    """
    return f"{city}: {21 if metric else 70} degrees"


def _call_text(family, call: ToolCall) -> str:
    if family == "llama":
        return json.dumps({"name": call.name, "parameters": call.arguments})
    return format_tool_call(call, "hermes")


def _policy(family, think: bool):
    """Turn 0: two tool calls (qwen) or one (llama); turn 1: the answer."""
    def policy(ids, k):
        if k == 0:
            calls = [ToolCall("calculator", {"expression": "12*34"})]
            if family != "llama":
                calls.append(ToolCall("lookup", {"city": "Oslo"}))
            text = "\n".join(_call_text(family, c) for c in calls)
        else:
            text = "The answer is 408."
        return f"<think>\nstep {k}\n</think>\n\n{text}" if think else text
    return policy


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_turn_by_turn_ids_equal_the_whole_conversation_rendered(family):
    tok = chat_tokenizer(family)
    runner = ToolRunner([Tool.from_function(calculator), Tool.from_function(lookup)], timeout_s=5)
    renderer = ChatRenderer(tok, tools=runner.schemas())
    assert renderer.tool_call_format == ("json" if family == "llama" else "hermes")
    think = family == "qwen3"
    eng = ScriptedEngine(tok, _policy(family, think))
    rows = [{"prompt": "What is 12 * 34?"}, {"prompt": "Weather in Oslo?"}]
    cfg = RolloutConfig(max_turns=4, max_turn_tokens=200, max_total_tokens=1000)
    episodes, m = run_episodes(eng, renderer, lambda: ToolEnv(runner), rows, cfg=cfg, group_size=2, seed=3)
    runner.close()
    assert len(episodes) == 4 and [e.prompt_index for e in episodes] == [0, 0, 1, 1]
    by_episode: dict[int, list[str]] = {}
    for rid in eng.prompts:
        by_episode.setdefault(int(rid.split("-")[0][2:]), []).append(rid)
    for ep in episodes:
        msgs = [{"role": "user", "content": rows[ep.prompt_index]["prompt"]}]
        policy = _policy(family, think)
        rids = sorted(by_episode[ep.index], key=lambda r: int(r.split("-t")[1].split("-")[0]))
        assert len(rids) == ep.turns == 2 and ep.stop == "done" and not ep.truncated
        for k, rid in enumerate(rids):
            want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                           tools=renderer.tools)
            assert eng.prompts[rid] == want, (family, k)
            text = policy(None, k)
            msgs.append({"role": "assistant", "content": text})
            if k == 0:
                msgs += [{"role": "tool", "content": "408"}]
                if family != "llama":
                    msgs += [{"role": "tool", "content": "Oslo: 21 degrees"}]
        # the trajectory is exactly the last request's prompt plus the last turn's ids
        assert ep.prompt_ids + ep.token_ids[:len(eng.prompts[rids[-1]]) - len(ep.prompt_ids)] == eng.prompts[rids[-1]]
        # masks: 1 exactly on the two model turns, whose log-probs are the engine's
        turn_ids = [tok.encode(policy(None, k), add_special_tokens=False) + tok.eos_token_ids[:1] for k in range(2)]
        n0, n1 = len(turn_ids[0]), len(turn_ids[1])
        assert ep.token_ids[:n0] == turn_ids[0] and ep.token_ids[-n1:] == turn_ids[1]
        assert ep.loss_mask == [1] * n0 + [0] * (len(ep.token_ids) - n0 - n1) + [1] * n1
        assert ep.logprobs[:n0] == [-(i + 1) / 8 for i in range(n0)]
        assert all(lp == 0.0 for lp, mk in zip(ep.logprobs, ep.loss_mask) if not mk)
        assert ep.info["obs_tokens"] == len(ep.token_ids) - n0 - n1
        assert ep.final_text.endswith("The answer is 408.")
    calls = 1 if family == "llama" else 2
    assert m["rollout/turns_mean"] == 2 and m["rollout/tool_calls_per_episode"] == calls
    assert m["rollout/tool_errors_per_episode"] == 0 and m["rollout/truncated_frac"] == 0


def test_templates_that_are_not_append_only_are_refused_with_the_fix():
    # Qwen3 with thinking off: the generation prompt's empty <think></think> is not rendered back
    tok = chat_tokenizer("qwen3")
    with pytest.raises(TemplateError, match="enable_thinking"):
        ChatRenderer(tok, template_kwargs={"enable_thinking": False})
    # Qwen3 with thinking on is fine for tool loops, but a new user message drops earlier <think>
    renderer = ChatRenderer(tok)

    class Feedback:
        def reset(self, row, *, seed):
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, turn):
            return Step(messages=[{"role": "user", "content": "Try again."}])

    eng = ScriptedEngine(tok, lambda ids, k: f"<think>\nhm {k}\n</think>\n\nguess {k}")
    with pytest.raises(TemplateError, match="role 'tool'"):
        run_episodes(eng, renderer, Feedback, [{"prompt": "Guess."}], cfg=RolloutConfig(max_turns=3))
    # a template that writes text between the model's content and its end token
    with pytest.raises(TemplateError, match="never sampled"):
        ChatRenderer(chat_tokenizer("qwen2", template=QWEN_LIKE))
    assert ChatRenderer(chat_tokenizer("qwen2", template=QWEN3_THINK)).placeholder.startswith("<think>")


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep.
    """
    time.sleep(seconds)
    return "woke"


def test_tool_errors_timeouts_and_limits_are_counted_and_never_stall():
    tok = chat_tokenizer("qwen2")
    runner = ToolRunner([Tool.from_function(calculator), Tool.from_function(slow), Tool.from_function(lookup)],
                        timeout_s=0.3)
    renderer = ChatRenderer(tok, tools=runner.schemas())
    long_city = "x" * 100
    scripts = {
        0: ['<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "done"],          # unknown tool
        1: ["<tool_call>\n{not json}\n</tool_call>", "done"],                                 # parse error
        2: [format_tool_call(ToolCall("slow", {"seconds": 3.0}), "hermes"), "done"],          # timeout
        3: [format_tool_call(ToolCall("calculator", {"expression": "1/0"}), "hermes"), "done"],  # tool error
        4: [format_tool_call(ToolCall("lookup", {"city": long_city}), "hermes"), "done"],     # long observation
        5: [format_tool_call(ToolCall("calculator", {"expression": "1+1"}), "hermes")] * 5,   # never stops
    }

    def policy(ids, k):
        text = tok.decode(ids)
        ep = next(i for i in scripts if f"case {i}?" in text)
        return scripts[ep][min(k, len(scripts[ep]) - 1)]

    eng = ScriptedEngine(tok, policy)
    cfg = RolloutConfig(max_turns=3, max_obs_tokens=32, obs_truncation="left")
    t0 = time.perf_counter()
    eps, m = run_episodes(eng, renderer, lambda: ToolEnv(runner), [{"prompt": f"case {i}?"} for i in scripts],
                          cfg=cfg)
    assert time.perf_counter() - t0 < 2.5  # the 3 s tool was abandoned at its 0.3 s limit
    runner.close()
    info = [e.info for e in eps]
    assert [i.get("tool_errors", 0) for i in info] == [1, 1, 0, 1, 0, 0]
    assert [i.get("tool_timeouts", 0) for i in info] == [0, 0, 1, 0, 0, 0]
    assert info[4]["obs_truncated"] == 1 and info[2].get("obs_truncated", 0) == 0
    assert [e.stop for e in eps] == ["done"] * 5 + ["max_turns"]
    assert [e.truncated for e in eps] == [False] * 5 + [True] and eps[5].turns == 3
    assert m["rollout/truncated_frac"] == pytest.approx(1 / 6)
    assert m["rollout/tool_timeouts_per_episode"] == pytest.approx(1 / 6)
    obs = tok.decode(eps[4].token_ids)
    assert "[truncated] " in obs and "Oslo" not in obs and "degrees" in obs  # left: the tail is kept


def test_async_env_turn_rewards_and_token_budget():
    tok = chat_tokenizer("qwen2")
    renderer = ChatRenderer(tok)

    class Counter:
        """Async steps; a per-turn reward; the episode reward from reward()."""
        def reset(self, row, *, seed):
            self.seed, self.n = seed, 0
            return [{"role": "user", "content": row["prompt"]}]

        async def step(self, turn):
            await asyncio.sleep(0.01)
            self.n += 1
            return Step(messages=[{"role": "tool", "content": str(self.n)}], done=self.n == 3, reward=0.5 * self.n)

        def reward(self):
            return 10.0 + self.n

    eng = ScriptedEngine(tok, lambda ids, k: f"turn {k}")
    eps, m = run_episodes(eng, renderer, Counter, [{"prompt": "count"}], cfg=RolloutConfig(max_turns=5),
                          group_size=2, seed=7)
    for e in eps:
        assert e.turns == 3 and e.turn_rewards == [0.5, 1.0, 1.5] and e.env_reward == 13.0 and e.stop == "done"

    class TurnRewardsOnly:  # no reward(): the episode's reward is the sum of the per-turn ones
        reset, step = Counter.reset, Counter.step

    eps, _ = run_episodes(eng, renderer, TurnRewardsOnly, [{"prompt": "count"}], cfg=RolloutConfig(max_turns=5))
    assert eps[0].env_reward == 3.0
    # a tight token budget truncates; so does a turn cut at max_turn_tokens
    eps, _ = run_episodes(eng, renderer, Counter, [{"prompt": "count"}], cfg=RolloutConfig(max_total_tokens=20))
    assert eps[0].truncated and eps[0].stop == "max_total_tokens" and len(eps[0].token_ids) < 20
    eng = ScriptedEngine(tok, lambda ids, k: "a long answer that goes on and on")
    eps, _ = run_episodes(eng, renderer, Counter, [{"prompt": "count"}], cfg=RolloutConfig(max_turn_tokens=3))
    assert all(len(t) > 0 for t in eps[0].turn_texts) and eps[0].turns == 3 and eps[0].truncated


def test_the_engine_keeps_decoding_while_a_tool_runs():
    """Episode 0 calls a 0.4 s tool once; episode 1 takes 20 quick turns meanwhile: its engine
    steps happen while the slow tool runs, and the engine idles only when nothing is left."""
    tok = chat_tokenizer("qwen2")
    window = []

    def timed(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long.
        """
        window.append(time.perf_counter())
        time.sleep(seconds)
        window.append(time.perf_counter())
        return "ok"

    runner = ToolRunner([Tool.from_function(timed), Tool.from_function(calculator)], timeout_s=5)
    renderer = ChatRenderer(tok, tools=runner.schemas())

    def policy(ids, k):
        slow = "slow one" in tok.decode(ids)
        if slow:
            return format_tool_call(ToolCall("timed", {"seconds": 0.4}), "hermes") if k == 0 else "done"
        return format_tool_call(ToolCall("calculator", {"expression": f"{k}+1"}), "hermes") if k < 19 else "done"

    eng = ScriptedEngine(tok, policy, step_s=0.005)
    eps, m = run_episodes(eng, renderer, lambda: ToolEnv(runner), [{"prompt": "slow one"}, {"prompt": "fast"}],
                          cfg=RolloutConfig(max_turns=25))
    runner.close()
    assert [e.turns for e in eps] == [2, 20]
    during = [t for t in eng.step_times if window[0] < t < window[1]]
    assert len(during) >= 10, len(during)
    assert 0.0 < m["rollout/engine_idle_frac"] < 1.0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sft_transcripts_follow_the_rollout_rule(family):
    """ChatRenderer.transcript lays a finished conversation out as the rollout would have:
    the same ids and the same loss mask as the scripted episode."""
    tok = chat_tokenizer(family)
    runner = ToolRunner([Tool.from_function(calculator), Tool.from_function(lookup)], timeout_s=5)
    renderer = ChatRenderer(tok, tools=runner.schemas())
    policy = _policy(family, family == "qwen3")
    eng = ScriptedEngine(tok, policy)
    (ep,), _ = run_episodes(eng, renderer, lambda: ToolEnv(runner), [{"prompt": "Weather?"}],
                            cfg=RolloutConfig())
    runner.close()
    msgs = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": policy(None, 0)},
            {"role": "tool", "content": "408"}]
    if family != "llama":
        msgs.append({"role": "tool", "content": "Oslo: 21 degrees"})
    msgs.append({"role": "assistant", "content": policy(None, 1)})
    ids, mask = renderer.transcript(msgs)
    assert ids == ep.prompt_ids + ep.token_ids and mask == [0] * len(ep.prompt_ids) + ep.loss_mask
