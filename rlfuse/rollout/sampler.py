"""The trainer's view of the inference engine: prompts in, `Sample`s out.

The trainer reaches `rlfuse.engine` only through `EngineSampler` (its public API:
`LLM.generate(token_ids, SamplingParams)`, `sleep()`, `wake()`). Anything with the same
three methods (`Sampler` protocol) can stand in, e.g. a test's tiny sampler.

A Sample's `logprobs` are the engine's log p(token) under softmax(logits / T) before
top-k/top-p filtering, T = `rlfuse.engine.config.logprob_temperature(temperature)`, from `rlfuse.kernels.loss.logprob.token_logprobs` -- exactly the
quantity the trainer recomputes, so they serve as the PPO "old" log-probs.
Order: prompt-major, `n` samples per prompt (sample k of prompt i at i * n + k).

`MultiTurnSampler` adds `episodes(prompts, ...)`: multi-turn episodes with the recipe's
tools or environment (rlfuse.rollout.agent.multi_turn), as Samples whose `token_ids` hold the
model turns and the observations, `loss_mask` telling them apart, and `prompt_ids` the
episode's own prompt (rendered with the tools' schemas).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import torch

from rlfuse.engine import SamplingParams
from rlfuse.rollout.agent.chat import ChatRenderer
from rlfuse.rollout.agent.env import ToolEnv, ToolRunner
from rlfuse.rollout.agent.multi_turn import MAX_ENV_WORKERS, run_episodes
from rlfuse.rollout.agent.tools import load_tools
from rlfuse.run import load_function
from rlfuse.run.config import DataConfig, RolloutConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class Sample:
    prompt_index: int
    token_ids: list[int]
    logprobs: torch.Tensor  # (len(token_ids),) fp32, CPU
    truncated: bool
    """Stopped by max_tokens rather than EOS / a stop condition (multi-turn: the episode did not finish)."""
    text: str
    """The completion's text (multi-turn: the last turn's, the answer rewards score)."""
    loss_mask: torch.Tensor | None = None
    """Multi-turn: (len(token_ids),) fp32, 1 on the model's tokens, 0 on observation tokens
    (context only); None: every token is the model's."""
    prompt_ids: list[int] | None = None
    """Multi-turn: the episode's prompt ids; None: the Prompt's."""
    env_reward: float | None = None
    """Multi-turn: the environment's episode reward, if it gives one."""
    turn_rewards: list[tuple[int, float]] | None = None
    """Multi-turn: (index in token_ids of a turn's last model token, its per-turn reward) when
    env_reward is the sum of per-turn rewards (Episode.turn_reward_marks); PPO places them there."""
    routing: torch.Tensor | None = None
    """MoE models: (len(token_ids), MoE layers, k) int16, the experts the engine routed each
    sampled token's producing row to (`Completion.routing`); None when not recorded."""
    dropped: bool = False
    """Left out of training (rollout.failed_episode drop): its loss mask is all zeros, and the
    GRPO step counts its reward as the mean of its group's others (`drop_rewards`)."""
    split_parts: list["Sample"] | None = None
    """Agent episodes whose calls split (rlfuse.rollout.agent.recording): the episode's earlier
    samples, each with its own prompt_ids, token_ids, logprobs and loss_mask, in the order
    they started; trained with this sample's reward and advantage, their common prefixes
    packed once (rlfuse.run.batching). None: the episode is this one sample."""


def media_kwargs(prompts) -> dict:
    """{"media": [each Prompt's images]} when any prompt has images, else {}: a text-only run
    calls a sampler as before (a test's stand-in sampler need not know images)."""
    media = [p.media for p in prompts]
    return {"media": media} if any(media) else {}


class Sampler(Protocol):
    def generate(self, prompt_ids: list[list[int]], *, n: int, temperature: float, top_p: float, top_k: int,
                 max_tokens: int, seed: int) -> list[Sample]: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


