"""`EngineWorker`: the one thread that drives the engine for all HTTP requests.

Continuous batching across requests: the HTTP handlers (asyncio) never touch the engine;
they send commands (add, abort, snapshot) to the worker's inbox and read their request's
events from an asyncio queue. The worker thread alone calls the engine and its tokenizer's
decode: between engine steps it takes every waiting command, then runs one `LLM.step()`
and publishes, per live request, the new tokens of each sample (`Delta`) and each sample
that finished (`Done`). When nothing is running it blocks on the inbox.

A request the engine refuses (`add_request` raises ValueError) fails the handler's future
with that error; a step that raises fails the requests live in it and the engine goes on
(`_recover`); a full KV pool only makes requests wait in the engine's scheduler (it
admits and preempts; nothing is dropped). `abort` (a client went away) frees the
request's sequences and KV blocks. The thread runs in a copy of the starting thread's
context, so kernel backend and numerics settings (context variables) carry over.
Test: python -m pytest -q tests/test_serve.py
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable

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
        """A step failed: its live requests get the error, the engine drops every request
        and starts idle, and the loop goes on serving. The engine cannot tell which request
        caused a failure, so all requests live at that moment fail; the request checks
        (protocol.py, `LLM.add_request`) are what keep a bad request from getting here."""
        self.failures += 1
        log.error("an engine step failed (%s: %s); failing the %d live request(s), the engine goes on",
                  type(e).__name__, e, len(self._live), exc_info=e)
        for live in self._live.values():
            live.publish(e)
        self._live.clear()
        self.llm.abort_all()

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
            _, rid, prompt, params, publish, stream, fut = cmd
            try:
                self.llm.add_request(prompt, params, request_id=rid)
            except Exception as e:  # noqa: BLE001 -- a refused request fails alone (ValueError: a 400)
                fut.set_exception(e)
                return
            tok = self.llm.tokenizer
            self._live[rid] = _Live(publish, stream, [0] * params.n,
                                    [IncrementalText(tok, skip_special_tokens=params.skip_special_tokens,
                                                     stop=params.stop) for _ in range(params.n)], params.n)
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
                    live.publish(Delta(k, ids, lps, live.text[k].add(ids)))
            for c in done.get(rid, ()):
                k, a = c.index, live.sent[c.index]
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
