"""An agent through the OpenAI API vs the in-process environment path, same episodes (Qwen3-0.6B shape, GPU).

Issue 35's target: 256 concurrent sessions of a 4-turn agent with 50 ms tools reach >= 90%
of the tokens per second of the same episodes run through the in-process environment path,
in the same run; with 0 re-tokenized tokens and every trained token a sampled one.

A random Qwen3-0.6B-shaped model (bf16; bench_multi_turn's shape and character chat
tokenizer) plays 256 episodes (32 prompts x 8, GRPO-shaped groups) of `turns` model turns of
exactly `turn_tokens` tokens (ignore_eos: a random model rarely stops); after every turn a tool
sleeps `tool_ms` and answers with a ~30-character observation. Both rows share one engine
(same model, settings and seed; the prefix cache is emptied before each row):
  env    rlfuse.rollout.run_episodes with an environment whose step sleeps (time.sleep on the
         environment thread pool, one worker per episode).
  agent  `SleepAgent`, an `async def agent(client, row)` over `openai.AsyncOpenAI` (plain text
         turns; the assistant message goes back as the client returned it, then the tool's
         message after an asyncio.sleep), run by rlfuse.serve.AgentSampler -- the sampler
         training uses: the app of `rlfuse serve` over the same engine, in-process.
Both paths render the same prompts and observations and seed each episode alike, so in exact
numerics the agent's episodes are the env's, id for id ("same ids as env").
Two more agent rows use a Qwen3-style thinking template (THINK_TEMPLATE) that strips earlier
<think> blocks once a new user message follows: "think/tool" (tool results between calls:
append-only, merged) and "think/user" (observations sent as user turns: every call starts a
new sample of the episode, whose history the template re-renders). A random model writes no
<think> block, so there the template changes the structure only; tests/test_agent_thinking.py
has a model that reasons every turn.
Reported per row: model tokens/s, agent/env (target >= 0.90), wall s, the engine's idle share
(1 - time inside LLM.step / wall, measured alike for both paths) and its steps; for the agent
rows the CPU time of the asyncio thread per call (the agents, the OpenAI client, the app and
the recording: what the engine thread competes with for the GIL); from the agent rows'
recorded sessions: calls per episode, merged share, split samples, re-tokenized trained
tokens (trained ids that are not the sampled ids at their place; target 0), re-rendered
context tokens (earlier turns written into a fresh render's context -- only a split does
that; never trained), tokens trained == sampled; in exact numerics the rollout-vs-trainer
log-prob mismatch over every model token (rlfuse.rollout.exactness.compare; target 0).
`--gil-switch-ms` adds plain agent rows run at other GIL switch intervals: the agents, the
client and the app share the GIL with the engine thread, which waits up to the interval
(Python's default 5 ms) for it whenever the asyncio thread is busy.

    OUT=out python benchmarks/bench_agent.py                  # GPU: fast and exact numerics
    OUT=out python benchmarks/bench_agent.py --numerics exact
    OUT=out python benchmarks/bench_agent.py --gil-switch-ms 0.5   # + a plain agent row at a 0.5 ms GIL switch
    python benchmarks/bench_agent.py --small                  # CPU smoke test (tiny fp32 model)
Writes $OUT/bench_agent.json and $OUT/bench_agent.md (a table for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import string
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_multi_turn import SHAPE, SMALL  # noqa: E402 -- the multi-turn benchmark's model shapes

from rlfuse.data import Prompt  # noqa: E402
from rlfuse.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from rlfuse.model import CausalLM, ModelConfig  # noqa: E402
from rlfuse.rollout import ChatRenderer, Episode, Step, char_chat_tokenizer, run_episodes  # noqa: E402
from rlfuse.rollout.exactness import compare  # noqa: E402
from rlfuse.run.config import RolloutConfig  # noqa: E402
from rlfuse.serve.agents import MODEL_NAME, AgentSampler, EngineBase  # noqa: E402

THINK_TEMPLATE = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m.role == 'system' %}{{ '<s>' + m.content }}"
    "{% elif m.role == 'user' %}{{ '<u>' + m.content }}"
    "{% elif m.role == 'assistant' %}{% set content = m.content or '' %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{% if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{ '<a><think>\\n' + reasoning + '\\n</think>\\n\\n' + content + eos_token }}"
    "{% else %}{{ '<a>' + content + eos_token }}{% endif %}"
    "{% else %}{{ '<r>' + m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<a>' }}{% endif %}")
"""Qwen3's reasoning rule on the character chat template's markers: assistant turns after the
last user message keep their <think> block (the last one gets an empty block if it has none),
earlier ones lose it. Append-only in a tool loop; not once a new user message follows."""


def observation(k: int) -> str:
    """The tool's answer after model turn k (1-based), the same on both paths."""
    return f"result {k}: 12345 * 678 = 8369910"


