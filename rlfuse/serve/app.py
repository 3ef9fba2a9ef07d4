"""The OpenAI-compatible HTTP app (FastAPI) over one `EngineWorker`.

    GET  /health               200 {"status": "ok", requests, running, waiting, free/total KV blocks, step_failures
                               (engine steps that failed and were recovered from)}; 503 if the engine loop stopped
    GET  /v1/models            the served model, and each adapter of its bank (`rlfuse serve --lora`)
    POST /v1/completions       text or token-id prompts (a list of them too)
    POST /v1/chat/completions  messages rendered by the model's chat template (`Tokenizer.chat_prompt_ids`,
                               as `rlfuse generate --chat`)
Both POST routes stream as server-sent events with `"stream": true` (`data: {chunk}` lines,
then `data: [DONE]`). Request bodies: rlfuse/serve/protocol.py. Errors are JSON in OpenAI's
shape with a 4xx status (400 bad field, 404 unknown model or route), 503 when the engine
is down. A streaming client that disconnects aborts its requests; a non-streaming one is
checked every second while it waits.
Test: python -m pytest -q tests/test_serve.py
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from rlfuse.engine import LLM, SamplingParams
from rlfuse.serve.protocol import APIError, ChatRequest, CompletionRequest, check_text, validation_message
from rlfuse.serve.worker import Done, EngineWorker

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 1.0
"""How often a non-streaming request checks whether its client is still there."""


class _Call:
    """One HTTP generation request: its engine requests (one per prompt) and their events."""

    def __init__(self, app: "ServeApp", kind: str, req, prompts: list[list[int]], params: SamplingParams):
        self.app, self.kind, self.req, self.prompts, self.params = app, kind, req, prompts, params
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.events: asyncio.Queue = asyncio.Queue()
        self.rids: list[str] = []
        self.open = 0  # samples not finished

    async def start(self) -> None:
        try:
            for i, ids in enumerate(self.prompts):
                rid = f"{self.id}-{i}"
                await self.app.worker.submit(rid, ids, self.params, self.events, i, stream=self.req.stream)
                self.rids.append(rid)
                self.open += self.params.n
        except ValueError as e:
            self.abort()
            raise APIError(400, str(e).replace(f"request '{self.id}-", "request '"), param="prompt") from None

    def abort(self) -> None:
        for rid in self.rids:
            self.app.worker.abort(rid)
        self.rids, self.open = [], 0

    async def next_event(self, timeout: float | None = None):
        return self._take(await asyncio.wait_for(self.events.get(), timeout))

    def _take(self, item):
        tag, ev = item
        if isinstance(ev, BaseException):  # a failed step (the worker recovered) or a dead loop
            state = "the server goes on" if self.app.worker.alive else "the engine loop stopped"
            raise APIError(500 if self.app.worker.alive else 503,
                           f"the engine failed on this request ({type(ev).__name__}: {ev}); {state}",
                           type="server_error")
        if isinstance(ev, Done):
            self.open -= 1
        return tag * self.params.n + ev.index, ev

    async def next_events(self) -> dict[int, list]:
        """Every event waiting now (at least one), merged per choice index into
        [text, token ids, log-probs, finish reason, prompt ids]: a client that reads slower
        than the engine steps gets fewer, larger chunks instead of a growing backlog."""
        got = [await self.next_event()]
        while not self.events.empty():
            got.append(self._take(self.events.get_nowait()))
        merged: dict[int, list] = {}
        for index, ev in got:
            m = merged.setdefault(index, ["", [], [], None, None])
            m[0] += ev.text
            m[1] += ev.token_ids
            m[2] += ev.logprobs
            if isinstance(ev, Done):
                m[3], m[4] = _finish(ev.completion.finish_reason), ev.completion.prompt_token_ids
        return merged

    # ------------------------------------------------------------------ response pieces
    def _logprobs(self, ids: list[int], lps: list[float]) -> dict | None:
        lps = [lp if math.isfinite(lp) else None for lp in lps]  # JSON has no NaN / inf: null instead
        if self.kind == "chat":
            if not self.req.logprobs:
                return None
            toks = [self.app.token_text(t) for t in ids]
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                                for s, lp in zip(toks, lps)], "refusal": None}
        if self.req.logprobs is None:
            return None
        return {"tokens": [self.app.token_text(t) for t in ids], "token_logprobs": lps, "top_logprobs": None,
                "text_offset": None}

    def _usage(self, outputs: int) -> dict:
        p = sum(len(x) for x in self.prompts)
        return {"prompt_tokens": p, "completion_tokens": outputs, "total_tokens": p + outputs}

    def _choice(self, index: int, text: str, ids: list[int], lps: list[float], finish: str | None,
                stream: bool, prompt: list[int] | None = None) -> dict:
        c: dict = {"index": index}
        if self.kind == "chat":
            if stream:
                c["delta"] = {"content": text} if text else {}
            else:
                c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        c["logprobs"] = self._logprobs(ids, lps)
        c["finish_reason"] = finish
        if self.req.return_token_ids:
            c["token_ids"] = ids
            if prompt is not None:
                c["prompt_token_ids"] = prompt
        return c

    def _envelope(self, choices: list[dict], stream: bool) -> dict:
        obj = ("chat.completion" if self.kind == "chat" else "text_completion") + (
            ".chunk" if stream and self.kind == "chat" else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model,
                "choices": choices}

    # ------------------------------------------------------------------ the two ways to answer
    async def collect(self, request: Request) -> dict:
        done: dict[int, Done] = {}
        while self.open:
            try:
                index, ev = await self.next_event(DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.abort()
                    raise APIError(499, "the client closed the connection") from None
                continue
            if isinstance(ev, Done):
                done[index] = ev
        choices = []
        for index in sorted(done):
            c = done[index].completion
            lps = c.logprobs.tolist()
            choices.append(self._choice(index, c.text or "", c.output_token_ids, lps,
                                        _finish(c.finish_reason), False, c.prompt_token_ids))
        body = self._envelope(choices, False)
        body["usage"] = self._usage(sum(len(done[i].completion.output_token_ids) for i in done))
        return body

    async def stream(self):
        outputs = 0
        try:
            if self.kind == "chat":  # the role comes first, as OpenAI sends it
                first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(len(self.prompts) * self.params.n)]
                yield _sse(self._envelope(first, True))
            while self.open:
                try:
                    merged = await self.next_events()
                except APIError as e:
                    yield _sse(e.body())
                    return
                for index, (text, ids, lps, finish, prompt) in merged.items():
                    outputs += len(ids)
                    quiet = not text and finish is None and not self.req.return_token_ids and (
                        not self.req.logprobs if self.kind == "chat" else self.req.logprobs is None)
                    if not quiet:
                        yield _sse(self._envelope([self._choice(index, text, ids, lps, finish, True, prompt)], True))
            if self.req.include_usage:
                body = self._envelope([], True)
                body["usage"] = self._usage(outputs)
                yield _sse(body)
            yield "data: [DONE]\n\n"
        finally:
            if self.open:  # the client went away (or the server stops) mid-stream
                self.abort()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _finish(reason: str) -> str:
    return reason if reason in ("stop", "length") else "abort"


class ServeApp:
    """The server's state: the engine worker, the model's name and tokenizer, and the names
    requests may give as `model`: the model's (the base) and each adapter of its bank (a
    request runs under the adapter it names; requests for different adapters share batches)."""

    def __init__(self, llm: LLM, model_name: str):
        if llm.tokenizer is None:
            raise ValueError("rlfuse serve needs the model's tokenizer (tokenizer.json in the model folder)")
        self.llm, self.model_name, self.tok = llm, model_name, llm.tokenizer
        self.slots: dict[str, int | None] = {model_name: None}
        for i, name in enumerate(llm.adapters):
            if name in self.slots:
                raise ValueError(f"rlfuse serve: the adapter name {name!r} is taken (the served model's name or "
                                 f"another adapter's)")
            self.slots[name] = i
        self.worker = EngineWorker(llm)

    def token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def check_model(self, name: str) -> int | None:
        """The adapter slot a request's `model` names (None: the base model), or a 404."""
        if name not in self.slots:
            served = ", ".join(map(repr, self.slots))
            raise APIError(404, f"model {name!r} is not served here; this server serves {served}",
                           param="model", code="model_not_found")
        return self.slots[name]

    def params(self, req, max_tokens: int) -> SamplingParams:
        """The request's SamplingParams (under the adapter its `model` names), checked against
        the model: a 400 naming the field."""
        params = dataclasses.replace(req.sampling_params(max_tokens), adapter=self.check_model(req.model))
        vocab = self.llm.vocab_size
        if params.top_k > vocab:
            raise APIError(400, f"top_k must be <= the vocabulary size {vocab} (or 0 / -1: off), got {params.top_k}",
                           param="top_k")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise APIError(400, f"stop_token_ids must be in [0, {vocab}), got {bad[:5]}", param="stop_token_ids")
        return params

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        try:
            return self.tok.chat_prompt_ids([m.for_template() for m in req.messages],
                                            **(req.chat_template_kwargs or {}))
        except ValueError as e:  # the template refused the messages (raise_exception) or has none
            raise APIError(400, str(e), param="messages") from None

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        return [self.tok.encode(p) if isinstance(p, str) else list(p) for p in req.prompts()]

    async def run(self, kind: str, req, prompts: list[list[int]], params: SamplingParams, request: Request):
        if not self.worker.alive:
            raise APIError(503, f"the engine loop is not running ({self.worker.error})", type="server_error")
        call = _Call(self, kind, req, prompts, params)
        await call.start()
        if req.stream:
            return StreamingResponse(call.stream(), media_type="text/event-stream")
        return JSONResponse(await call.collect(request))


