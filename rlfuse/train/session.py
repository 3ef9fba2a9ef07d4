"""Run set-up shared by `rlfuse sft`, `rlfuse grpo`, `rlfuse eval` and the demo.

`open_session(cfg)` creates the run folder, writes the resolved config (config.yaml),
seeds the RNGs, loads the data rows, builds (or adopts) the tokenizer and the model and
returns them together; `session.sampler` builds the engine on first use, on the same
model object. Callers may pass `model`, `tokenizer` and `sampler` in (the demo chains SFT
and GRPO on one model; tests use a tiny sampler).
With `dist` (a DistContext: the CLI under torchrun) the model is built on the rank's
device and FSDP2-sharded before any optimizer exists, only rank 0 writes config.yaml,
and the sampler gathers the weights around each rollout (rlfuse.run.distributed.data_parallel);
multi-turn and agent samplers wrap that per-rank sampler (`Session.base_sampler`).
With model.lora the adapters go onto the model (built or passed in) before the engine or
an optimizer is built on it (`rlfuse.run.build.apply_lora`); data-parallel, such a model is
not sharded: every rank holds the whole base and the adapters, and each rank's engine runs
on its own replica (rlfuse.run.distributed.replicated).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from rlfuse.data import (
    ImageProcessor,
    VisionData,
    build_prompts,
    check_prompt_len,
    load_rows,
    rows_alphabet,
    task_alphabet,
)
from rlfuse.kernels.backend import KernelSettings
from rlfuse.model.config import read_json
from rlfuse.model.lora import BaseModelView, has_lora
from rlfuse.model.weights import parse_dtype
from rlfuse.rollout import EngineSampler, MultiTurnSampler, RewardSet, char_chat_tokenizer, load_tools
from rlfuse.run import (
    apply_lora,
    build_engine,
    build_model,
    build_sharded,
    build_tokenizer,
    make_folder,
    pick_device,
    seed_everything,
)
from rlfuse.run.config import RunConfig, save_config
from rlfuse.run.distributed import DistContext, GatheredSampler, configure_fsdp, is_sharded, shard_model

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
    sampler_factory: object = None
    """`factory(session) -> sampler` building the sampler on first use instead of the engine's
    (rollout.agent: `rlfuse.serve.agent_sampler`, whose server lives above this layer)."""
    dist: DistContext | None = None
    """Set when the run is data-parallel (rlfuse.run.distributed.context); None in one process."""
    reward_functions: dict = dataclasses.field(default_factory=dict)
    """Reward callables by RewardSpec name (the Python API's reward_funcs), used instead of
    resolving those names."""
    tool_functions: dict = dataclasses.field(default_factory=dict)
    """Tool callables by their rollout.tools entry (the Python API's tool functions)."""
    vision: VisionData | None = None
    """Vision models: the image processor and marker ids image rows are built with (None: text)."""
    data_stats: dict = dataclasses.field(default_factory=dict)
    """The data metrics (rows kept, dropped and truncated by reason, per split: the `stats=`
    of rlfuse.data.prompts's builders), filled as the run builds its data; run_loop writes
    them once at the start of a fresh run."""

    @property
    def sampler(self):
        if self._sampler is None and self.sampler_factory is not None:
            self._sampler = self.sampler_factory(self)
        if self._sampler is None and self.cfg.rollout.agent:
            raise ValueError("rollout.agent: your agent runs against the training process's own server, which "
                             "rlfuse.serve builds: pass sampler_factory=rlfuse.serve.agent_sampler to the trainer "
                             "or open_session (the CLI does)")
        if self._sampler is None:
            # data-parallel: each rank runs the episodes of its own prompts (multi-turn wraps the base sampler)
            self._sampler = self.base_sampler()
            if self.cfg.rollout.multi_turn:
                self._sampler = MultiTurnSampler(self._sampler, self.tokenizer, self.cfg.rollout, self.cfg.data,
                                                 tool_functions=self.tool_functions)
        return self._sampler

    def base_sampler(self):
        """A new single-turn sampler on this process's model: the engine on the model itself
        (one process, or a data-parallel replica: LoRA), or, on an FSDP-sharded model, a
        `GatheredSampler` whose engine runs on the weights gathered at each `wake()`. What
        multi-turn and agent samplers wrap (`sampler_factory` builders call it too)."""
        if self.dist is None or not is_sharded(self.model):
            return self._engine_sampler()
        # fused projections on the gathered weights where the engine would fuse (CUDA by default)
        return GatheredSampler(self.model, self._engine_sampler, fuse=fuse_projections_on(self.cfg, self.dist.device))

    def _engine_sampler(self) -> EngineSampler:
        return EngineSampler(build_engine(self.model, self.tokenizer, self.cfg.engine), self.tokenizer)

    def rewards(self) -> RewardSet:
        # an environment scores its own episodes (reward() or per-turn rewards): functions are optional
        return RewardSet(self.cfg.rewards, self.cfg.on_reward_error, self.reward_functions,
                         timeout_s=self.cfg.reward_timeout_s, allow_empty=bool(self.cfg.rollout.env))

    def eval_prompts(self):
        return build_prompts(self.eval_rows, self.tokenizer, self.cfg.data, "eval", context_len=self.context_len,
                             stats=self.data_stats, vision=self.vision) if self.eval_rows else []


def vision_data(spec, vcfg, tokenizer) -> VisionData:
    """The image processor of a vision model: the checkpoint's preprocessor_config.json (if
    any) under model.processor's settings, checked against the tower's patch / merge sizes."""
    keys = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "image_mean", "image_std")
    bad = sorted(set(spec.processor) - set(keys))
    if bad:
        raise ValueError(f"model.processor.{bad[0]}: unknown image processor setting; valid: {list(keys)}")
    path = Path(spec.path) / "preprocessor_config.json" if spec.path else None
    if path is not None and path.is_file():
        src, base = str(path), read_json(path)
    else:  # a random-init model (or a folder without the file): the tower's own patch shapes
        src, base = "model.processor", ImageProcessor.for_model(vcfg).to_dict()
    proc = ImageProcessor.from_dict({**base, **spec.processor}, src)
    proc.check_model(vcfg, src)
    return VisionData.for_tokenizer(proc, tokenizer)


def fuse_projections_on(cfg: RunConfig, device: torch.device) -> bool:
    """engine.fuse_projections resolved as the engine resolves it (`EngineConfig.fuses_on`).
    A sharded model then fuses both its engine's gathered weights and its training forwards."""
    return cfg.engine.fuses_on(device)


def kernel_settings(cfg: RunConfig, *models) -> None:
    """Every forward of the run (trainer, engine, KL reference, critic) in one backend
    (model.kernel_backend) and one numerics (engine.numerics), entered by each model itself
    (`CausalLM.kernels`); a model that already carries settings (a copy of the policy) keeps
    them, and a LoRA base view uses its model's."""
    for m in models:
        if m is not None and not isinstance(m, BaseModelView) and m.kernels is None:
            m.kernels = KernelSettings(backend=cfg.model.kernel_backend, numerics=cfg.engine.numerics)


def open_session(cfg: RunConfig, *, model=None, tokenizer=None, sampler=None, sampler_factory=None,
                 need_target: bool = False,
                 write_config: bool = True, dist: DistContext | None = None,
                 reward_functions: dict | None = None, tool_functions: dict | None = None) -> Session:
    run_dir = make_folder(cfg.logging.run_dir, "logging.run_dir")
    seed_everything(cfg.seed)
    train_rows = load_rows(cfg.data, "train", need_target=need_target)
    has_eval = bool(cfg.data.eval) or cfg.data.train.startswith("builtin:")
    eval_rows = load_rows(cfg.data, "eval") if has_eval else []
    if tokenizer is None:
        alphabet = ""
        if cfg.model.tokenizer == "char":  # the alphabet of the task, or of the user's own rows
            rows = [r for _, r in train_rows] + [r for _, r in eval_rows]
            alphabet = (task_alphabet(cfg.data.train.removeprefix("builtin:"), rows)
                        if cfg.data.train.startswith("builtin:") else rows_alphabet(rows))
        if cfg.rollout.multi_turn and alphabet:
            # episodes need a chat template: the compact one, with the tool calls' fixed pieces as tokens
            tools = ([t.schema() for t in load_tools(cfg.rollout.tools, check=False, functions=tool_functions)]
                     if cfg.rollout.tools else None)  # schemas only: no code runs
            tokenizer = char_chat_tokenizer(alphabet, tools)
        else:
            tokenizer = build_tokenizer(cfg.model, alphabet)
    sharded = False
    if model is None:
        device = pick_device(cfg.model.device) if dist is None else dist.device
        if dist is not None and cfg.model.lora is None:
            # on the meta device, each rank reading (a folder) or drawing (model.init keyed) its rows only
            model = build_sharded(cfg.model, tokenizer, dist, seed=cfg.seed)
            sharded = True
        else:
            model = build_model(cfg.model, tokenizer, device, seed=cfg.seed)
    else:
        device = model.lm_head_weight.device
    apply_lora(model, cfg.model, seed=cfg.seed)
    vision = None
    if model.config.vision is not None:
        # frozen by default (after LoRA, which freezes every base parameter); model.train_vision trains it
        model.set_vision_trainable(cfg.model.train_vision)
        vision = vision_data(cfg.model, model.config.vision, tokenizer)
    elif cfg.model.train_vision or cfg.model.processor:
        raise ValueError(f"model.{'train_vision' if cfg.model.train_vision else 'processor'}: "
                         f"{model.config.architecture} has no vision tower")
    model.kernels = None  # the run's settings, not those of whoever built the model
    kernel_settings(cfg, model)
    context_len = cfg.engine.max_model_len or model.config.max_position_embeddings
    check_prompt_len(cfg.data, context_len)
    if dist is not None and not sharded and not has_lora(model):
        model = shard_model(model, dist)  # with LoRA the model stays whole on every rank (replicated)
    if is_sharded(model):
        configure_fsdp(model, cfg.distributed, parse_dtype(cfg.model.dtype), fuse=fuse_projections_on(cfg, device))
    if write_config and (dist is None or dist.is_main):
        # last: a start that fails on its data, model or settings leaves the run's config.yaml as it was
        save_config(cfg, run_dir / "config.yaml")
    return Session(cfg, run_dir, device, tokenizer, model, train_rows, eval_rows, context_len, sampler, sampler_factory,
                   dist=dist, vision=vision,
                   reward_functions=dict(reward_functions or {}), tool_functions=dict(tool_functions or {}))