class SleepEnv:
    """The env path: each step sleeps `tool_ms` on the environment thread, answers observation(k),
    ends after `turns` model turns."""

    def __init__(self, turns: int, tool_ms: float):
        self.turns, self.delay = turns, tool_ms / 1000

    def reset(self, row, *, seed):
        self.k = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn):
        self.k += 1
        time.sleep(self.delay)
        return Step(messages=[{"role": "tool", "content": observation(self.k)}], done=self.k >= self.turns)


class SleepAgent:
    """The agent path: `turns` chat calls; after each, a tool that sleeps `tool_ms` (asyncio) and
    answers observation(k) as a `role` message ("tool", or "user" to make a thinking template
    strip the earlier reasoning)."""

    def __init__(self, turns: int, tool_ms: float, role: str = "tool"):
        self.turns, self.delay, self.role = turns, tool_ms / 1000, role

    async def __call__(self, client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        for k in range(1, self.turns + 1):
            r = await client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                     extra_body={"ignore_eos": True})
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            await asyncio.sleep(self.delay)
            messages.append({"role": self.role, "content": observation(k)})
        return 0.0


class StepClock:
    """Seconds spent inside `llm.step`, whoever drives the engine (the env loop or the serve
    worker thread): wraps the instance's method for the `with` block."""

    def __init__(self, llm):
        self.llm, self.busy = llm, 0.0

    def __enter__(self):
        step = self.llm.step

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t0
        self.llm.step = timed
        return self

    def __exit__(self, *exc):
        del self.llm.step


def trained_vs_sampled(sessions) -> tuple[int, int]:
    """(sampled tokens, sampled tokens found verbatim -- ids and log-probs -- as a run of trained
    tokens of the episode's samples). Each call's output is one maximal run of mask-1 tokens
    (an observation, at least the turn's end, separates two), so the runs of every sample of
    an episode must be its calls' outputs, as a multiset."""
    sampled = found = 0
    for ses in sessions:
        runs = collections.Counter()
        for seg in ses.segments():
            run: list = []
            for t, m, lp in [*zip(seg.token_ids, seg.loss_mask, seg.logprobs), (None, 0, None)]:
                if m:
                    run.append((t, lp))
                elif run:
                    runs[tuple(run)] += 1
                    run = []
        for c in ses.calls:
            key = tuple(zip(c.output_ids, c.logprobs))
            sampled += len(key)
            if runs[key] > 0:
                runs[key] -= 1
                found += len(key)
    return sampled, found


def _mismatch(model, eps, numerics: str) -> dict:
    t, r, _ = compare(model, eps, numerics=numerics, micro_batch_tokens=16384)
    return {"mismatch_max_abs": float((t - r).abs().max()), "bitwise_frac": float((t == r).float().mean()),
            "compared_tokens": t.numel()}


def _env_row(llm, model, tok, rows, cfg, G, turns, tool_ms, numerics, sampling) -> tuple[dict, list[Episode]]:
    renderer = ChatRenderer(tok)
    llm.stats.reset()
    with StepClock(llm) as clock:
        t0 = time.perf_counter()
        eps, m = run_episodes(llm, renderer, lambda: SleepEnv(turns, tool_ms), rows, cfg=cfg, group_size=G,
                              sampling=sampling, seed=0)
        dt = time.perf_counter() - t0
    n = sum(sum(e.loss_mask) for e in eps)
    row = {"numerics": numerics, "path": "env", "template": "plain", "observations": "tool", "sessions": len(eps),
           "model_tokens": n, "seconds": dt, "tokens_per_s": n / dt, "engine_idle_frac": 1 - clock.busy / dt,
           "engine_steps": llm.stats.steps, "env_loop_idle_frac": m["rollout/engine_idle_frac"],
           "turns_mean": m["rollout/turns_mean"],
           "continuation_cached_frac": m["rollout/continuation_cached_frac"]}
    return row, eps


