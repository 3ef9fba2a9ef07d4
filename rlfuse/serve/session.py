"""Recorded sessions on the OpenAI-compatible app: the routes an agent under training talks to.

    POST /sessions/{sid}/v1/chat/completions   chat with `tools`, `n`, `stream`
    GET  /sessions/{sid}/v1/models             the served model
    GET  /sessions/{sid}/trajectory            the recorded training samples (`rlfuse serve`)
    DELETE /sessions/{sid}                     forget a session
A client bound to one session uses base_url `http://HOST/sessions/{sid}/v1`. During training
the trainer opens the sessions; `rlfuse serve` opens one on its first call (`auto_open`).
`n` > 1 records each choice as a call of the session (a later request that continues one of
them reuses its ids). `stream: true` answers in server-sent events once the call is done: the
role, the content, the tool calls and the finish reason as chunks, then `[DONE]` (the
tool-call markup is parsed from the whole text, so a session's stream is not incremental). Each call's
prompt is built by the reuse rule of rlfuse.rollout.agent.recording (the sampled ids of an
assistant message this session produced, never its text re-encoded) and recorded with the
sampled ids, the engine's log-probs, the finish reason and the tool calls, which come back
to the agent as OpenAI `tool_calls` (finish_reason "tool_calls").
During training the session's sampling is the trainer's (`SessionStore.sampling`: its
temperature, top_p, top_k replace the request's, so the recorded log-probs are those the
trainer recomputes), and budgets end the episode: more calls than `max_turns`, or more than
`max_total_tokens` after the first prompt, answer a 400 and mark the session failed.
Errors are in OpenAI's shape (unknown model 404, bad fields 400, a prompt past the context
400 with code context_length_exceeded, an unknown session 404).
Test: python -m pytest -q tests/test_agent_sessions.py
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from rlfuse.engine import SamplingParams
from rlfuse.rollout.agent import AgentSession, Call, ChatRenderer, TemplateError, split_content
from rlfuse.serve.app import ServeApp, build_app
from rlfuse.serve.protocol import APIError, ChatRequest
from rlfuse.serve.worker import Done

_SALT = uuid.uuid4().hex[:8]
_IDS = itertools.count()


class SessionStore:
    """The open sessions and one `ChatRenderer` per distinct tool list (a renderer checks its
    template once, at construction)."""

    def __init__(self, tokenizer, *, tool_call_format: str = "auto", chat_template: str | None = None,
                 max_turns: int = 1 << 30, max_turn_tokens: int = 1 << 30, max_total_tokens: int = 1 << 30,
                 auto_open: bool = False):
        self.tok, self.fmt, self.template = tokenizer, tool_call_format, chat_template
        self.auto_open = auto_open
        """Open a session on its first call (`rlfuse serve`); else an unknown session is a 404."""
        self.max_turns, self.max_turn_tokens, self.max_total_tokens = max_turns, max_turn_tokens, max_total_tokens
        self.sessions: dict[str, AgentSession] = {}
        self.sampling: dict | None = None
        """SamplingParams fields that replace the request's (temperature, top_p, top_k): the trainer's."""
        self._renderers: dict[str, ChatRenderer] = {}

    def open(self, sid: str, seed: int = 0) -> AgentSession:
        self.sessions[sid] = AgentSession(seed)
        return self.sessions[sid]

    def renderer(self, tools: list[dict] | None) -> ChatRenderer:
        key = json.dumps(tools or [], sort_keys=True)
        if key not in self._renderers:
            try:
                self._renderers[key] = ChatRenderer(self.tok, tools=tools or None, chat_template=self.template,
                                                    tool_call_format=self.fmt)
            except TemplateError as e:
                raise APIError(400, str(e), param="messages") from None
        return self._renderers[key]


def _fail(ses: AgentSession, why: str, message: str) -> APIError:
    ses.failed = ses.failed or why
    return APIError(400, message, param="messages", code=why)


def _room(store: SessionStore, ses: AgentSession, prompt: list[int], limit: int | None) -> int:
    """Most tokens this call may sample: the request's limit, rollout.max_turn_tokens, and what
    is left of max_total_tokens after the first prompt of the segment it extends."""
    seg = next((s for s in reversed(ses.segments()) if prompt[:len(s.sequence)] == s.sequence), None)
    used = len(prompt) - len(seg.prompt_ids) if seg is not None else 0
    room = min(store.max_turn_tokens, store.max_total_tokens - used)
    return min(room, limit) if limit is not None else room


async def _generate(state: ServeApp, prompt: list[int], params: SamplingParams, request: Request) -> list[Done]:
    """Submit one engine request and wait for its params.n samples, by index (aborted if
    cancelled: the agent's timeout, or if the client goes away)."""
    rid = f"session-{_SALT}-{next(_IDS)}"  # not uuid4: os.urandom per call measured ~1 ms on a busy VM
    events: asyncio.Queue = asyncio.Queue()
    try:
        await state.worker.submit(rid, prompt, params, events, stream=False)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    done: dict[int, Done] = {}
    try:
        while len(done) < params.n:
            try:
                _, ev = await asyncio.wait_for(events.get(), 1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise APIError(499, "the client closed the connection") from None
                continue
            if isinstance(ev, BaseException):
                state_ = "the server goes on" if state.worker.alive else "the engine loop stopped"
                raise APIError(500 if state.worker.alive else 503,
                               f"the engine failed on this request ({type(ev).__name__}: {ev}); {state_}",
                               type="server_error")
            if isinstance(ev, Done):
                done[ev.index] = ev
        return [done[i] for i in sorted(done)]
    finally:
        if len(done) < params.n:
            state.worker.abort(rid)


async def session_chat(state: ServeApp, store: SessionStore, sid: str, req: ChatRequest, request: Request) -> dict:
    if state.check_model(req.model) is not None:
        raise APIError(400, f"a recorded session runs the policy {state.model_name!r}, not an adapter of its bank",
                       param="model")
    ses = store.sessions.get(sid)
    if ses is None and store.auto_open:  # `rlfuse serve`: a fresh seed per session (requests may give their own)
        ses = store.open(sid, secrets.randbits(32))
    if ses is None:
        raise APIError(404, f"session {sid!r} is not open", param="url", code="session_not_found")
    if len(ses.calls) >= store.max_turns:
        raise _fail(ses, "max_turns", f"the episode made more than rollout.max_turns={store.max_turns} calls")
    if not state.worker.alive:
        raise APIError(503, f"the engine loop is not running ({state.worker.error})", type="server_error")
    renderer = store.renderer(req.tools)
    msgs = [m.for_template() for m in req.messages]
    try:
        prompt, conv, _ = ses.prompt(renderer, msgs)
    except TemplateError as e:
        raise APIError(400, str(e), param="messages") from None
    if len(prompt) >= state.llm.max_model_len:
        ses.failed = ses.failed or "context"
        raise APIError(400, f"the prompt is {len(prompt)} tokens; this model's context is {state.llm.max_model_len}",
                       param="messages", code="context_length_exceeded")
    room = min(_room(store, ses, prompt, req.token_limit), state.llm.max_model_len - len(prompt))
    if room < 1:
        raise _fail(ses, "token_budget", f"the episode used its rollout.max_total_tokens={store.max_total_tokens}")
    over = dict(store.sampling or {})
    # training: the episode's seed (draws depend on the episode and its history, not the batch)
    over["seed"] = req.seed if req.seed is not None and store.sampling is None else ses.seed
    params = req.sampling_params(room, tools_ok=True, **over)  # the tools are the renderer's
    choices, n_out = [], 0
    for index, done in enumerate(await _generate(state, prompt, params, request)):
        c = done.completion
        ids, lps = list(c.output_token_ids), [float(x) for x in c.logprobs.tolist()]
        n_out += len(ids)
        body_ids = ids[:-1] if ids and c.finish_reason == "stop" and ids[-1] in renderer.eos_ids else ids
        text = state.tok.decode(body_ids, skip_special_tokens=False)
        content, calls = split_content(text, renderer.tool_call_format)
        ses.record(Call(msgs, prompt, ids, lps, c.finish_reason, text, content, calls, renderer, conv))
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"id": f"call_{_SALT}{next(_IDS)}", "type": "function",
                                      "function": {"name": tc.name, "arguments": json.dumps(tc.arguments)}}
                                     for tc in calls]
        finish = "tool_calls" if calls else (c.finish_reason if c.finish_reason in ("stop", "length") else "stop")
        lp_json = [lp if math.isfinite(lp) else None for lp in lps]  # JSON has no NaN / inf
        choice = {"index": index, "message": message, "finish_reason": finish,
                  "logprobs": ({"content": [{"token": state.token_text(t), "logprob": lp, "bytes": None,
                                             "top_logprobs": []} for t, lp in zip(ids, lp_json)]}
                               if req.logprobs else None)}
        if req.return_token_ids:
            choice["token_ids"], choice["prompt_token_ids"] = ids, prompt
        choices.append(choice)
    return {"id": f"chatcmpl-{_SALT}-{next(_IDS)}", "object": "chat.completion", "created": int(time.time()),
            "model": state.model_name, "choices": choices,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_out,
                      "total_tokens": len(prompt) + n_out}}


