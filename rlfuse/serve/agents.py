"""Train your own agent: episodes of an `async def agent(client, row)` run against the training
process's own server, recorded token-exact (rollout.agent; docs/agents.md "Bring your own agent").

    GRPOTrainer(config=cfg, sampler_factory=agent_sampler).train()   # cfg.rollout.agent = "my_agent.py:agent"
    ses = open_agent_session(cfg); run_grpo(cfg, session=ses)          # the same, one level down

`AgentSampler.episodes` opens one session per episode on the app of `rlfuse serve`
(`build_app` + `add_session_routes`) over the trainer's engine, i.e. its own weights and LoRA
adapters, reached in-process through httpx's ASGI transport (no port, no copy of the
weights); the engine worker thread batches every session's calls continuously. Each agent
gets an `openai.AsyncOpenAI` bound to its session (`client.base_url`, `client.api_key` and
`client.http_client` for libraries that build their own client) and runs under
rollout.agent_timeout_s. It returns the episode's reward (a number, or a dict with "reward"
and other numbers logged as rollout/agent_<key>), or None to let the recipe's reward
functions score the last call's text. An agent that raises, times out, makes no call or
runs past max_turns / max_total_tokens is a failed episode: reward 0, counted by cause.
Training samples follow the merge rule (rlfuse.rollout.agent.recording): an episode whose
calls all extend one another is one sample; one that splits trains every segment
(`Sample.split_parts`, counted in rollout/agent_split_samples) with the episode's reward, the
trainer packing their common prefixes once (rlfuse.run.batching).
Data-parallel (torchrun): every rank holds its own AgentSampler, app and engine worker over its
own engine (`Session.base_sampler`: the gathered weights of an FSDP-sharded model, or a LoRA
replica) and runs the episodes of its block of the step's prompts, seeded by their global
index; the transport is in-process, so ranks share no port. `rank_ops` says which rollout
metrics the ranks sum (counts) or take the maximum of (wall time).
Test: python -m pytest -q tests/test_agent_sessions.py   (torchrun: -m slow tests/test_distributed_agents.py)
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import torch

from rlfuse.rollout import Sample, chat_template_text
from rlfuse.rollout.agent import COUNTED_METRICS, AgentSession, ChatRenderer, episode_seed, session_metrics
from rlfuse.run import load_function
from rlfuse.run.config import RolloutConfig, RunConfig
from rlfuse.serve.app import build_app
from rlfuse.serve.session import SessionStore, add_session_routes
from rlfuse.serve.worker import EngineWorker
from rlfuse.train import Session, open_session

log = logging.getLogger(__name__)
MODEL_NAME = "rlfuse-policy"
"""The model name the session server answers to (a request naming another gets a 404)."""


def load_agent(spec):
    """The agent callable from `rollout.agent` (FILE.py:NAME or module:NAME); a class is built
    once with no arguments and its instances called."""
    fn = load_function(spec, "rollout.agent") if isinstance(spec, str) else spec
    if isinstance(fn, type):
        fn = fn()
    if not callable(fn):
        raise ValueError(f"rollout.agent {spec!r}: expected an async function (client, row) or a class with one")
    return fn


class EngineBase:
    """An `LLM` built by hand as an AgentSampler's `base` (`rlfuse check`'s agent row, the
    benchmarks): `llm` and `wake()`; it never sleeps."""

    def __init__(self, llm):
        self.llm = llm

    def wake(self):
        self.llm.wake()


class AgentSampler:
    """A multi-turn sampler (`episodes`) whose episodes are the user's agent; `generate` stays
    the engine's single-turn one. `last_metrics`: the last rollout's rollout/agent_* metrics.
    `base`: a sampler with `wake()`, `sleep()`, `generate` and `llm` (the engine; read after
    the first `wake()`, as a data-parallel `GatheredSampler` builds its engine there)."""

    rank_ops = {**dict.fromkeys((*COUNTED_METRICS, "rollout/agent_dropped"), "sum"), "rollout/agent_wall_s": "max"}
    """How data-parallel ranks combine `last_metrics` (rlfuse.run.distributed.episode_metrics_on_ranks):
    totals are summed, the wall time is the slowest rank's; the rest are per-episode means."""

    def __init__(self, base, tokenizer, cfg: RolloutConfig, agent, *, chat_template: str | None = None):
        self.base, self.cfg, self.agent = base, cfg, load_agent(agent)
        self.store = SessionStore(tokenizer, tool_call_format=cfg.tool_call_format, chat_template=chat_template,
                                  max_turns=cfg.max_turns, max_turn_tokens=cfg.max_turn_tokens,
                                  max_total_tokens=cfg.max_total_tokens)
        self.app = None  # built on the engine at the first rollout (after the base's first wake)
        self.renderer = ChatRenderer(tokenizer, chat_template=chat_template, tool_call_format=cfg.tool_call_format)
        self.last_metrics: dict = {}
        self.last_sessions: list[AgentSession] = []

    def episodes(self, prompts, *, n: int, temperature: float, top_p: float = 1.0, top_k: int = 0,
                 seed: int, first_episode: int = 0) -> list[Sample]:
        """`n` episodes of the agent per Prompt (its `columns` are the row the agent gets), in
        the multi-turn order (episode g of prompt i at i * n + g); `first_episode`: the global
        index of the first one (for the seeds, as `MultiTurnSampler.episodes`)."""
        self.base.wake()
        if self.app is None:
            self.app = build_app(self.base.llm, MODEL_NAME)
            add_session_routes(self.app, self.store)
        self.store.sessions.clear()
        self.store.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        state = self.app.state.serve
        # the decode CUDA graphs now, on this thread, as EngineSampler.groups(capture=True): not
        # inside the rollout, where the worker thread would capture while agents wait (a no-op on
        # CPU / eager; after a data-parallel base's wake() the graphs are gone, so every rollout)
        self.base.llm.capture_graphs(up_to=len(prompts) * n)
        state.worker = EngineWorker(self.base.llm).start()  # a thread runs once: a fresh worker per rollout
        t0 = time.perf_counter()
        try:
            sessions = asyncio.run(self._run_all([p.columns for p in prompts], n, seed, first_episode))
        finally:
            state.worker.stop()
        samples, trained = [], []
        for i, ses in enumerate(sessions):
            s, segs = self._sample(prompts[i // n], i // n, ses)
            samples.append(s)
            trained += segs
        m = session_metrics(sessions, trained)
        for k in sorted({k for s in sessions for k in s.info}):
            m[f"rollout/agent_{k}"] = sum(s.info.get(k, 0.0) for s in sessions) / max(len(sessions), 1)
        m["rollout/truncated_frac"] = sum(s.truncated for s in samples) / max(len(samples), 1)
        m["rollout/agent_dropped"] = float(sum(s.dropped for s in samples))
        m["rollout/agent_wall_s"] = time.perf_counter() - t0
        self.last_metrics, self.last_sessions = m, sessions
        return samples

    def generate(self, prompt_ids, **kwargs) -> list[Sample]:
        return self.base.generate(prompt_ids, **kwargs)

    def sleep(self) -> None:
        self.base.sleep()

    def wake(self) -> None:
        self.base.wake()

    def _sample(self, prompt, index: int, ses: AgentSession):
        """(the episode's Sample, its trained segments): the last segment, the earlier ones as
        its split_parts."""
        segs = ses.segments()
        parts = [self._piece(index, seg) for seg in segs[:-1]] or None
        if ses.failed or not segs:
            if not segs and not ses.failed:
                ses.failed = "no_calls"
            # a failed episode: reward 0; its tokens (if any) stay in, so the policy learns to avoid it
            if not segs:
                return Sample(index, [min(self.renderer.eos_ids)], torch.zeros(1), True, "", torch.zeros(1),
                              list(prompt.ids), 0.0, dropped=self.cfg.failed_episode == "drop"), []
            s = self._piece(index, segs[-1])
            s.truncated, s.env_reward, s.split_parts = True, 0.0, parts
            if self.cfg.failed_episode == "drop":
                s.dropped = True
                for p in [*(parts or []), s]:
                    p.loss_mask = torch.zeros_like(p.loss_mask)
            return s, segs
        s, last = self._piece(index, segs[-1]), ses.calls[-1]
        s.truncated, s.text, s.env_reward, s.split_parts = last.finish_reason == "length", last.text, ses.reward, parts
        return s, segs

    @staticmethod
    def _piece(index: int, seg) -> Sample:
        return Sample(index, seg.token_ids, torch.tensor(seg.logprobs, dtype=torch.float32), False, "",
                      torch.tensor(seg.loss_mask, dtype=torch.float32), seg.prompt_ids)

    async def _run_all(self, rows: list[dict], n: int, seed: int, first: int = 0) -> list[AgentSession]:
        # the OpenAI client is the `dev` extra's, needed only when an agent runs
        import openai
        transport = httpx.ASGITransport(app=self.app)
        sessions = []
        async with httpx.AsyncClient(transport=transport, timeout=None) as http:
            jobs = []
            for r, row in enumerate(rows):
                for g in range(n):
                    i = r * n + g
                    sid = f"ep{i}"
                    ses = self.store.open(sid, episode_seed(seed, first + i))
                    sessions.append(ses)
                    client = openai.AsyncOpenAI(base_url=f"http://rlfuse/sessions/{sid}/v1", api_key="rlfuse",
                                                http_client=http, max_retries=0)
                    client.http_client = http  # for libraries that build their own client from base_url / api_key
                    jobs.append(self._episode(client, dict(row), ses))
            await asyncio.gather(*jobs)
        return sessions

    async def _episode(self, client, row: dict, ses: AgentSession) -> None:
        try:
            out = await asyncio.wait_for(self.agent(client, row), self.cfg.agent_timeout_s)
        except asyncio.TimeoutError:
            ses.failed = ses.failed or "timeout"
            return
        except Exception as e:  # noqa: BLE001 -- the user's agent failing ends its episode, not the run
            if not ses.failed:  # a refused call (max_turns, context, ...) is counted by its cause
                log.warning("agent episode raised %s: %s", type(e).__name__, e)
            ses.failed = ses.failed or "raised"
            return
        if isinstance(out, dict):
            ses.info = {k: float(v) for k, v in out.items() if k != "reward" and isinstance(v, (int, float))}
            out = out.get("reward")
        if out is not None and not isinstance(out, (int, float)):
            log.warning("agent returned %s; expected a number, a dict with 'reward', or None",
                        type(out).__name__)
            ses.failed = "raised"
            return
        ses.reward = None if out is None else float(out)


def agent_sampler(session: Session) -> AgentSampler:
    """The `sampler_factory` of a session whose rollouts are cfg.rollout.agent's episodes
    (`open_session(cfg, sampler_factory=agent_sampler)`, `GRPOTrainer(..., sampler_factory=agent_sampler)`)."""
    cfg = session.cfg.rollout
    return AgentSampler(session.base_sampler(), session.tokenizer, cfg, cfg.agent,
                        chat_template=chat_template_text(cfg))


def open_agent_session(cfg: RunConfig, **kwargs) -> Session:
    """`rlfuse.train.open_session` whose sampler runs cfg.rollout.agent."""
    if not cfg.rollout.agent:
        raise ValueError("rollout.agent: no agent given (FILE.py:FUNCTION)")
    return open_session(cfg, sampler_factory=agent_sampler, **kwargs)