def _agent_row(llm, tok, rows, cfg, G, turns, tool_ms, numerics, *, template: str, role: str,
               switch_ms: float | None = None):
    """One agent row; `switch_ms`: the interpreter's GIL switch interval during the rollout
    (None: as it is, Python's 5 ms unless changed): how long the asyncio thread may hold the
    GIL while the engine thread waits for it."""
    sampler = AgentSampler(EngineBase(llm), tok, cfg, SleepAgent(turns, tool_ms, role),
                           chat_template=THINK_TEMPLATE if template == "think" else None)
    prompts = [Prompt(ids=[], text=r["prompt"], columns=dict(r), where="bench") for r in rows]
    llm.stats.reset()
    before = sys.getswitchinterval()
    sys.setswitchinterval(before if switch_ms is None else switch_ms / 1000)
    try:
        with StepClock(llm) as clock:
            t0, cpu0 = time.perf_counter(), time.thread_time()
            sampler.episodes(prompts, n=G, temperature=1.0, seed=0)  # asyncio in this thread, the engine in another
            dt, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        switch = sys.getswitchinterval() * 1000
    finally:
        sys.setswitchinterval(before)
    m, sessions = sampler.last_metrics, sampler.last_sessions
    sampled, found = trained_vs_sampled(sessions)
    row = {"numerics": numerics, "path": "agent", "template": template, "observations": role,
           "gil_switch_ms": switch, "sessions": len(sessions), "model_tokens": sampled, "seconds": dt, "tokens_per_s": sampled / dt,
           "engine_idle_frac": 1 - clock.busy / dt, "engine_steps": llm.stats.steps,
           "host_ms_per_call": 1000 * cpu / max(sum(len(s.calls) for s in sessions), 1),
           "calls_per_episode": m["rollout/agent_calls_per_episode"], "merged_frac": m["rollout/agent_merged_frac"],
           "split_samples": int(m["rollout/agent_split_samples"]), "failed_frac": m["rollout/agent_failed_frac"],
           "retokenized_trained_tokens": sampled - found,
           "rerendered_context_tokens": int(m["rollout/agent_rerendered_tokens"]),
           "tokens_trained": int(m["rollout/agent_tokens_trained"]), "tokens_sampled": int(m["rollout/agent_tokens_sampled"]),
           "trained_eq_sampled_frac": found / max(sampled, 1)}
    return row, sessions


