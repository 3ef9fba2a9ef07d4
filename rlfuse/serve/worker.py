"""`EngineWorker`: the one thread that drives the engine for all HTTP requests.

Continuous batching across requests: the HTTP handlers (asyncio) never touch the engine;
they send commands (add, abort, snapshot) to the worker's inbox and read their request's
events from an asyncio queue. The worker thread alone calls the engine and its tokenizer's
decode: between engine steps it takes every waiting command, then runs one `LLM.step()`
and publishes, per live request, the new tokens of each sample (`Delta`) and each sample
that finished (`Done`). When nothing is running it blocks on the inbox.

A request the engine refuses (`add_request` raises ValueError) fails the handler's future
with that error. A step that raises fails only the request that caused it (`_recover`): the
engine drops its state, and the requests that were live re-run one at a time (probation;
new requests wait): a non-streamed one, or a stream with nothing sent yet, from its start;
a stream that sent output continues after it (n = 1; a multi-sample stream that sent output
cannot be replayed and fails). The one whose solo run fails again gets the error; then
batching resumes. A full KV pool only makes requests wait in the engine's scheduler (it
admits and preempts; nothing is dropped). `abort` (a client went away) frees the
request's sequences and KV blocks. The thread runs in a copy of the starting thread's
context, so kernel backend and numerics settings (context variables) carry over.
Test: python -m pytest -q tests/test_serve.py
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable

import torch

from rlfuse.engine import LLM, Completion, SamplingParams
from rlfuse.serve.detokenize import IncrementalText

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class Delta:
    """New output of sample `index` since the last event: token ids, their log-probs
    (the engine's: log softmax(logits / T) of the sampled token) and the sendable text."""
    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str


@dataclasses.dataclass(slots=True)
class Done:
    """Sample `index` finished: the rest of its tokens and text, and the whole completion."""
    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    completion: Completion


@dataclasses.dataclass(slots=True)
class _Live:
    publish: Callable[[object], None]
    stream: bool                     # publish Deltas (else only Done events)
    sent: list[int]                  # per sample: output tokens already published
    text: list[IncrementalText]
    remaining: int                   # samples not finished yet
    prompt: list[int]                # the request as submitted (a probation re-run starts from it)
    params: SamplingParams
    out: list[list[int]] = dataclasses.field(default_factory=list)      # streamed ids per sample
    out_lps: list[list[float]] = dataclasses.field(default_factory=list)
    head: tuple[list[int], list[float]] = ((), ())
    """A continued stream (probation): the ids and log-probs sent before the re-run, which its
    Done's completion is prefixed with."""


class EngineWorker:
    def __init__(self, llm: LLM):
        self.llm = llm
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._stopping = False
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._loop,),
                                        name="rlfuse-engine", daemon=True)
        self.error: BaseException | None = None
        """The exception that ended the loop, if one did (the server then answers 503)."""
        self.failures = 0
        """Engine steps that failed and were recovered from (`_recover`)."""
        self._probation: collections.deque[str] = collections.deque()  # live requests to re-run alone
        self._solo: str | None = None  # the request running alone on probation
        self._held: list[tuple] = []  # "add" commands that came in during probation

    def start(self) -> "EngineWorker":
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._inbox.put(("stop",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # ------------------------------------------------------------------ called from the event loop
    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams, events: asyncio.Queue,
                     tag: int = 0, stream: bool = True) -> None:
        """Queue a request; its events arrive on `events` as (tag, event): `Delta`s (only if
        `stream`) and one `Done` per sample, or an exception if the engine loop fails.
        Raises the engine's ValueError if it refuses the request."""
        loop = asyncio.get_running_loop()

        def publish(ev):
            loop.call_soon_threadsafe(events.put_nowait, (tag, ev))
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("add", request_id, prompt, params, publish, stream, fut))
        await asyncio.wrap_future(fut)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its sequences (no more events are published for it)."""
        self._send(("abort", request_id))

    async def snapshot(self) -> dict:
        """Engine state read in the worker thread: live requests, waiting and running
        sequences, free and total KV blocks."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("snapshot", fut))
        return await asyncio.wrap_future(fut)

    def _send(self, cmd: tuple) -> None:
        if not self.alive:
            raise RuntimeError(f"the engine loop is not running ({self.error or 'stopped'})")
        self._inbox.put(cmd)
        if self.error is not None:  # the loop died between the check and the put: nobody reads the inbox
            self._fail_inbox(self.error)

    # ------------------------------------------------------------------ the worker thread
    def _loop(self) -> None:
        try:
            while not self._stopping:
                if self._solo is not None and self._solo not in self._live:
                    self._solo = None  # the solo run finished (or its client went away)
                if self._solo is None and self._probation:
                    self._rerun(self._probation.popleft())
                elif self._solo is None and self._held:
                    held, self._held = self._held, []
                    for cmd in held:
                        self._run(cmd)
                busy = self.llm.has_unfinished()
                self._take_commands(block=not busy)
                if self.llm.has_unfinished():
                    try:
                        self._publish(self.llm.step())
                    except Exception as e:  # noqa: BLE001 -- any step failure is contained, see _recover
                        self._recover(e)
        except BaseException as e:  # the recovery itself failed: every waiting client hears it
            self.error = e
            log.exception("the engine loop stopped")
            for live in self._live.values():
                live.publish(e)
            self._fail_inbox(e)

    def _recover(self, e: Exception) -> None:
        """A step failed: the engine drops every request and starts idle. Run alone, the
        request fails: it gets the error. Else the engine cannot tell which request caused it,
        so the live ones go on probation (the module docstring); the request checks
        (protocol.py, `LLM.add_request`) keep known bad requests from getting here."""
        self.failures += 1
        self.llm.abort_all()
        if self._solo is not None:
            rid, self._solo = self._solo, None
            log.error("an engine step failed (%s: %s) running request %s alone: it fails, the engine goes on",
                      type(e).__name__, e, rid)
            if (live := self._live.pop(rid, None)) is not None:
                live.publish(e)
            return
        log.error("an engine step failed (%s: %s); re-running its %d live request(s) one at a time to find the "
                  "one that caused it", type(e).__name__, e, len(self._live), exc_info=e)
        for rid, live in list(self._live.items()):
            if live.stream and len(live.sent) > 1 and any(live.sent):  # sent output of several samples
                self._live.pop(rid).publish(e)
            else:
                self._probation.append(rid)

    def _rerun(self, rid: str) -> None:
        """Re-submit a live request on probation, alone: from its start, or (a stream that sent
        output) continuing after what its client has."""
        live = self._live.get(rid)
        if live is None:
            return
        prompt, params = live.prompt, live.params
        if live.stream and any(live.sent):
            done, lps = live.out[0], live.out_lps[0]
            prompt = prompt + done
            params = dataclasses.replace(params, max_tokens=params.max_tokens - len(done),
                                         min_tokens=max(0, params.min_tokens - len(done)))
            live.head = (live.head[0] + done, live.head[1] + lps)
            live.sent, live.out, live.out_lps = [0], [[]], [[]]
        else:
            live.text = [IncrementalText(self.llm.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                         stop=params.stop) for _ in range(params.n)]
        try:
            self.llm.add_request(prompt, params, request_id=rid)
        except Exception as e:  # noqa: BLE001 -- refused on re-submission: this request fails alone
            self._live.pop(rid).publish(e)
            return
        self._solo = rid

    def _take_commands(self, block: bool) -> None:
        while True:
            try:
                cmd = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            self._run(cmd)

    def _run(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            if self._solo is not None or self._probation:  # admitted when the probation is over
                self._held.append(cmd)
                return
            _, rid, prompt, params, publish, stream, fut = cmd
            try:
                self.llm.add_request(prompt, params, request_id=rid)
            except Exception as e:  # noqa: BLE001 -- a refused request fails alone (ValueError: a 400)
                fut.set_exception(e)
                return
            tok = self.llm.tokenizer
            self._live[rid] = _Live(publish, stream, [0] * params.n,
                                    [IncrementalText(tok, skip_special_tokens=params.skip_special_tokens,
                                                     stop=params.stop) for _ in range(params.n)], params.n,
                                    list(prompt), params, [[] for _ in range(params.n)], [[] for _ in range(params.n)])
            fut.set_result(None)
        elif kind == "abort":
            if self._live.pop(cmd[1], None) is not None:
                self.llm.abort(cmd[1])
                log.info("request %s aborted (client gone)", cmd[1])
        elif kind == "snapshot":
            sch, bm = self.llm.scheduler, self.llm.block_manager
            cmd[1].set_result(dict(requests=len(self._live), running=len(sch.running), waiting=len(sch.waiting),
                                   free_blocks=bm.num_free, total_blocks=bm.num_blocks, step_failures=self.failures))
        elif kind == "stop":
            self._stopping = True
            for held in self._held:
                if not held[-1].done():
                    held[-1].set_exception(RuntimeError("the server is stopping"))
            for rid in list(self._live):
                self.llm.abort(rid)
            self._live.clear()

    def _publish(self, finished: list[Completion]) -> None:
        done: dict[str, list[Completion]] = {}
        for c in finished:
            done.setdefault(c.request_id, []).append(c)
        for rid, live in list(self._live.items()):
            for k, (ids, lps) in enumerate(self.llm.partial(rid, live.sent) if live.stream else ()):
                if ids:
                    live.sent[k] += len(ids)
                    live.out[k] += ids
                    live.out_lps[k] += lps
                    live.publish(Delta(k, ids, lps, live.text[k].add(ids)))
            for c in done.get(rid, ()):
                k, a = c.index, live.sent[c.index]
                if live.head[0]:  # a continued stream: the completion as the client asked for it
                    c = dataclasses.replace(c, prompt_token_ids=live.prompt,
                                            output_token_ids=[*live.head[0], *c.output_token_ids],
                                            logprobs=torch.cat([torch.tensor(live.head[1], dtype=c.logprobs.dtype),
                                                                c.logprobs]))
                    a += len(live.head[0])
                live.publish(Done(k, c.output_token_ids[a:], c.logprobs[a:].tolist(),
                                  live.text[k].finish(c.text or ""), c))
                live.remaining -= 1
            if live.remaining == 0:
                del self._live[rid]

    def _fail_inbox(self, e: BaseException) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            fut = cmd[-1] if cmd[0] in ("add", "snapshot") else None
            if fut is not None and not fut.done():
                fut.set_exception(RuntimeError(f"the engine loop stopped: {e}"))
