"""What a new user of tools is told (issue 37): a chat template that drops `tools` is warned
(the model would never see them), and so is a rollout in which no episode called a tool.
Scripted policy, no model. Run: python -m pytest -q tests/test_agent_warnings.py
"""

from __future__ import annotations

import logging
import types

from agent_setup import ScriptedEngine, chat_tokenizer
from chat_templates import SMOLLM2

from rlfuse.data import Prompt
from rlfuse.rollout import ChatRenderer, Tool, calculator
from rlfuse.rollout.agent.tool_calls import ToolCall, format_tool_call
from rlfuse.rollout.sampler import MultiTurnSampler
from rlfuse.run.config import DataConfig, RolloutConfig

SCHEMAS = [Tool.from_function(calculator).schema()]


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def test_a_template_that_drops_tools_is_warned(caplog):
    with caplog.at_level(logging.WARNING):
        ChatRenderer(chat_tokenizer("qwen2", template=SMOLLM2), tools=SCHEMAS)
    [msg] = _warnings(caplog, "does not render `tools`")
    assert "['calculator']" in msg and "rollout.chat_template" in msg
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ChatRenderer(chat_tokenizer("qwen2"), tools=SCHEMAS)  # Qwen2.5's template lists them
        ChatRenderer(chat_tokenizer("qwen2", template=SMOLLM2))  # no tools: nothing to show
    assert not _warnings(caplog, "does not render `tools`")
    from rlfuse.rollout import char_chat_tokenizer
    with caplog.at_level(logging.WARNING):  # the tiny models' template leaves tools out on purpose
        ChatRenderer(char_chat_tokenizer("0123456789+= ", SCHEMAS), tools=SCHEMAS)
    assert not _warnings(caplog, "does not render `tools`")


def _sampler(tok, policy):
    base = types.SimpleNamespace(llm=ScriptedEngine(tok, policy), wake=lambda: None, sleep=lambda: None)
    return MultiTurnSampler(base, tok, RolloutConfig(tools=["calculator"], max_turns=2), DataConfig())


def test_a_rollout_without_a_single_tool_call_is_said(caplog):
    tok = chat_tokenizer("qwen2")
    prompts = [Prompt([1], "2+2=", {"prompt": "What is 2+2?"}, "t:0")]
    quiet = _sampler(tok, lambda ids, k: "4")
    with caplog.at_level(logging.WARNING):
        for _ in range(4):
            quiet.episodes(prompts, n=2, temperature=1.0, seed=0)
    msgs = _warnings(caplog, "not one tool call")
    assert len(msgs) == 3 and "tools: calculator" in msgs[0] and "not repeated" in msgs[2]
    caplog.clear()
    call = format_tool_call(ToolCall("calculator", {"expression": "2+2"}), "hermes")
    busy = _sampler(tok, lambda ids, k: call if k == 0 else "4")
    with caplog.at_level(logging.WARNING):
        busy.episodes(prompts, n=2, temperature=1.0, seed=0)
    assert not _warnings(caplog, "not one tool call")


REWRITES_HISTORY = """{%- for m in messages %}<|im_start|>{{ m.role }}
{%- if m.role == 'assistant' and not loop.last %} (earlier) {% endif %}
{{ m.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_unrelated_to_qwen3_gets_the_general_hint():
    """Before: any template that was not append-only got "This is the Qwen3-style template..."."""
    import pytest

    from rlfuse.rollout import TemplateError
    with pytest.raises(TemplateError) as e:
        ChatRenderer(chat_tokenizer("qwen2", template=REWRITES_HISTORY))
    assert "Qwen3" not in str(e.value) and "renders earlier turns unchanged" in str(e.value)


def test_an_environment_shows_its_tools_to_the_template(tmp_path):
    """Before: with rollout.env no tool schemas reached the chat template."""
    (tmp_path / "my_env.py").write_text('''
from rlfuse.rollout import Step, calculator

def lookup(city: str) -> str:
    """Look up a city.

    Args:
        city: its name.
    """
    return city

class WithTools:
    tools = [calculator, lookup]
    def reset(self, row, *, seed):
        return [{"role": "user", "content": row["prompt"]}]
    def step(self, turn):
        return Step(done=True)
''')
    tok = chat_tokenizer("qwen2")
    base = types.SimpleNamespace(llm=ScriptedEngine(tok, lambda ids, k: "4"), wake=lambda: None, sleep=lambda: None)
    s = MultiTurnSampler(base, tok, RolloutConfig(env=f"{tmp_path / 'my_env.py'}:WithTools"), DataConfig())
    assert [t["function"]["name"] for t in s.renderer.tools] == ["calculator", "lookup"]
    prompt = tok.decode(s.renderer.start([{"role": "user", "content": "hi"}])[1])
    assert "lookup" in prompt and "calculator" in prompt


def test_trained_tokens_are_counted():
    """Before: completion_len/mean counted observation tokens and nothing counted the trained ones."""
    from rlfuse.rollout.agent.multi_turn import Episode, episode_metrics
    a = Episode(0, 0, [1], token_ids=[5, 6, 7, 8], loss_mask=[1, 1, 0, 0])
    b = Episode(1, 0, [1], token_ids=[5, 6], loss_mask=[1, 1])
    m = episode_metrics([a, b])
    assert m["rollout/trained_tokens_per_episode"] == 2.0 and m["rollout/trained_frac"] == 4 / 6


def test_sft_on_tool_transcripts_trains_the_rollouts_ids():
    """Issue 37: `rlfuse sft` on chat rows trained the newline after each end token and never
    gave the tools to the template (216 prompt ids against 403 in the rollout). With
    rollout.tools set, the warm-up lays chat rows out as the rollout does."""
    from rlfuse.data import build_sft_examples
    from rlfuse.rollout import episode_renderer

    tok = chat_tokenizer("qwen2")
    call = format_tool_call(ToolCall("calculator", {"expression": "12*34"}), "hermes")
    msgs = [{"role": "user", "content": "What is 12 * 34?"}, {"role": "assistant", "content": call},
            {"role": "tool", "content": "408"}, {"role": "assistant", "content": "408"}]
    renderer = episode_renderer(tok, RolloutConfig(tools=["calculator"]))
    assert [t["function"]["name"] for t in renderer.tools] == ["calculator"]
    data = DataConfig(max_prompt_len=1000)
    [ex] = build_sft_examples([("r:1", {"messages": msgs})], tok, data, 4096, chat_layout=renderer.transcript)
    ids, mask = renderer.transcript(msgs)
    assert ex.ids == ids and ex.mask == [bool(m) for m in mask]
    assert "calculator" in tok.decode(ex.ids[:mask.index(1)])  # the tools are in the prompt
    trained = [t for t, m in zip(ex.ids, ex.mask) if m]
    assert trained == tok.encode(call, add_special_tokens=False) + [min(renderer.eos_ids)] + \
        tok.encode("408", add_special_tokens=False) + [min(renderer.eos_ids)]  # no newline after an end token
    [plain] = build_sft_examples([("r:1", {"messages": msgs})], tok, data, 4096)
    assert sum(plain.mask) > sum(ex.mask)  # the template's own layout also trains what follows each end