def run(small: bool, turns: int, turn_tokens: int, tool_ms: float, out: Path, *, prompts: int | None = None,
        group: int | None = None, numerics_list=("fast", "exact"), think: bool = True,
        switch_ms: tuple[float, ...] = ()) -> dict:
    dev = "cpu" if small else "cuda"
    model = CausalLM(ModelConfig(**(SMALL if small else SHAPE)))
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
    model = model.to(device=dev, dtype=torch.float32 if small else torch.bfloat16)
    tok = char_chat_tokenizer(string.printable)
    rows = [{"prompt": f"Problem {i}: multiply the numbers and explain."} for i in range(prompts or (4 if small else 32))]
    G = group or (2 if small else 8)
    cfg = RolloutConfig(max_turns=turns, max_turn_tokens=turn_tokens, max_total_tokens=turns * (turn_tokens + 64),
                        agent="bench_agent.py:SleepAgent")
    sampling = dict(temperature=1.0, ignore_eos=True)
    results = []
    for numerics in numerics_list:
        llm = LLM(model, tok, EngineConfig(numerics=numerics, max_num_seqs=max(256, len(rows) * G),
                                           max_model_len=cfg.max_total_tokens + 128))
        if not small:
            llm.capture_graphs()  # now, out of the timings (and out of the serve worker thread)
        renderer = ChatRenderer(tok)
        warm = [renderer.start([{"role": "user", "content": r["prompt"]}])[1] for r in rows[:1]]
        llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True))
        # warm-up of both paths (imports, the app's routes, first-call costs), one short episode each
        short = RolloutConfig(max_turns=2, max_turn_tokens=4, max_total_tokens=200, agent=cfg.agent)
        run_episodes(llm, renderer, lambda: SleepEnv(2, 0), rows[:1], cfg=short, sampling=sampling, seed=0)
        _agent_row(llm, tok, rows[:1], short, 1, 2, 0, numerics, template="plain", role="tool")
        plan = [("plain", "tool", None)] + [("plain", "tool", ms) for ms in switch_ms]
        plan += [("think", "tool", None), ("think", "user", None)] if think else []
        llm.reset_prefix_cache()
        env, eps = _env_row(llm, model, tok, rows, cfg, G, turns, tool_ms, numerics, sampling)
        sessions_of = []
        agent_rows = []
        for template, role, ms in plan:
            llm.reset_prefix_cache()  # each row computes its own K/V (the env row's would be hits here)
            r, sessions = _agent_row(llm, tok, rows, cfg, G, turns, tool_ms, numerics, template=template, role=role,
                                     switch_ms=ms)
            r["vs_env"] = r["tokens_per_s"] / env["tokens_per_s"]
            agent_rows.append(r)
            sessions_of.append(sessions)
        env["vs_env"] = 1.0
        plain = sessions_of[0]
        # the same episodes, id for id: one merged sample each, equal to the env episode's sequence
        same = sum(len(segs := s.segments()) == 1 and segs[0].prompt_ids == e.prompt_ids
                   and segs[0].token_ids == e.token_ids and segs[0].loss_mask == e.loss_mask
                   for s, e in zip(plain, eps))
        agent_rows[0]["same_ids_as_env_frac"] = same / max(len(eps), 1)
        if numerics == "exact":
            llm.sleep()  # the KV pool's memory back for the trainer's forward
            env.update(_mismatch(model, eps, numerics))
            for r, sessions in zip(agent_rows, sessions_of):
                segs = [g for s in sessions for g in s.segments()]
                r.update(_mismatch(model, [Episode(i, 0, g.prompt_ids, g.token_ids, g.loss_mask, g.logprobs)
                                           for i, g in enumerate(segs)], numerics))
        for r in (env, *agent_rows):
            print(json.dumps(r), flush=True)
            results.append(r)
        llm.sleep()
        del llm
    gpu = "cpu" if small else torch.cuda.get_device_name()
    # run_gpu.sh sets RLFUSE_COMMIT (the device's .git may be stale)
    commit = os.environ.get("RLFUSE_COMMIT") or os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip()
    episodes = f"{len(rows)} prompts x {G}"
    result = {"gpu": gpu, "torch": torch.__version__, "commit": commit, "small": small, "episodes": episodes,
              "turns": turns, "turn_tokens": turn_tokens, "tool_ms": tool_ms, "rows": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_agent.json").write_text(json.dumps(result, indent=2))
    lines = [f"GPU {gpu}, torch {torch.__version__}, commit {commit}; {episodes} episodes of {turns} turns x "
             f"{turn_tokens} tokens, {tool_ms:g} ms tools", "",
             "| numerics | path | template / observations | model tokens | s | tok/s | vs env | engine idle | engine steps "
             "| host ms/call | "
             "calls/ep | merged | split samples | re-tokenized | re-rendered ctx | trained = sampled | same ids as env "
             "| exact mismatch |", "|---" * 18 + "|"]

    def cell(r, k, fmt):
        return format(r[k], fmt) if k in r else ""
    for r in results:
        switch = f", GIL switch {r['gil_switch_ms']:g} ms" if r.get("gil_switch_ms", 5.0) != 5.0 else ""
        lines.append(f"| {r['numerics']} | {r['path']} | {r['template']} / {r['observations']}{switch} "
                     f"| {r['model_tokens']} "
                     f"| {r['seconds']:.2f} | {r['tokens_per_s']:.0f} | {r['vs_env']:.2f}x "
                     f"| {r['engine_idle_frac']:.3f} | {r['engine_steps']} | {cell(r, 'host_ms_per_call', '.2f')} "
                     f"| {cell(r, 'calls_per_episode', '.2f')} "
                     f"| {cell(r, 'merged_frac', '.2f')} | {cell(r, 'split_samples', 'd')} "
                     f"| {cell(r, 'retokenized_trained_tokens', 'd')} | {cell(r, 'rerendered_context_tokens', 'd')} "
                     f"| {cell(r, 'trained_eq_sampled_frac', '.2%')} | {cell(r, 'same_ids_as_env_frac', '.2%')} "
                     f"| {cell(r, 'mismatch_max_abs', 'g')} |")
    (out / "bench_agent.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny fp32 model on the CPU (smoke test)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=None, help="tokens per turn (default 256; 8 with --small)")
    ap.add_argument("--tool-ms", type=float, default=50.0)
    ap.add_argument("--prompts", type=int, default=None, help="prompts (default 32; 4 with --small)")
    ap.add_argument("--group", type=int, default=None, help="episodes per prompt (default 8; 2 with --small)")
    ap.add_argument("--numerics", nargs="+", default=["fast", "exact"], choices=["fast", "exact"])
    ap.add_argument("--no-think", action="store_true", help="skip the two thinking-template agent rows")
    ap.add_argument("--gil-switch-ms", type=float, nargs="*", default=[],
                    help="extra plain agent rows, each run with this GIL switch interval (sys.setswitchinterval; "
                         "Python's default is 5 ms): whether the engine thread waits on the asyncio thread")
    args = ap.parse_args()
    run(args.small, args.turns, args.turn_tokens or (8 if args.small else 256), args.tool_ms,
        Path(os.environ.get("OUT", "out")), prompts=args.prompts, group=args.group, numerics_list=args.numerics,
        think=not args.no_think, switch_ms=tuple(args.gil_switch_ms))


if __name__ == "__main__":
    main()
