"""Multi-turn rollouts over the engine: episodes of model turns and observations, as token ids.

    renderer = ChatRenderer(tokenizer, tools=runner.schemas())
    episodes, metrics = run_episodes(llm, renderer, lambda: ToolEnv(runner), rows, cfg=RolloutConfig(),
                                     group_size=4, sampling=dict(temperature=1.0), seed=0)

Each episode is one growing sequence of ids: the prompt, then model turns (the engine's
samples, with their log-probs) and observations (rendered by `ChatRenderer.observation`,
appended as ids). A turn is one engine request whose prompt is the whole trajectory so
far: the prefix cache hands back the K/V of every full block of earlier turns (the blocks
of a finished request stay cached until the pool needs them), so only the last partial
block and the observation are computed; if the blocks were evicted they are recomputed,
which in exact numerics gives the same bits. A preempted turn resumes by recompute inside
the engine with its ids unchanged. Request seeds are derived from (seed, episode), and the
engine's sample key hashes the request's prompt ids, so an episode's draws depend on its
own history only -- not on the batch, the order tools finish, or preemption.

While environments step (tool calls run on a thread pool), the engine keeps decoding the
other episodes; it waits only when no turn is left to decode (`rollout/engine_idle_frac`
is the share of the rollout's wall time spent so). Loss mask: 1 on model tokens, 0 on
observation tokens (context only).
Test: python -m pytest -q tests/test_rollout_multi_turn.py tests/test_rollout_exact.py
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import logging
import math
import numbers
import time
from typing import Callable

import torch

from rlfuse.engine.config import SamplingParams
from rlfuse.rollout.agent.chat import ChatRenderer, Conversation
from rlfuse.rollout.agent.env import DaemonPool, Environment, Step, Turn, call
from rlfuse.rollout.agent.tool_calls import parse_tool_calls
from rlfuse.run.config import RolloutConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class Episode:
    index: int
    prompt_index: int
    prompt_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    """Everything after the prompt: model turns and observations, in order."""
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    """Per token of `token_ids`: 1 the model sampled it (trained), 0 an observation token (context)."""
    logprobs: list[float] = dataclasses.field(default_factory=list)
    """The engine's log-prob of each model token; 0.0 at observation tokens."""
    turn_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(start, end) of each model turn in `token_ids`; the gaps between are observations."""
    turn_texts: list[str] = dataclasses.field(default_factory=list)
    turn_rewards: list[float | None] = dataclasses.field(default_factory=list)
    env_reward: float | None = None
    """The environment's reward(), or else the sum of its per-turn rewards; None if it gives neither."""
    per_turn: bool = False
    """env_reward is the sum of per-turn rewards (the environment has no reward())."""
    truncated: bool = False
    stop: str = ""
    """Why it ended: done, max_turns, max_total_tokens, context, env_error, env_timeout."""
    info: dict = dataclasses.field(default_factory=dict)
    """Sums of the environment's Step.info numbers, plus obs_tokens and obs_truncated."""
    cached_tokens: int = 0
    """Prompt tokens of its continuation turns served from the prefix cache."""
    continuation_tokens: int = 0
    """Prompt tokens of its continuation turns (the trajectory resubmitted)."""

    @property
    def turns(self) -> int:
        return len(self.turn_texts)

    @property
    def final_text(self) -> str:
        return self.turn_texts[-1] if self.turn_texts else ""

    def logprobs_tensor(self) -> torch.Tensor:
        return torch.tensor(self.logprobs, dtype=torch.float32)

    def turn_reward_marks(self) -> list[tuple[int, float]]:
        """(index in token_ids of a turn's last model token, that turn's Step.reward) for each
        non-empty turn the environment rewarded, when those rewards make up env_reward; else []."""
        if not self.per_turn:
            return []
        return [(end - 1, float(r)) for (start, end), r in zip(self.turn_spans, self.turn_rewards)
                if r is not None and end > start]


@dataclasses.dataclass(slots=True)
class _Live:
    ep: Episode
    env: Environment
    conv: Conversation
    seed: int
    last: list[int] = dataclasses.field(default_factory=list)
    finish: str = ""


MAX_ENV_WORKERS = 256
"""rollout.env_workers auto: at most this many environment steps at once."""
_said_workers: set = set()