def build_app(llm: LLM, model_name: str) -> FastAPI:
    """The FastAPI app serving `llm` as `model_name`; its lifespan starts and stops the
    engine worker thread."""
    state = ServeApp(llm, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.worker.start()
        log.info("serving %s", model_name)
        yield
        state.worker.stop()

    app = FastAPI(title="rlfuse serve", lifespan=lifespan)
    app.state.serve = state

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        msg, param = validation_message(e.errors())
        return JSONResponse(APIError(400, msg, param=param).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):  # a bug, not the client's: still OpenAI's shape
        log.exception("request failed")
        return JSONResponse(APIError(500, f"internal error ({type(e).__name__}: {e})", type="server_error").body(),
                            status_code=500)

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.get("/health")
    async def health():
        if not state.worker.alive:
            raise APIError(503, f"the engine loop is not running ({state.worker.error})", type="server_error")
        return {"status": "ok", **(await state.worker.snapshot())}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "rlfuse", "max_model_len": llm.max_model_len,
             **({} if slot is None else {"parent": model_name})} for name, slot in state.slots.items()]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        state.check_model(req.model)
        check_text(req.model_dump(exclude_none=True))
        params = state.params(req, req.max_tokens if req.max_tokens is not None else 16)
        return await state.run("completion", req, state.completion_prompts(req), params, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        state.check_model(req.model)
        check_text(req.model_dump(exclude_none=True))  # before the template sees the text
        prompt = state.chat_prompt(req)
        limit = req.token_limit if req.token_limit is not None else max(1, llm.max_model_len - len(prompt))
        if req.token_limit is None:  # on a CPU this can look like a hang: say what was chosen
            log.info("chat request without max_tokens: up to %d new tokens (the rest of the %d-token context); "
                     "clients should set max_tokens", limit, llm.max_model_len)
        return await state.run("chat", req, [prompt], state.params(req, limit), request)

    return app
