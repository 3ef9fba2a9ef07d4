"""CPU cost of one agent chat call on the asyncio thread, split by part (issue 35's GIL budget).

An agent's call through `rlfuse.serve.AgentSampler` runs, on the asyncio (main) thread: the
OpenAI client (openai + httpx), httpx's ASGI transport, FastAPI routing and the pydantic
validation of the ChatRequest, our handler (`session_chat`: rendering, the reuse rule,
recording) and the response (dict + JSON). That CPU time competes for the GIL with the
engine thread. Here the engine is scripted (`ScriptedLLM`: every queued request answers at
once with a fixed reply), so the engine costs nothing and the main thread's CPU time is all
per-call overhead.

    python benchmarks/bench_agent_calls.py                 # 32 concurrent 4-turn sessions, 5 repeats
    python benchmarks/bench_agent_calls.py --sessions 1    # sequential calls
    python benchmarks/bench_agent_calls.py --profile       # + cProfile: the share of each part

Reported: CPU ms per call on the main thread (`time.thread_time`), the median and spread over
repeats (no profiler); with --profile, each part's cumulative share of the profiled main
thread (nested: the client call holds the transport, which holds the app, which holds the
handler; the client's own share is "client call" minus "ASGI transport + app"; the profiler
slows Python calls, so read the shares, not the profiled ms).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import string
import time

import torch

from rlfuse.data import Prompt
from rlfuse.engine.sequence import Completion
from rlfuse.rollout import char_chat_tokenizer
from rlfuse.run.config import RolloutConfig
from rlfuse.serve.agents import MODEL_NAME, AgentSampler, EngineBase

REPLY = "Let me think: 12345 * 678 is 8369910, so the answer is 8369910."
SPANS = (  # (part, (file fragment, function) whose cumulative time it is), nested outer to inner
    ("all (main thread)", ("rlfuse/serve/agents.py", "episodes")),
    ("client call", ("openai/resources/chat/completions/completions.py", "create")),
    ("ASGI transport + app", ("httpx/_transports/asgi.py", "handle_async_request")),
    ("app (FastAPI)", ("fastapi/applications.py", "__call__")),
    ("request validation", ("fastapi/dependencies/utils.py", "solve_dependencies")),  # a route with a body parameter
    ("request validation", ("pydantic/main.py", "model_validate_json")),  # the session route's own
    ("rlfuse handler", ("rlfuse/serve/session.py", "session_chat")),
    ("  template rendering", ("rlfuse/rollout/agent/chat.py", "render")),
    ("  tokenizer encode / decode", ("rlfuse/model/tokenizer.py", "encode")),
    ("  engine worker submit", ("rlfuse/serve/worker.py", "submit")),
    ("response (JSONResponse)", ("starlette/responses.py", "__init__")),
)


class ScriptedLLM:
    """The engine API the serve worker drives, answering every queued request in one step with
    REPLY's ids (finish "length" at max_tokens), log-probs -0.5 each. No graphs to capture."""

    adapters: tuple[str, ...] = ()

    def __init__(self, tok, max_model_len: int = 8192):
        self.tokenizer, self.max_model_len, self.vocab_size = tok, max_model_len, tok.vocab_size
        self.reply = tok.encode(REPLY, add_special_tokens=False)
        self.queue: list[tuple[str, list[int], object]] = []

    def add_request(self, ids, params, request_id):
        self.queue.append((request_id, list(ids), params))

    def has_unfinished(self):
        return bool(self.queue)

    def step(self):
        out = []
        for rid, ids, params in self.queue:
            toks = self.reply[:params.max_tokens]
            out.append(Completion(rid, 0, ids, toks, torch.full((len(toks),), -0.5), "length", None))
        self.queue = []
        return out

    def abort(self, rid):
        self.queue = [q for q in self.queue if q[0] != rid]

    def abort_all(self):
        self.queue = []

    def wake(self):
        pass

    def capture_graphs(self, up_to=None):
        pass


class ToolLoop:
    """`turns` chat calls; after each, the assistant message goes back as the client returned
    it, then a tool message."""

    def __init__(self, turns: int):
        self.turns = turns

    async def __call__(self, client, row):
        messages = [{"role": "system", "content": "You are a calculator agent."},
                    {"role": "user", "content": row["prompt"]}]
        for k in range(self.turns):
            r = await client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=len(REPLY))
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "content": f"result {k}: 8369910"})
        return 1.0


def spans(stats: pstats.Stats) -> dict[str, float]:
    """Cumulative seconds of each SPANS function (summed over same-named functions of the file;
    an async function's resumptions count once each, its time is still its own)."""
    out: collections.Counter = collections.Counter()
    for (fname, _, func), (_, _, _, ct, _) in stats.stats.items():
        for part, (frag, name) in SPANS:
            if frag in fname and func == name:
                out[part] += ct
    out["  tokenizer encode / decode"] += sum(ct for (f, _, fn), (_, _, _, ct, _) in stats.stats.items()
                                              if "rlfuse/model/tokenizer.py" in f and fn == "decode")
    return dict(out)


def one_run(sampler, prompts, profile: cProfile.Profile | None) -> tuple[float, int]:
    """(main-thread CPU seconds, calls) of one rollout."""
    cpu0 = time.thread_time()
    if profile is not None:
        profile.enable()
    sampler.episodes(prompts, n=1, temperature=1.0, seed=0)
    if profile is not None:
        profile.disable()
    cpu = time.thread_time() - cpu0
    calls = sum(len(s.calls) for s in sampler.last_sessions)
    m = sampler.last_metrics
    assert m["rollout/agent_failed_frac"] == 0, m
    assert m["rollout/agent_tokens_trained"] == m["rollout/agent_tokens_sampled"], m
    assert m["rollout/agent_split_samples"] == 0 and m["rollout/agent_rerendered_tokens"] == 0, m
    return cpu, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=32, help="concurrent sessions (1: sequential calls)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    tok = char_chat_tokenizer(string.printable)
    cfg = RolloutConfig(max_turns=args.turns, max_turn_tokens=len(REPLY), max_total_tokens=4096,
                        agent="bench_agent_calls.py:ToolLoop")
    sampler = AgentSampler(EngineBase(ScriptedLLM(tok)), tok, cfg, ToolLoop(args.turns))
    prompts = [Prompt(ids=[], text=f"Problem {i}", columns={"prompt": f"Problem {i}: 12345 * 678?"}, where="bench")
               for i in range(args.sessions)]
    one_run(sampler, prompts, None)  # warm-up: imports, the app, first-call costs
    per_call = []
    for _ in range(args.repeats):
        cpu, calls = one_run(sampler, prompts, None)
        per_call.append(1000 * cpu / calls)
    med = statistics.median(per_call)
    print(f"{args.sessions} sessions x {args.turns} calls, {args.repeats} repeats: main-thread CPU per call "
          f"median {med:.3f} ms (min {min(per_call):.3f}, max {max(per_call):.3f}); "
          f"runs: {', '.join(f'{x:.3f}' for x in per_call)}")
    if args.profile:
        prof = cProfile.Profile()
        one_run(sampler, prompts, prof)
        parts = spans(pstats.Stats(prof))
        total = parts[SPANS[0][0]]
        print("| part (cumulative, profiled) | share of the main thread's CPU |\n|---|---|")
        for part in dict.fromkeys(part for part, _ in SPANS):
            print(f"| {part} | {100 * parts.get(part, 0.0) / total:.1f}% |")


if __name__ == "__main__":
    main()
