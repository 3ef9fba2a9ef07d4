"""Run set-up shared by `rlfuse sft`, `rlfuse grpo`, `rlfuse eval` and the demo.

`open_session(cfg)` creates the run folder, writes the resolved config (config.yaml),
seeds the RNGs, loads the data rows, builds (or adopts) the tokenizer and the model and
returns them together; `session.sampler` builds the engine on first use, on the same
model object. Callers may pass `model`, `tokenizer` and `sampler` in (the demo chains SFT
and GRPO on one model; tests use a tiny sampler).
With `dist` (a DistContext: the CLI under torchrun) the model is built on the rank's
device and FSDP2-sharded before any optimizer exists, only rank 0 writes config.yaml,
and the sampler gathers the weights around each rollout (rlfuse.run.distributed.data_parallel).
With model.lora the adapters go onto the model (built or passed in) before the engine or
an optimizer is built on it (`rlfuse.run.build.apply_lora`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from rlfuse.data import build_prompts, check_prompt_len, load_rows, task_alphabet
from rlfuse.rollout import EngineSampler, MultiTurnSampler, RewardSet, char_chat_tokenizer, load_tools
from rlfuse.run import (apply_lora, build_engine, build_model, build_tokenizer, make_folder, pick_device,
                        seed_everything)
from rlfuse.run.config import RunConfig, save_config
from rlfuse.run.distributed import DistContext, GatheredSampler, shard_model

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Session:
    cfg: RunConfig
    run_dir: Path
    device: torch.device
    tokenizer: object
    model: torch.nn.Module
    train_rows: list
    eval_rows: list
    context_len: int
    """Longest sequence the run may build: engine.max_model_len, else the model's
    max_position_embeddings (prompts and SFT examples are checked against it)."""
    _sampler: object = None
    dist: DistContext | None = None
    """Set when the run is data-parallel (rlfuse.run.distributed.context); None in one process."""
    reward_functions: dict = dataclasses.field(default_factory=dict)
    """Reward callables by RewardSpec name (the Python API's reward_funcs), used instead of
    resolving those names."""
    data_stats: dict = dataclasses.field(default_factory=dict)
    """The data metrics (rows kept, dropped and truncated by reason, per split: the `stats=`
    of rlfuse.data.prompts's builders), filled as the run builds its data; run_loop writes
    them once at the start of a fresh run."""

    @property
    def sampler(self):
        if self._sampler is None and self.dist is not None:
            if self.cfg.rollout.multi_turn:
                raise ValueError("rollout.tools / rollout.env: multi-turn episodes run in one process; "
                                 "data-parallel (torchrun) is not supported for them yet")
            self._sampler = GatheredSampler(self.model, self._engine_sampler)
        if self._sampler is None:
            self._sampler = self._engine_sampler()
            if self.cfg.rollout.multi_turn:
                self._sampler = MultiTurnSampler(self._sampler, self.tokenizer, self.cfg.rollout, self.cfg.data)
        return self._sampler

    def _engine_sampler(self) -> EngineSampler:
        return EngineSampler(build_engine(self.model, self.tokenizer, self.cfg.engine), self.tokenizer)

    def rewards(self) -> RewardSet:
        return RewardSet(self.cfg.rewards, self.cfg.on_reward_error, self.reward_functions,
                         timeout_s=self.cfg.reward_timeout_s)

    def eval_prompts(self):
        return build_prompts(self.eval_rows, self.tokenizer, self.cfg.data, "eval", context_len=self.context_len,
                             stats=self.data_stats) if self.eval_rows else []


def open_session(cfg: RunConfig, *, model=None, tokenizer=None, sampler=None, need_target: bool = False,
                 write_config: bool = True, dist: DistContext | None = None,
                 reward_functions: dict | None = None) -> Session:
    run_dir = make_folder(cfg.logging.run_dir, "logging.run_dir")
    if write_config and (dist is None or dist.is_main):
        save_config(cfg, run_dir / "config.yaml")
    seed_everything(cfg.seed)
    train_rows = load_rows(cfg.data, "train", need_target=need_target)
    has_eval = bool(cfg.data.eval) or cfg.data.train.startswith("builtin:")
    eval_rows = load_rows(cfg.data, "eval") if has_eval else []
    if tokenizer is None:
        alphabet = ""
        if cfg.model.tokenizer == "char" and cfg.data.train.startswith("builtin:"):
            alphabet = task_alphabet(cfg.data.train.removeprefix("builtin:"),
                                     [r for _, r in train_rows] + [r for _, r in eval_rows])
        if cfg.rollout.multi_turn and alphabet:
            # episodes need a chat template: the compact one, with the tool calls' fixed pieces as tokens
            tools = [t.schema() for t in load_tools(cfg.rollout.tools)] if cfg.rollout.tools else None
            tokenizer = char_chat_tokenizer(alphabet, tools)
        else:
            tokenizer = build_tokenizer(cfg.model, alphabet)
    if model is None:
        device = pick_device(cfg.model.device) if dist is None else dist.device
        model = build_model(cfg.model, tokenizer, device, seed=cfg.seed)
    else:
        device = model.lm_head_weight.device
    if cfg.model.lora is not None and dist is not None:
        raise ValueError("model.lora: LoRA is not supported in data-parallel (torchrun) runs yet; run in one "
                         "process or drop model.lora")
    apply_lora(model, cfg.model, seed=cfg.seed)
    context_len = cfg.engine.max_model_len or model.config.max_position_embeddings
    check_prompt_len(cfg.data, context_len)
    if dist is not None:
        model = shard_model(model, dist)
    return Session(cfg, run_dir, device, tokenizer, model, train_rows, eval_rows, context_len, sampler, dist=dist,
                   reward_functions=dict(reward_functions or {}))
