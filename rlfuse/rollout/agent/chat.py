"""Chat rendering for multi-turn rollouts: a trajectory is token ids, observations are appended as ids.

The token bookkeeping rule. A trajectory is
    prompt_ids | model turn 1 | obs 1 | model turn 2 | obs 2 | ...
where the prompt is the chat template's rendering of the first messages with the generation
prompt, each model turn is exactly the ids the engine sampled (never decoded and re-encoded),
and each observation is `encode(rest_of_turn_end + delta)`:
  * rest_of_turn_end: what the template writes after an assistant message's content
    ("<|im_end|>\\n" for ChatML), minus the end token the model sampled itself (a turn that
    stopped on `max_tokens` gets all of it);
  * delta: render(history + observation, generation prompt) minus render(history), with the
    history's assistant contents replaced by a placeholder (model text is never re-rendered).
This gives the ids that rendering the whole conversation gives, provided the template is
append-only: rendering a longer conversation only appends text. `ChatRenderer` checks that
at construction on a probe conversation (text and ids) and again at every observation
(text, for the roles actually used), and raises `TemplateError` naming the fix otherwise --
e.g. Qwen3's template drops earlier <think> blocks once a new user message follows, and
with enable_thinking=False its generation prompt holds an empty <think></think> that its
rendering of the same turn omits.
Test: python -m pytest -q tests/test_rollout_multi_turn.py
"""

from __future__ import annotations

import dataclasses
import logging

from rlfuse.run import char_tokenizer
from rlfuse.run.config import TOOL_CALL_FORMATS

log = logging.getLogger(__name__)

ANSWER = "ANSWER"
REASON = "REASON"
# placeholder assistant contents tried in order: plain text, then a reasoning block (templates
# that render <think> differently for the last turn need one in every turn to stay append-only)
_PLACEHOLDERS = (ANSWER, f"<think>\n{REASON}\n</think>\n\n{ANSWER}")


class TemplateError(ValueError):
    """The chat template cannot give append-only token ids for this conversation."""


@dataclasses.dataclass(slots=True)
class Conversation:
    """One episode's rendering state: the conversation's structure (assistant contents are
    the placeholder) and its text as rendered up to the current generation prompt."""
    messages: list[dict]
    text: str