class EngineSampler:
    """`Sampler` over `rlfuse.engine.LLM` (a flat, prompt-major list of Completions)."""

    def __init__(self, llm, tokenizer):
        self.llm, self.tokenizer = llm, tokenizer
        self.vision_encodes = 0
        """Vision-tower runs of the last `generate` / `groups` call (the metric vision/encodes)."""

    def generate(self, prompt_ids, *, n, temperature, top_p=1.0, top_k=0, max_tokens, seed,
                 media=None) -> list[Sample]:
        samples: list[Sample] = []
        for _, group in sorted(self.groups(prompt_ids, n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                           max_tokens=max_tokens, seed=seed, media=media), key=lambda x: x[0]):
            samples += group
        return samples

    def groups(self, prompt_ids, *, n, temperature, top_p=1.0, top_k=0, max_tokens, seed, capture=False, media=None):
        """`generate`, yielding (prompt index, its n Samples) as soon as all n completions of
        a prompt have finished (in finishing order), between engine steps: what the caller
        does with a group runs while the rest decode (grpo.overlap stream). `capture`: take
        the decode CUDA graphs first, not on first use, when the caller's work may run on
        another thread by then. `media`: per prompt its images (`Prompt.media`), or None."""
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                seed=seed % 2**32)
        self.llm.wake()  # no-op when awake; the KV pool must exist to generate
        if capture:
            self.llm.capture_graphs(up_to=len(prompt_ids) * n)
        requests = [(i, p) for i, ids in enumerate(prompt_ids) for p in self.request_params(i, params)]
        if any(sum(p.n for j, p in requests if j == i) != n for i in range(len(prompt_ids))):
            raise RuntimeError(f"request_params: a prompt's requests do not add up to n={n} samples")
        pending = {i: [] for i in range(len(prompt_ids))}
        req_media = None if media is None else [media[i] for i, _ in requests]
        encodes0 = self.llm.stats.vision_encodes
        for r, c in self.llm.stream([prompt_ids[i] for i, _ in requests], [p for _, p in requests], req_media):
            i = requests[r][0]
            text = c.text if c.text is not None else self.tokenizer.decode(c.output_token_ids,
                                                                          skip_special_tokens=True)
            pending[i].append((r, c.index, Sample(i, list(c.output_token_ids), c.logprobs.float(),
                                                  c.finish_reason == "length", text, routing=c.routing)))
            if len(pending[i]) == n:
                self.vision_encodes = self.llm.stats.vision_encodes - encodes0
                yield i, [s for _, _, s in sorted(pending.pop(i), key=lambda x: x[:2])]
        if pending:
            raise RuntimeError(f"engine finished with {len(pending)} of {len(prompt_ids)} prompts short of n={n} "
                               "completions")

    def request_params(self, prompt_index: int, params: SamplingParams) -> list[SamplingParams]:
        """The engine requests of one prompt's group (their `n` add up to params.n; samples
        keep request order): one request of n samples. A benchmark overrides it to give each
        completion its own length (benchmarks/bench_stream.py)."""
        return [params]

    def kv_pool_bytes(self) -> int:
        """The engine's KV pool (allocated while awake): the memory stream mode trains beside."""
        return self.llm.kv.nbytes

    def sleep(self) -> None:
        self.llm.sleep()

    def wake(self) -> None:
        self.llm.wake()


class LengthsSampler(EngineSampler):
    """An `EngineSampler` whose completions stop at lengths chosen in advance: completion k
    of prompt i after min(length(i, k), max_tokens) tokens, EOS ignored (random weights
    rarely sample it). For benchmarks and tests of grpo.overlap stream, which need groups
    that finish at different times. Each completion is its own request, seeded seed + k."""

    def __init__(self, llm, tokenizer, length):
        super().__init__(llm, tokenizer)
        self.length = length

    def request_params(self, prompt_index: int, params: SamplingParams) -> list[SamplingParams]:
        return [dataclasses.replace(params, n=1, max_tokens=max(1, min(self.length(prompt_index, k), params.max_tokens)),
                                    seed=(params.seed + k) % 2**32, ignore_eos=True) for k in range(params.n)]


def env_tool_schemas(env_cls) -> list[dict] | None:
    """The schemas an environment class shows the model through the chat template: its
    `tools` attribute (typed functions, Tools or schema dicts); its step() runs the calls."""
    tools = getattr(env_cls, "tools", None)
    if not tools:
        return None
    what = f"{getattr(env_cls, '__name__', 'env')}.tools"
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"{what}: expected a list of functions, Tools or schema dicts, got {type(tools).__name__}")
    return [t if isinstance(t, dict) else load_tools([t], what=what, check=False)[0].schema() for t in tools]