def stream_chunks(body: dict):
    """A finished session answer as OpenAI's chat.completion.chunk events (server-sent):
    per choice the role, the content, the tool calls (with their index), the finish reason."""
    def chunk(choice: dict) -> str:
        obj = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
               "model": body["model"], "choices": [choice]}
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    for c in body["choices"]:
        i, msg = c["index"], c["message"]
        yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None})
        if msg.get("content"):
            yield chunk({"index": i, "delta": {"content": msg["content"]}, "logprobs": c["logprobs"],
                         "finish_reason": None})
        if msg.get("tool_calls"):
            calls = [{"index": k, **tc} for k, tc in enumerate(msg["tool_calls"])]
            yield chunk({"index": i, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None})
        yield chunk({"index": i, "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]})
    yield "data: [DONE]\n\n"


def trajectory(ses: AgentSession) -> dict:
    """A session's record as JSON: its training samples by the merge rule and the per-call record."""
    return {"samples": [{"prompt_ids": g.prompt_ids, "token_ids": g.token_ids, "loss_mask": g.loss_mask,
                         "logprobs": [lp if math.isfinite(lp) else None for lp in g.logprobs], "calls": g.calls}
                        for g in ses.segments()],
            "calls": len(ses.calls), "failed": ses.failed or None, "rerendered_tokens": ses.rerendered_tokens}


def add_session_routes(app: FastAPI, store: SessionStore) -> None:
    """Mount the session routes on an app from `rlfuse.serve.build_app` (its error handlers apply)."""
    state: ServeApp = app.state.serve

    async def chat(request: Request):
        # the body parsed and validated in one pydantic pass over its bytes, not by FastAPI's
        # dependency solver (json.loads, then validation): every agent call takes this route
        # (benchmarks/bench_agent_calls.py); a bad body is the same RequestValidationError (400)
        try:
            req = ChatRequest.model_validate_json(await request.body())
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        body = await session_chat(state, store, request.path_params["sid"], req, request)
        if req.stream:
            return StreamingResponse(stream_chunks(body), media_type="text/event-stream")
        # a JSONResponse as is: FastAPI's encoder walks every log-prob of a returned dict
        return JSONResponse(body)

    app.router.add_route("/sessions/{sid}/v1/chat/completions", chat, methods=["POST"])

    @app.get("/sessions/{sid}/trajectory")
    async def get_trajectory(sid: str):
        ses = store.sessions.get(sid)
        if ses is None:
            raise APIError(404, f"session {sid!r} is not open", param="url", code="session_not_found")
        return JSONResponse(trajectory(ses))

    @app.delete("/sessions/{sid}")
    async def close(sid: str):  # `rlfuse serve` keeps sessions until closed
        if store.sessions.pop(sid, None) is None:
            raise APIError(404, f"session {sid!r} is not open", param="url", code="session_not_found")
        return {"id": sid, "object": "session.deleted", "deleted": True}

    @app.get("/sessions/{sid}/v1/models")
    async def models(sid: str):
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "rlfuse", "max_model_len": state.llm.max_model_len}]}


def serve_app(llm, model_name: str) -> FastAPI:
    """The app of `rlfuse serve`: `build_app` plus the session routes, a session opening on its
    first call (the training process builds its own, whose trainer opens the sessions)."""
    app = build_app(llm, model_name)
    add_session_routes(app, SessionStore(llm.tokenizer, auto_open=True))
    return app