def _first_diff(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _snippet(s: str, i: int) -> str:
    return repr(s[max(0, i - 40):i + 40])


class ChatRenderer:
    """Renders prompts and observations for one tokenizer + chat template + tool list.

    `tools`: JSON schemas ({"type": "function", "function": {...}}) given to the template;
    `chat_template`: a template name or text (default: the tokenizer's); `template_kwargs`:
    extra template variables (e.g. enable_thinking); `tool_call_format`: "hermes"
    (<tool_call>{json}</tool_call>), "json" (a bare {"name", "arguments"|"parameters"}
    object, Llama-3.1 style) or "auto" (from the template's markup)."""

    def __init__(self, tokenizer, *, tools: list[dict] | None = None, chat_template: str | None = None,
                 template_kwargs: dict | None = None, tool_call_format: str = "auto", probe_roles=("tool",)):
        self.tok = tokenizer
        self.tools = list(tools) if tools else None
        self.chat_template = chat_template
        self.kwargs = dict(template_kwargs or {})
        eos = list(getattr(tokenizer, "eos_token_ids", []) or [])
        if not eos:
            raise TemplateError("the tokenizer has no EOS id: a model turn could not end")
        self.eos_ids = frozenset(eos)
        self.eos_texts = {e: tokenizer.decode([e], skip_special_tokens=False) for e in eos}
        try:
            self._source = self.tok.get_chat_template(self.chat_template, self.tools)
        except ValueError:
            self._source = ""
        self.tool_call_format = self._resolve_format(tool_call_format)
        self.placeholder = self._probe(probe_roles)
        self._check_tools_rendered()

    # ------------------------------------------------------------------ rendering
    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                                chat_template=self.chat_template, tools=self.tools, **self.kwargs)
        except ValueError as e:
            roles = [m.get("role") for m in messages]
            raise TemplateError(f"chat template: rendering a conversation with roles {roles} failed: {e}. If "
                                "the template has no 'tool' role, send observations as 'user' messages (an "
                                "environment's Step.messages) or give a template that has one") from e

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def start(self, messages: list[dict]) -> tuple[Conversation, list[int]]:
        """The first prompt: (conversation state, prompt ids)."""
        if not messages:
            raise ValueError("an episode needs at least one message to start from")
        text = self.render(messages, True)
        return Conversation([dict(m) for m in messages], text), self.encode(text)

    def turn_end(self, conv: Conversation, full: str | None = None) -> str:
        """What the template writes after the assistant content that ends `conv`; `full`: the
        rendering of conv.messages without a generation prompt, if the caller has it."""
        full = self.render(conv.messages, False) if full is None else full
        head = conv.text + self.placeholder
        if not full.startswith(head):
            i = _first_diff(full, head)
            raise TemplateError(
                "chat template is not append-only: the generation prompt plus the model's turn "
                f"({_snippet(head, i)}) is not how the template renders that turn ({_snippet(full, i)}), "
                f"at character {i}. {_fix_hint(self._source)}")
        return full[len(head):]

    def observation(self, conv: Conversation, model_ids: list[int], finish_reason: str,
                    messages: list[dict]) -> list[int]:
        """Ids to append after a model turn (`model_ids`, as sampled; `finish_reason` "stop"
        or "length"): the end of the model's turn, the observation `messages`, and the next
        generation prompt. Updates `conv`."""
        conv.messages.append({"role": "assistant", "content": self.placeholder})
        closed = self.render(conv.messages, False)
        tail = self.turn_end(conv, closed)  # the same rendering: one of the three a turn costs
        conv.messages.extend(dict(m) for m in messages)
        after = self.render(conv.messages, True)
        if not after.startswith(closed):
            i = _first_diff(after, closed)
            raise TemplateError(
                f"chat template is not append-only: appending messages with roles {[m.get('role') for m in messages]} "
                f"re-renders the earlier conversation ({_snippet(closed, i)} becomes {_snippet(after, i)} at "
                f"character {i}). {_fix_hint(self._source)}")
        rest = tail
        last = model_ids[-1] if model_ids else None
        if finish_reason == "stop" and last in self.eos_ids:
            end = self.eos_texts[last]
            if not tail.startswith(end):
                raise TemplateError(f"chat template: the model ended its turn with {end!r}, but the template ends "
                                    f"an assistant turn with {tail!r}; the template writes text the model never "
                                    "sampled. Give a template whose assistant turns end with the EOS token")
            rest = tail[len(end):]
        conv.text = after
        return self.encode(rest + after[len(closed):])

    def transcript(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """(ids, loss mask) of a whole conversation laid out by the rollout's rule: the
        messages before the first assistant one are the prompt, each assistant content is
        encoded as the model would write it (its ids, then the first EOS id) with mask 1,
        everything else is rendered by `observation` with mask 0. SFT on tool transcripts
        thus trains on exactly the ids a rollout produces."""
        k = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if k is None or k == 0:
            raise ValueError("a transcript needs prompt messages, then at least one assistant message")
        conv, ids = self.start(messages[:k])
        mask = [0] * len(ids)
        eos = min(self.eos_ids)
        i = k
        while i < len(messages):
            turn = self.encode(messages[i]["content"]) + [eos]
            ids += turn
            mask += [1] * len(turn)
            j = i + 1
            while j < len(messages) and messages[j]["role"] != "assistant":
                j += 1
            if j < len(messages):
                obs = self.observation(conv, turn, "stop", messages[i + 1:j])
                ids += obs
                mask += [0] * len(obs)
            i = j
        return ids, mask

    # ------------------------------------------------------------------ checks
    def _resolve_format(self, fmt: str) -> str:
        if fmt not in TOOL_CALL_FORMATS:
            raise ValueError(f"tool_call_format must be one of {TOOL_CALL_FORMATS}, got {fmt!r}")
        if fmt != "auto":
            return fmt
        src = self._source
        if "<tool_call>" in src:
            fmt, why = "hermes", "the chat template writes <tool_call> tags"
        elif "ipython" in src or '"parameters"' in src:
            fmt, why = "json", "the chat template has Llama-3.1 style tool turns (ipython / \"parameters\")"
        else:
            fmt, why = "hermes", "the chat template names no tool-call markup (the default)"
        log.info("tool-call format: %s (%s)", fmt, why)
        return fmt

    def _check_tools_rendered(self) -> None:
        """Warn when the template drops `tools` (SmolLM2's does): the model is then never
        told the tools' names and arguments, and a policy that never calls one learns nothing."""
        if not self.tools or NO_TOOL_LIST in self._source:
            return
        names = [t.get("function", t).get("name", "") for t in self.tools if isinstance(t, dict)]
        text = self.render([{"role": "user", "content": "?"}], True)
        if names and not any(n and n in text for n in names):
            log.warning("the chat template does not render `tools`: the model is never shown the tools %s, their "
                        "arguments or the call format. Give a template that does (rollout.chat_template: a .jinja "
                        "file, e.g. Qwen2.5's or Hermes'), or describe the tools and the <tool_call> format in "
                        "data.system_prompt (docs/agents.md)", names)

    def _probe(self, roles) -> str:
        """The placeholder for which a probe tool loop renders append-only, text and ids; a
        TemplateError with the last failure if none does."""
        errors = []
        for ph in _PLACEHOLDERS:
            try:
                self._probe_with(ph, roles)
                return ph
            except TemplateError as e:
                errors.append(e)
        raise errors[-1] if "<think>" in self._source else errors[0]  # the plain answer's failure, unless it thinks

    def _probe_with(self, ph: str, roles) -> None:
        self.placeholder = ph
        first = [{"role": "user", "content": "What is 2 + 3?"}]
        obs = [[{"role": r, "content": "5"}] for r in roles] + [[{"role": roles[0], "content": "ok"}]]
        conv, ids = self.start(first)
        text = conv.text
        model = self.encode(ph) + [min(self.eos_ids)]
        full_msgs = list(first)
        for o in obs:
            ids += model
            piece = self.observation(conv, model, "stop", o)
            ids += piece
            full_msgs += [{"role": "assistant", "content": ph}] + o
        full = self.render(full_msgs, True)
        text = conv.text
        if text != full:  # unreachable when every step's checks passed; kept as the definition
            raise TemplateError("chat template is not append-only on the probe conversation")
        if ids != self.encode(full):
            raise TemplateError(
                "chat template: rendering turn by turn gives the right text but other token ids than encoding "
                "the whole conversation (the tokenizer merges across the turn boundaries, or adds a prefix "
                "space per encode call): token ids could not be appended exactly")


def _fix_hint(template: str) -> str:
    # from the template's own source: a probe placeholder may hold <think> whatever the template
    # (a template unrelated to Qwen3 once got the Qwen3 hint)
    if "<think>" in template:
        return ("This is the Qwen3-style template: it drops earlier <think> blocks once a new user message "
                "follows, and with enable_thinking=False its generation prompt holds an empty <think></think> "
                "that its rendering of the turn omits. Fixes: send observations as role 'tool' (not 'user'), "
                "keep thinking on, or give a chat template that renders history unchanged "
                "(rollout.chat_template: FILE.jinja)")
    return ("Fix: give a chat template that renders earlier turns unchanged when turns are added "
            "(rollout.chat_template: FILE.jinja)")


# ---------------------------------------------------------------------- tiny models
NO_TOOL_LIST = "{#- tools are not listed: a tiny model learns them from SFT -#}"
"""A template that holds this comment omits `tools` on purpose (no warning)."""
CHAR_CHAT_TEMPLATE = (
    NO_TOOL_LIST + "{% for m in messages %}{% if m.role == 'system' %}{{ '<s>' + m.content }}"
    "{% elif m.role == 'user' %}{{ '<u>' + m.content }}"
    "{% elif m.role == 'assistant' %}{{ '<a>' + m.content + eos_token }}"
    "{% else %}{{ '<r>' + m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<a>' }}{% endif %}")
"""A compact chat template for character-level tokenizers: one marker token per role, the
assistant turn ends with EOS; tools are not listed (a tiny model learns them from SFT)."""
CHAR_CHAT_CONTROL = ("<s>", "<u>", "<a>", "<r>")


def char_chat_tokenizer(alphabet: str, tools: list[dict] | None = None):
    """The character tokenizer of the built-in tasks plus CHAR_CHAT_TEMPLATE's markers and
    one token per fixed piece of a Hermes tool call (the scaffolding, each tool's name and
    each parameter key), so a call costs its argument values' characters plus ~6 tokens."""
    phrases = ['<tool_call>\n{"name": "', '", "arguments": {', '}}\n</tool_call>', ", "]
    for t in tools or []:
        fn = t["function"]
        phrases.append(fn["name"])
        phrases += [f'"{p}": ' for p in fn["parameters"]["properties"]]
    return char_tokenizer(alphabet + '"', control=CHAR_CHAT_CONTROL, phrases=tuple(dict.fromkeys(phrases)),
                          chat_template=CHAR_CHAT_TEMPLATE)