def episode_renderer(tokenizer, cfg: RolloutConfig, schemas: list[dict] | None = None, *,
                     tool_functions: dict | None = None) -> ChatRenderer:
    """The ChatRenderer of the recipe's episodes: its chat template (rollout.chat_template,
    else the tokenizer's), tool-call format and tool schemas (`schemas`, else those of
    rollout.tools or the environment class's `tools`; no code is run). An SFT warm-up lays
    its chat rows out with it (`transcript`), so it trains exactly the ids a rollout makes."""
    if schemas is None:
        if cfg.env:
            schemas = env_tool_schemas(load_function(cfg.env, "rollout.env"))
        elif cfg.tools:
            schemas = [t.schema() for t in load_tools(cfg.tools, check=False, functions=tool_functions)]
    return ChatRenderer(tokenizer, tools=schemas, chat_template=chat_template_text(cfg),
                        tool_call_format=cfg.tool_call_format)


def chat_template_text(cfg: RolloutConfig) -> str | None:
    """The text of rollout.chat_template (None: the tokenizer's own); an unreadable file is a
    ValueError naming the field."""
    if not cfg.chat_template:
        return None
    try:
        return open(cfg.chat_template, encoding="utf-8").read()
    except OSError as e:
        raise ValueError(f"rollout.chat_template: cannot read {cfg.chat_template} ({e.strerror})") from None


class MultiTurnSampler:
    """An `EngineSampler` plus multi-turn episodes (`rollout.tools` or `rollout.env`);
    `generate` stays the single-turn one. `last_metrics`: the last `episodes` call's
    rollout/* metrics (turns, tool calls, errors, timeouts, idle fraction, ...)."""

    def __init__(self, base: EngineSampler, tokenizer, cfg: RolloutConfig, data: DataConfig, *,
                 tool_functions: dict | None = None):
        self.base, self.cfg = base, cfg
        self.runner = None
        if cfg.env:
            env_cls = load_function(cfg.env, "rollout.env")
            kwargs = dict(cfg.env_kwargs)
            self.make_env, schemas = (lambda: env_cls(**kwargs)), env_tool_schemas(env_cls)
        else:
            tools = load_tools(cfg.tools, timeout_s=cfg.tool_timeout_s, sandbox=cfg.sandbox, functions=tool_functions)
            # tool calls of concurrent env steps: as many at once as env steps (auto: the most there can be)
            self.runner = ToolRunner(tools, timeout_s=cfg.tool_timeout_s, workers=cfg.env_workers or MAX_ENV_WORKERS)
            system = data.system_prompt or None
            self.make_env = lambda: ToolEnv(self.runner, system=system, prompt_template=data.prompt_template)
            schemas = self.runner.schemas()
        self.renderer = episode_renderer(tokenizer, cfg, schemas)
        self.last_metrics: dict = {}
        self._no_calls = 0  # rollouts without a single tool call (warned)

    def episodes(self, prompts, *, n: int, temperature: float, top_p: float = 1.0, top_k: int = 0,
                 seed: int, first_episode: int = 0) -> list[Sample]:
        """`n` episodes per Prompt (its `columns` are the row the environment resets from);
        `first_episode`: the global index of the first one (data-parallel ranks, for the seeds)."""
        self.base.wake()
        eps, self.last_metrics = run_episodes(self.base.llm, self.renderer, self.make_env, [p.columns for p in prompts],
                                              cfg=self.cfg, group_size=n, seed=seed, first_episode=first_episode,
                                              sampling=dict(temperature=temperature, top_p=top_p, top_k=top_k))
        if self.runner is not None and eps and not self.last_metrics.get("rollout/tool_calls_per_episode"):
            self._no_calls += 1
            if self._no_calls <= 3:  # a policy that never calls a tool cannot learn to from rewards
                log.warning("%d episodes and not one tool call (tools: %s)%s: check that the chat template shows "
                            "the tools and that the prompt or an SFT warm-up teaches the call format "
                            "(docs/agents.md)", len(eps), ", ".join(self.runner.tools),
                            " -- said 3 times, not repeated" if self._no_calls == 3 else "")
        return [Sample(e.prompt_index, e.token_ids, e.logprobs_tensor(), e.truncated, e.final_text,
                       torch.tensor(e.loss_mask, dtype=torch.float32), e.prompt_ids, e.env_reward,
                       e.turn_reward_marks()) for e in eps]

    def generate(self, prompt_ids, **kwargs) -> list[Sample]:
        return self.base.generate(prompt_ids, **kwargs)

    @property
    def llm(self):
        """The engine (the single-turn sampler's): `GRPOTrainer.generate()` reaches it here."""
        return self.base.llm

    def sleep(self) -> None:
        self.base.sleep()

    def wake(self) -> None:
        self.base.wake()
