"""Recorded agent sessions: the token-exact trajectory of an agent that talks to the model
through an OpenAI-style chat API (rlfuse.serve.session serves it; rlfuse.serve.agents runs it).

A session is one episode. Each chat call is recorded as the ids the model saw (`prompt_ids`),
the ids it sampled (`output_ids`) with the engine's log-probs, the finish reason and the
tool calls parsed from the text. Two rules make the trajectory exact by construction:

  * Reuse. A request whose messages are an earlier call's messages, then the assistant
    message that call produced (same content and tool calls), then new messages (tool
    results, a user turn) gets the prompt
        earlier prompt_ids + earlier output_ids + renderer.observation(new messages)
    -- the sampled ids themselves, never their text re-encoded (`ChatRenderer.observation`
    checks the template is append-only; if it is not, the prompt is rendered afresh).
  * Merge. `segments` walks the calls in order: a call whose prompt starts with a segment's
    whole sequence (prompt + everything after it) extends that segment: the new prompt
    tokens enter as context (mask 0), the call's output as model tokens (mask 1). Any other
    call starts a new segment (a template that strips earlier reasoning, an agent that
    edits its history, a sub-agent): the episode then has several samples sharing its reward.
A fresh render puts an assistant message this session produced back as the text the model
wrote (its sampled ids decoded, tool-call markup included); those are context tokens of a
new segment, counted in `rerendered_tokens`, never trained on.
Test: python -m pytest -q tests/test_agent_sessions.py
"""

from __future__ import annotations

import dataclasses
import json

from rlfuse.rollout.agent.chat import ChatRenderer, Conversation, TemplateError
from rlfuse.rollout.agent.tool_calls import ToolCall, parse_tool_calls

FAILURES = ("raised", "timeout", "no_calls", "max_turns", "token_budget", "context")
"""Why an agent episode fails: the agent raised, ran past rollout.agent_timeout_s, made no
call, asked for more calls than rollout.max_turns, past rollout.max_total_tokens, or sent a
prompt longer than the model's context."""


@dataclasses.dataclass(slots=True)
class Call:
    """One recorded chat call."""
    messages: list[dict]
    """The request's messages, normalized (`message_key`)."""
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """stop | length (the engine's)."""
    text: str
    """The model's text (sampled ids decoded without the end token, special tokens kept)."""
    content: str | None
    """`text` without its tool-call markup: the message content returned to the agent."""
    tool_calls: list[ToolCall]
    renderer: ChatRenderer
    conv: Conversation
    """The rendering state at this call's generation prompt (for the reuse rule)."""


@dataclasses.dataclass(slots=True)
class Segment:
    """One training sample of an episode: merged calls, as `Sample` fields."""
    prompt_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    calls: int = 0

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.token_ids


def _tool_key(calls) -> tuple:
    return tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in calls)