def env_workers(cfg: RolloutConfig, episodes: int) -> int:
    """Threads stepping environments: rollout.env_workers, or (0, auto) one per episode up to
    MAX_ENV_WORKERS, so a turn's tool calls run together instead of queueing while the decode
    batch thins (the field's docstring). The auto choice is logged once per count."""
    if cfg.env_workers:
        return cfg.env_workers
    n = max(1, min(episodes, MAX_ENV_WORKERS))
    if n not in _said_workers:
        _said_workers.add(n)
        log.info("rollout.env_workers auto: %d threads (one per episode of the rollout, at most %d)", n,
                 MAX_ENV_WORKERS)
    return n


def episode_seed(seed: int, index: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=4).digest(), "little")


MAX_BYTES_PER_TOKEN = 64
"""An observation is cut to max_tokens * this many UTF-8 bytes before it is encoded (no
vocabulary has longer tokens in practice): a 50 MB tool output took 170 s to encode whole."""


def truncate_content(renderer: ChatRenderer, text: str, max_tokens: int, side: str) -> tuple[str, bool]:
    """An observation's text cut to `max_tokens` tokens (its head for side "right", its
    tail for "left"), with a note; observation text is not model output, so it may be
    re-encoded. Long text is first cut by bytes, so the cost is bounded by `max_tokens`."""
    limit = max_tokens * MAX_BYTES_PER_TOKEN
    cut_bytes = len(text) > limit // 4 and len(raw := text.encode("utf-8", "replace")) > limit
    if cut_bytes:  # a character split at the cut is dropped
        text = (raw[:limit] if side == "right" else raw[-limit:]).decode("utf-8", "ignore")
    ids = renderer.encode(text)
    if len(ids) <= max_tokens and not cut_bytes:
        return text, False
    keep = ids[:max_tokens] if side == "right" else ids[-max_tokens:]
    cut = renderer.tok.decode(keep, skip_special_tokens=False)
    return (cut + " [truncated]" if side == "right" else "[truncated] " + cut), True


def _short(obj, limit: int = 80) -> str:
    r = repr(obj)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def checked_reward(env, value, what: str, ep: Episode) -> float | None:
    """An environment's reward as a float, or None; anything else (NaN, inf, a string) is
    refused here, naming the environment and the episode, before it can reach the loss."""
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)):
        return float(value)
    raise ValueError(f"{type(env).__name__}{what} gave {_short(value)} for episode {ep.index} (row "
                     f"{ep.prompt_index}): an environment reward must be a finite number or None")


