"""The OpenAI request bodies rlfuse serves and how they map to `SamplingParams`.

Supported: `prompt` (text, token ids, or a list of either), `messages` (text content or text
parts), `n`, `temperature`, `top_p`, `max_tokens` (chat: also `max_completion_tokens`;
default: completions 16, chat the rest of the context), `stop`, `seed`, `stream` (+
`stream_options.include_usage`), `logprobs` (completions: 0, the sampled tokens' log-probs;
chat: true with `top_logprobs` 0). Extensions (the client's `extra_body`): `top_k`, `min_p`,
`min_tokens`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`, `return_token_ids`
(each choice carries its prompt and output token ids: the ids the model saw and sampled),
`chat_template_kwargs` (chat). Log-probs are the engine's: log softmax(logits / T) of the
sampled token before top-k/top-p (T = 1 for greedy), the values the trainer computes.

Refused with a 400 naming the field: fields OpenAI defines that would change the output
in a way the engine does not implement (penalties, logit_bias, echo, suffix, best_of > n,
top-k alternatives in logprobs, tools, non-text response formats), and unknown fields.
Accepted and without effect: `user`, `metadata`, `store`, `service_tier` and OpenAI's
other bookkeeping fields (listed in `_Sampling`).
Test: python -m pytest -q tests/test_serve.py
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlfuse.engine import SamplingParams


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both routes."""
    model_config = ConfigDict(extra="forbid")
    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**32)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # extensions
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    # OpenAI's bookkeeping fields: accepted, no effect on what is generated
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    parallel_tool_calls: Any = None

    def _refuse_unsupported(self, tools_ok: bool = False) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported by rlfuse serve (only 0)", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by rlfuse serve", param="logit_bias")

    def sampling_params(self, max_tokens: int, *, tools_ok: bool = False, **override) -> SamplingParams:
        """The engine's SamplingParams; a value it refuses is a 400 naming the field.
        `tools_ok`: `tools` / `functions` are parsed by the caller (a recorded session), not
        refused; `override`: SamplingParams fields that replace the request's (one
        construction, not a second one: this runs on every agent call)."""
        self._refuse_unsupported(tools_ok)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        fields = dict(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                      max_tokens=max_tokens, min_tokens=self.min_tokens, stop=stop,
                      stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos, seed=self.seed,
                      skip_special_tokens=self.skip_special_tokens)
        try:
            return SamplingParams(**{**fields, **override})
        except ValueError as e:
            field = re.match(r"SamplingParams\.(\w+)", str(e))
            raise APIError(400, str(e).replace("SamplingParams.", ""), param=field and field.group(1)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def _refuse_unsupported(self, tools_ok: bool = False) -> None:
        super()._refuse_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported by rlfuse serve (prompt log-probs are not computed)",
                           param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by rlfuse serve", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported by rlfuse serve", param="best_of")
        if self.logprobs:
            raise APIError(400, "logprobs > 0 asks for top alternatives, which the engine does not compute; "
                                "logprobs=0 returns the sampled tokens' log-probs", param="logprobs")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message as the chat template sees it: role, content (text parts are joined) and
    any other keys the template may read (name, tool_calls, ...)."""
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(p.text for p in self.content)
        return d


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: Any = None
    functions: list[dict] | None = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def _refuse_unsupported(self, tools_ok: bool = False) -> None:
        super()._refuse_unsupported()
        if self.top_logprobs:
            raise APIError(400, "top_logprobs > 0 asks for top alternatives, which the engine does not compute; "
                                "logprobs=true returns the sampled tokens' log-probs", param="top_logprobs")
        for name in () if tools_ok else ("tools", "functions"):
            if getattr(self, name):
                raise APIError(400, f"{name} are not supported by rlfuse serve yet (no tool-call parsing)",
                               param=name)
        if self.response_format is not None and self.response_format.type != "text":
            raise APIError(400, f"response_format {self.response_format.type!r} is not supported by rlfuse serve "
                                "(only 'text')", param="response_format")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) from pydantic's validation errors: the first error, by field path."""
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if e.get("type") == "extra_forbidden":
        return f"unknown field {param!r} (rlfuse serve does not support it)", param
    if e.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    return (f"{param}: {e.get('msg')}" if param else str(e.get("msg"))), param


def check_text(value, path: str = "") -> None:
    """Every string in a request body must be encodable as UTF-8: JSON's `\\ud800` escapes
    decode to lone surrogates, which no tokenizer or template can take (a 400, not a 500)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"{path or 'the request'}: the text holds a lone surrogate at character {e.start} "
                                f"({value[e.start]!r}), which is not valid Unicode", param=path or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, path)
            check_text(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_text(v, f"{path}.{i}" if path else str(i))