def message_key(m: dict) -> tuple:
    """What identifies a message for the reuse rule: role, text content and tool calls by
    (name, arguments) -- ids of tool calls and the spelling of their JSON arguments vary by
    client library, so they are not compared."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for tc in m.get("tool_calls") or ():
        fn = tc.get("function", {}) if isinstance(tc, dict) else {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                args = {"__raw__": args}
        calls.append(ToolCall(str(fn.get("name", "")), args if isinstance(args, dict) else {"__raw__": args}))
    return m.get("role"), (content or "").strip(), _tool_key(calls)


def split_content(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """(content without tool-call markup, or None if nothing is left; the parsed tool calls)."""
    calls, _ = parse_tool_calls(text, fmt)
    if not calls:
        return text, []
    if fmt == "hermes":
        rest, i = [], 0
        while (a := text.find("<tool_call>", i)) >= 0 and (b := text.find("</tool_call>", a)) >= 0:
            rest.append(text[i:a])
            i = b + len("</tool_call>")
        rest.append(text[i:])
        content = "".join(rest).strip()
    else:  # json: the whole text is the call
        content = ""
    return (content or None), calls


class AgentSession:
    """One episode's calls and the reuse rule (see the module docstring)."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.calls: list[Call] = []
        self.rerendered_tokens = 0
        self.failed = ""
        """Why the episode failed ('' if it did not): one of FAILURES."""
        self.reward: float | None = None
        self.info: dict = {}

    def _produced(self, call: Call) -> tuple:
        return "assistant", (call.content or "").strip(), _tool_key(call.tool_calls)

    def _raw(self, m: dict) -> dict:
        """A message for a fresh render: an assistant message this session produced becomes the
        text the model wrote; others as given."""
        if m.get("role") == "assistant":
            key = message_key(m)
            for c in reversed(self.calls):
                if self._produced(c) == key:
                    self.rerendered_tokens += len(c.output_ids)
                    return {"role": "assistant", "content": c.text}
        return m

    def prompt(self, renderer: ChatRenderer, messages: list[dict]) -> tuple[list[int], Conversation, bool]:
        """(prompt ids, rendering state, whether the sampled ids of an earlier call were reused)."""
        keys = [message_key(m) for m in messages]
        for c in reversed(self.calls):
            k = len(c.messages)
            if (c.renderer is renderer and len(keys) > k and [message_key(m) for m in c.messages] == keys[:k]
                    and keys[k] == self._produced(c)):
                conv = Conversation([dict(m) for m in c.conv.messages], c.conv.text)
                try:
                    obs = renderer.observation(conv, c.output_ids, c.finish_reason, messages[k + 1:])
                except TemplateError:
                    break  # not append-only for these messages: render afresh (a new segment)
                return c.prompt_ids + c.output_ids + obs, conv, True
        conv, ids = renderer.start([self._raw(m) for m in messages])
        return ids, conv, False

    def record(self, call: Call) -> None:
        self.calls.append(call)

    @property
    def sampled_tokens(self) -> int:
        return sum(len(c.output_ids) for c in self.calls)

    def segments(self) -> list[Segment]:
        """The episode's training samples by the merge rule, in the order they were started."""
        segs: list[Segment] = []
        for c in self.calls:
            seg = next((s for s in reversed(segs) if c.prompt_ids[:len(s.sequence)] == s.sequence), None)
            if seg is None:
                seg = Segment(list(c.prompt_ids))
                segs.append(seg)
            ctx = c.prompt_ids[len(seg.sequence):]
            seg.token_ids += ctx + c.output_ids
            seg.loss_mask += [0] * len(ctx) + [1] * len(c.output_ids)
            seg.logprobs += [0.0] * len(ctx) + list(c.logprobs)
            seg.calls += 1
        return segs


COUNTED_METRICS = ("rollout/agent_split_samples", "rollout/agent_rerendered_tokens", "rollout/agent_tokens_sampled",
                   "rollout/agent_tokens_trained", *(f"rollout/agent_failed_{why}" for why in FAILURES))
"""The keys of `session_metrics` that are a rollout's totals, not per-episode means or
fractions: data-parallel ranks sum them (rlfuse.run.distributed.episode_metrics_on_ranks)."""


def session_metrics(sessions: list[AgentSession], trained: list[Segment]) -> dict:
    """rollout/agent_* metrics of a rollout: calls per episode, the share of calls merged into
    an earlier call's sample, split samples (segments beyond one per episode), failures,
    re-rendered context tokens, and tokens trained / tokens sampled."""
    n = max(len(sessions), 1)
    calls = sum(len(s.calls) for s in sessions)
    segs = [s.segments() for s in sessions]
    n_segs = sum(len(x) for x in segs)
    sampled = sum(s.sampled_tokens for s in sessions)
    trained_tokens = sum(sum(t.loss_mask) for t in trained)
    m = {"rollout/agent_calls_per_episode": calls / n,
         "rollout/agent_merged_frac": (calls - n_segs) / calls if calls else 0.0,
         "rollout/agent_split_samples": float(n_segs - sum(1 for x in segs if x)),
         "rollout/agent_failed_frac": sum(bool(s.failed) for s in sessions) / n,
         "rollout/agent_rerendered_tokens": float(sum(s.rerendered_tokens for s in sessions)),
         "rollout/agent_tokens_sampled": float(sampled),
         "rollout/agent_tokens_trained": float(trained_tokens)}
    for why in FAILURES:
        m[f"rollout/agent_failed_{why}"] = float(sum(s.failed == why for s in sessions))
    return m