def _reset(env, row: dict, r: int, seed: int) -> list[dict]:
    """env.reset(row, seed=...) with its failures as one line naming the class and the row:
    a reset that raises or returns something else than messages fails the same way for
    every episode, so the run stops instead of counting errors."""
    name = type(env).__name__
    try:
        msgs = call(env.reset, row, seed=seed)
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- sys.exit() in user code is its failure (a Ctrl-C stays the user's)
        raise ValueError(f"{name}.reset raised {type(e).__name__}: {e} (row {r}: {_short(row)})") from None
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        raise ValueError(f"{name}.reset must return a list of message dicts ({{'role': ..., 'content': ...}}), "
                         f"got {_short(msgs)} (row {r})")
    return msgs


def run_episodes(engine, renderer: ChatRenderer, make_env: Callable[[], Environment], rows: list[dict], *,
                 cfg: RolloutConfig, group_size: int = 1, sampling: dict | None = None,
                 seed: int = 0, first_episode: int = 0) -> tuple[list[Episode], dict]:
    """`group_size` episodes per row (episode i of row r at r * group_size + i), each with a
    fresh environment from `make_env`. Episode i is seeded from (seed, first_episode + i):
    a data-parallel rank passes the global index of its first episode, so its episodes are
    seeded as one process seeds those of the whole batch. `engine`: an `rlfuse.engine.LLM` (or anything with
    its streaming API: add_request, step, has_unfinished, max_model_len). `sampling`:
    SamplingParams fields shared by every turn (temperature, top_p, top_k, ...).
    Returns (episodes, metrics)."""
    sampling = dict(sampling or {})
    t_start = time.perf_counter()
    workers = env_workers(cfg, len(rows) * group_size)
    pool = DaemonPool(workers, "rlfuse-env")  # a hung env.step never delays the process's exit
    live: dict[str, _Live] = {}
    futures: dict[cf.Future, tuple[_Live, float]] = {}
    episodes: list[Episode] = []
    idle_s, n_req = 0.0, 0

    def submit(lv: _Live) -> None:
        nonlocal n_req
        ep = lv.ep
        room = min(cfg.max_turn_tokens, cfg.max_total_tokens - len(ep.token_ids),
                   engine.max_model_len - len(ep.prompt_ids) - len(ep.token_ids))
        if room < 1:
            finish(lv, "max_total_tokens" if len(ep.token_ids) >= cfg.max_total_tokens else "context")
            return
        params = SamplingParams(**{**sampling, "n": 1, "max_tokens": room, "seed": lv.seed})
        rid = f"ep{ep.index}-t{ep.turns}-{n_req}"
        n_req += 1
        engine.add_request(ep.prompt_ids + ep.token_ids, params, request_id=rid)
        live[rid] = lv

    def finish(lv: _Live, stop: str) -> None:
        lv.ep.stop = stop
        lv.ep.truncated = lv.ep.truncated or stop not in ("done",)
        turn = [r for r in lv.ep.turn_rewards if r is not None]
        if turn and not hasattr(lv.env, "reward"):  # per-turn rewards only: the episode's is their sum
            lv.ep.env_reward = float(sum(turn))
            lv.ep.per_turn = True
        if hasattr(lv.env, "reward"):
            try:
                r = call(lv.env.reward)
            except (Exception, SystemExit) as e:  # noqa: BLE001 -- an environment's bug ends its episode, not the run
                log.warning("episode %d: env.reward() raised %s: %s", lv.ep.index, type(e).__name__, e)
                lv.ep.info["env_errors"] = lv.ep.info.get("env_errors", 0) + 1
                return
            lv.ep.env_reward = checked_reward(lv.env, r, ".reward()", lv.ep)

    def on_turn(lv: _Live, c) -> None:
        ep = lv.ep
        ids = list(c.output_token_ids)
        if ep.turns:
            ep.cached_tokens += c.num_cached_prompt_tokens
            ep.continuation_tokens += len(c.prompt_token_ids)
        ep.turn_spans.append((len(ep.token_ids), len(ep.token_ids) + len(ids)))
        ep.token_ids += ids
        ep.loss_mask += [1] * len(ids)
        ep.logprobs += [float(x) for x in c.logprobs]
        # special tokens stay in the text (Hermes tags may be special tokens); the end token does not
        body = ids[:-1] if ids and c.finish_reason == "stop" and ids[-1] in renderer.eos_ids else ids
        text = renderer.tok.decode(body, skip_special_tokens=False)
        ep.turn_texts.append(text)
        ep.turn_rewards.append(None)
        lv.last, lv.finish = ids, c.finish_reason
        calls, errors = parse_tool_calls(text, renderer.tool_call_format)
        turn = Turn(ep.turns - 1, text, ids, c.finish_reason, calls, errors)
        futures[pool.submit(call, lv.env.step, turn)] = (lv, time.perf_counter())

    def on_step(lv: _Live, step: Step) -> None:
        ep = lv.ep
        ep.turn_rewards[-1] = checked_reward(lv.env, step.reward, ".step() -> Step.reward", ep)
        for k, v in step.info.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                ep.info[k] = ep.info.get(k, 0) + v
        if step.done:
            ep.truncated = lv.finish == "length"
            finish(lv, "done")
            return
        if ep.turns >= cfg.max_turns:
            finish(lv, "max_turns")
            return
        msgs = []
        for m in step.messages:
            content, cut = truncate_content(renderer, str(m.get("content", "")), cfg.max_obs_tokens,
                                            cfg.obs_truncation)
            ep.info["obs_truncated"] = ep.info.get("obs_truncated", 0) + cut
            msgs.append({**m, "content": content})
        obs = renderer.observation(lv.conv, lv.last, lv.finish, msgs)
        total = len(ep.token_ids) + len(obs)
        if total >= cfg.max_total_tokens or len(ep.prompt_ids) + total >= engine.max_model_len:
            finish(lv, "max_total_tokens" if total >= cfg.max_total_tokens else "context")
            return
        ep.token_ids += obs
        ep.loss_mask += [0] * len(obs)
        ep.logprobs += [0.0] * len(obs)
        ep.info["obs_tokens"] = ep.info.get("obs_tokens", 0) + len(obs)
        submit(lv)

    try:
        for r, row in enumerate(rows):
            for g in range(group_size):
                i = r * group_size + g
                env = make_env()
                s = episode_seed(seed, first_episode + i)
                conv, prompt_ids = renderer.start(_reset(env, row, r, s))
                lv = _Live(Episode(i, r, prompt_ids), env, conv, s)
                episodes.append(lv.ep)
                submit(lv)
        while live or futures:
            if engine.has_unfinished():
                for c in engine.step():
                    on_turn(live.pop(c.request_id), c)
                block = 0.0
            else:  # nothing to decode: wait for an environment
                block = None
            now = time.perf_counter()
            deadline = min((t + cfg.env_timeout_s for _, t in futures.values()), default=now)
            wait_s = block if block is not None else max(0.0, deadline - now)
            t0 = time.perf_counter()
            done, _ = cf.wait(list(futures), timeout=wait_s, return_when=cf.FIRST_COMPLETED) if futures else ((), ())
            if block is None:
                idle_s += time.perf_counter() - t0
            for f in done:
                lv, _ = futures.pop(f)
                try:
                    step = f.result()
                except Exception as e:  # noqa: BLE001 -- an environment's bug ends its episode, not the run
                    log.warning("episode %d: %s.step raised %s: %s", lv.ep.index, type(lv.env).__name__,
                                type(e).__name__, e)
                    lv.ep.info["env_errors"] = lv.ep.info.get("env_errors", 0) + 1
                    finish(lv, "env_error")
                    continue
                if not isinstance(step, Step):  # the same for every episode: the run stops, naming the class
                    raise ValueError(f"{type(lv.env).__name__}.step returned {type(step).__name__} {_short(step)} "
                                     f"(episode {lv.ep.index}); it must return rlfuse.rollout.Step(messages=..., "
                                     "done=..., reward=...)")
                on_step(lv, step)
            now = time.perf_counter()
            for f, (lv, t) in list(futures.items()):
                if now - t > cfg.env_timeout_s:
                    futures.pop(f)
                    pool.abandon(f)
                    lv.ep.info["env_timeouts"] = lv.ep.info.get("env_timeouts", 0) + 1
                    finish(lv, "env_timeout")
    finally:
        pool.shutdown()
    wall = time.perf_counter() - t_start
    m = episode_metrics(episodes, idle_s=idle_s, wall_s=wall)
    m["rollout/env_workers"] = float(workers)
    log.info("multi-turn rollout: %d episodes in %.2f s, %.2f turns and %.2f tool calls each, %.1f%% truncated, "
             "engine idle %.1f%% of the time (waiting for environments)", len(episodes), wall,
             m["rollout/turns_mean"], m["rollout/tool_calls_per_episode"], 100 * m["rollout/truncated_frac"],
             100 * m["rollout/engine_idle_frac"])
    return episodes, m


def episode_metrics(episodes: list[Episode], *, idle_s: float = 0.0, wall_s: float = 0.0) -> dict:
    n = max(len(episodes), 1)
    keys = sorted({k for e in episodes for k in e.info} | {"tool_calls", "tool_errors", "tool_timeouts",
                                                            "obs_tokens", "obs_truncated"})
    m = {"rollout/turns_mean": sum(e.turns for e in episodes) / n,
         "rollout/truncated_frac": sum(e.truncated for e in episodes) / n,
         "rollout/engine_idle_frac": idle_s / wall_s if wall_s > 0 else 0.0}
    for k in keys:
        m[f"rollout/{k}_per_episode"] = sum(e.info.get(k, 0) for e in episodes) / n
    # completion_len counts everything after the prompt; these say how much of it is trained
    m["rollout/trained_tokens_per_episode"] = sum(sum(e.loss_mask) for e in episodes) / n
    m["rollout/trained_frac"] = (sum(sum(e.loss_mask) for e in episodes) /
                                 max(sum(len(e.loss_mask) for e in episodes), 1))
    cont = sum(e.continuation_tokens for e in episodes)
    m["rollout/continuation_cached_frac"] = sum(e.cached_tokens for e in episodes) / cont if cont else 0.0
    return m
