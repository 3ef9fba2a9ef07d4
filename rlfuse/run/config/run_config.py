"""Typed run configuration: one frozen dataclass per concern, a YAML recipe, typed overrides.

    RunConfig
      model       ModelSpec       which weights (HF folder or a random tiny model), dtype, device
      engine      EngineConfig    the rollout engine (rlfuse.engine.config)
      optim       OptimConfig     AdamW, warmup + cosine schedule, grad clipping
      sft         SFTConfig       supervised fine-tuning
      grpo        GRPOConfig      GRPO / DAPO / Dr. GRPO / GSPO / RLOO / REINFORCE++ / CISPO
      ppo         PPOConfig       PPO with a critic
      dpo         DPOConfig       DPO (sigmoid / IPO / conservative) on preference pairs
      data        DataConfig      train / eval sources, templates, prompt-length filter
      rollout     RolloutConfig   multi-turn episodes: tools or an environment, turn and token limits
      rewards     list[RewardSpec] + on_reward_error
      logging     LoggingConfig   run folder, metrics, TensorBoard, samples
      checkpoint  CheckpointConfig
      distributed DistributedConfig FSDP2 settings of data-parallel runs (reshard, prefetch, gradient sync)

`load_config(path_or_dict, overrides=["grpo.clip_high=0.28", ...])` reads YAML, applies
`a.b=value` overrides and rejects unknown keys with the list of valid ones (the generic
machinery is `rlfuse.run.config.io`). `save_config` writes what the run folder's
`config.yaml` holds; loading it back gives an equal config. Every key, with its type,
default and meaning: docs/configuration.md (generated: python -m rlfuse.run.config.docs).
Test: python -m pytest -q tests/test_config.py
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import yaml

from rlfuse.engine.config import EngineConfig
from rlfuse.kernels.backend import BACKENDS
from rlfuse.kernels.loss.policy import KL_TYPES, LOSS_TYPES
from rlfuse.run.config import io as config_io
from rlfuse.run.config.algorithms import (
    ADV_SCALES,
    DPO_LOSSES,
    ESTIMATORS,
    DPOConfig,
    GRPOConfig,
    PPOConfig,
    SFTConfig,
    _check_ppo,
    check_stream,
)
from rlfuse.run.config.sections import (
    _DC,
    FSDP_TRADES,
    GRAD_SYNC,
    OBS_TRUNCATION,
    ON_REWARD_ERROR,
    PROFILE_PHASES,
    TOOL_CALL_FORMATS,
    WANDB_MODES,
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    LoggingConfig,
    ModelSpec,
    OptimConfig,
    RewardSpec,
    RolloutConfig,
    _check_choice,
)
from rlfuse.run.optim import SCHEDULES


@dataclasses.dataclass(**_DC)
class RunConfig:
    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    """The policy: weights, tokenizer, dtype, device."""
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    """The inference engine that generates rollouts and evaluations on the trained weights."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule (shared by SFT and GRPO)."""
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    """Supervised fine-tuning (`rlfuse sft`)."""
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    """GRPO and its variants DAPO, Dr. GRPO, GSPO, RLOO, REINFORCE++, CISPO (`rlfuse grpo`)."""
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
    """PPO with a critic: GAE, clipped value loss, KL-shaped reward (`rlfuse ppo`)."""
    dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)
    """Direct preference optimization (`rlfuse dpo`)."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Training and held-out data, prompt formatting."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Multi-turn episodes with tools or an environment (GRPO); single-turn when neither is set."""
    rewards: list[RewardSpec] = dataclasses.field(default_factory=list)
    """Reward functions (a list of {name, weight, kwargs}); their weighted sum is the reward."""
    on_reward_error: str = "raise"
    """raise (stop with the failing example) | zero (score it 0, count and log)."""
    reward_timeout_s: float = 120.0
    """Seconds one call of a user reward function (module:function, file.py:function) may take
    on one batch; a longer call is stopped and is a reward error (follows on_reward_error).
    User functions then run in a worker process: one per function, started when the run
    starts (1-3 s; importing the function's module there must also finish within this
    time), plus pickling each batch's texts both ways (ms). 0: run them in the trainer's
    process, with no timeout (a hung function hangs the run)."""
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """Run folder and metrics."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpoint cadence, rotation and resume."""
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    """FSDP2 settings of data-parallel (torchrun) runs; ignored in one process."""
    seed: int = 0
    """Seeds model init, data order and torch's RNG."""

    def __post_init__(self):
        check_ranges(self)
        _check_choice("sft.overlong", self.sft.overlong, ("truncate", "drop"))
        _check_choice("on_reward_error", self.on_reward_error, ON_REWARD_ERROR)
        _check_choice("grpo.loss_type", self.grpo.loss_type, LOSS_TYPES)
        _check_choice("grpo.kl_type", self.grpo.kl_type, KL_TYPES)
        _check_choice("grpo.adv_scale", self.grpo.adv_scale, ADV_SCALES)
        _check_choice("grpo.advantage", self.grpo.advantage, ESTIMATORS)
        _check_choice("optim.schedule", self.optim.schedule, SCHEDULES)
        _check_choice("model.dtype", self.model.dtype, ("float32", "bfloat16", "float16"))
        _check_choice("model.kernel_backend", self.model.kernel_backend, BACKENDS)
        g = self.grpo
        if g.temperature == 0:
            raise ValueError("grpo.temperature must be > 0, got 0: greedy rollouts make every completion of a group "
                             "the same, so every advantage is 0 and nothing is learned (held-out evaluation is "
                             "greedy already); use e.g. 1.0")
        if g.group_size < 2:
            raise ValueError(f"grpo.group_size must be >= 2 for group-relative advantages, got {g.group_size}")
        if g.dual_clip is not None and g.dual_clip <= 1:
            raise ValueError(f"grpo.dual_clip must be > 1 (or null), got {g.dual_clip}")
        if g.dual_clip is not None and g.loss_type == "cispo":
            raise ValueError("grpo.dual_clip does not apply to grpo.loss_type cispo (its clipped weight is detached)")
        if g.cispo_clip_low and g.loss_type != "cispo":
            raise ValueError(f"grpo.cispo_clip_low applies to grpo.loss_type cispo only (loss_type is {g.loss_type!r})")
        if g.kl_ratio and g.loss_type == "gspo":
            raise ValueError("grpo.kl_ratio weights each token's KL by that token's ratio; grpo.loss_type gspo has "
                             "one ratio per sequence (turn kl_ratio off with gspo)")
        _check_choice("grpo.old_logprobs", g.old_logprobs, ("rollout", "recompute"))
        if g.tis_cap is not None and not g.tis_cap > 0:
            raise ValueError(f"grpo.tis_cap must be > 0 (or null), got {g.tis_cap}")
        for name in ("mis_bounds", "icepop_bounds"):
            b = getattr(g, name)
            if b is not None and not (len(b) == 2 and 0 <= b[0] < 1 < b[1]):
                raise ValueError(f"grpo.{name} must be [low, high] with 0 <= low < 1 < high (or null), got {b}")
        if g.prompts_per_step % g.mini_batches:
            raise ValueError(f"grpo.prompts_per_step ({g.prompts_per_step}) must be a multiple of "
                             f"grpo.mini_batches ({g.mini_batches})")
        check_stream(g, multi_turn=self.rollout.multi_turn)
        _check_choice("logging.wandb.mode", self.logging.wandb.mode, WANDB_MODES)
        _check_choice("logging.profile_phase", self.logging.profile_phase, PROFILE_PHASES)
        if self.distributed.grad_sync is not None:
            _check_choice("distributed.grad_sync", self.distributed.grad_sync, GRAD_SYNC)
        _check_choice("distributed.trade", self.distributed.trade, FSDP_TRADES)
        bad = {k: v for k, v in self.data.columns.items() if not (isinstance(k, str) and isinstance(v, str) and v)}
        if bad:
            raise ValueError(f"data.columns must map dataset column names to rlfuse column names (strings), "
                             f"got {bad}")
        d = self.dpo
        _check_choice("dpo.loss", d.loss, DPO_LOSSES)
        _check_choice("dpo.reference", d.reference, ("precompute", "live"))
        if d.loss == "conservative" and not 0 < d.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing must be in (0, 0.5) for dpo.loss conservative, "
                             f"got {d.label_smoothing}")
        if d.loss != "conservative" and d.label_smoothing != 0:
            raise ValueError(f"dpo.label_smoothing applies to dpo.loss conservative only (loss is {d.loss!r})")
        _check_ppo(self.ppo)
        r = self.rollout
        _check_choice("rollout.obs_truncation", r.obs_truncation, OBS_TRUNCATION)
        _check_choice("rollout.tool_call_format", r.tool_call_format, TOOL_CALL_FORMATS)
        _check_choice("rollout.failed_episode", r.failed_episode, ("zero", "drop"))
        if not (isinstance(r.sandbox, str) and (r.sandbox in ("bwrap", "none") or
                                                r.sandbox.startswith(("http://", "https://")))):
            raise ValueError(f"rollout.sandbox must be bwrap, none or a SandboxFusion URL (http://HOST:PORT), "
                             f"got {r.sandbox!r}")
        if r.tools and r.env:
            raise ValueError("rollout: give either rollout.tools or rollout.env, not both (an environment runs "
                             "its own tools)")
        if r.agent and (r.tools or r.env):
            raise ValueError("rollout.agent runs your own agent and its own tools: give it without rollout.tools "
                             "and rollout.env")


RANGES: dict[str, str] = {
    "seed": ">= 0", "model.router_aux_loss_coef": ">= 0", "model.router_z_loss_coef": ">= 0",
    "optim.lr": "(0, 1]", "optim.betas[0]": "[0, 1)", "optim.betas[1]": "[0, 1)", "optim.eps": "> 0",
    "optim.weight_decay": ">= 0", "optim.warmup_steps": ">= 0", "optim.min_lr_ratio": "[0, 1]",
    "optim.max_grad_norm": ">= 0", "optim.max_nonfinite_steps": ">= 0",
    "sft.steps": "> 0", "sft.batch_size": "> 0", "sft.micro_batch_tokens": "> 0", "sft.max_seq_len": "> 0",
    "sft.eval_every": ">= 0",
    "grpo.steps": "> 0", "grpo.prompts_per_step": "> 0", "grpo.max_new_tokens": "> 0",
    "grpo.temperature": ">= 0", "grpo.top_p": "(0, 1]", "grpo.top_k": ">= 0", "grpo.clip_low": "[0, 1)",
    "grpo.clip_high": ">= 0", "grpo.kl_coef": ">= 0", "grpo.adv_eps": "> 0", "grpo.mu": "> 0",
    "grpo.mini_batches": "> 0", "grpo.micro_batch_tokens": "> 0", "grpo.share_prefix_min_tokens": ">= 1",
    "grpo.sample_every": ">= 0", "grpo.eval_every": ">= 0", "grpo.seed": ">= 0", "grpo.check_every": ">= 0",
    "data.eval_size": "> 0", "data.train_size": "> 0", "data.max_prompt_len": "> 0", "data.seed": ">= 0",
    "rewards[].weight": "any", "reward_timeout_s": ">= 0",
    "logging.log_every": ">= 1", "logging.num_samples": ">= 0", "logging.profile_step": ">= 0",
    "distributed.prefetch": ">= 0",
    "checkpoint.every": ">= 0", "checkpoint.keep_last": ">= 0",
    "ppo.steps": "> 0", "ppo.prompts_per_step": "> 0", "ppo.samples_per_prompt": "> 0",
    "ppo.max_new_tokens": "> 0", "ppo.temperature": ">= 0", "ppo.top_p": "(0, 1]", "ppo.top_k": ">= 0",
    "ppo.clip_low": "[0, 1)", "ppo.clip_high": ">= 0", "ppo.mu": "> 0", "ppo.mini_batches": "> 0",
    "ppo.micro_batch_tokens": "> 0", "ppo.gamma": "[0, 1]", "ppo.lam": "[0, 1]", "ppo.critic_lr": "(0, 1]",
    "ppo.kl_coef": ">= 0", "ppo.kl_horizon": "> 0", "ppo.entropy_coef": ">= 0", "ppo.sample_every": ">= 0",
    "ppo.eval_every": ">= 0", "ppo.seed": ">= 0",
    "dpo.steps": "> 0", "dpo.batch_size": "> 0", "dpo.micro_batch_tokens": "> 0", "dpo.max_seq_len": "> 0",
    "rollout.max_turns": "> 0", "rollout.max_turn_tokens": "> 0", "rollout.max_total_tokens": "> 0",
    "rollout.max_obs_tokens": "> 0", "rollout.tool_timeout_s": "> 0", "rollout.env_timeout_s": "> 0",
    "rollout.env_workers": ">= 0", "rollout.agent_timeout_s": "> 0",
    "dpo.beta": "> 0", "dpo.label_smoothing": "[0, 0.5)", "dpo.eval_every": ">= 0",
    "model.lora.rank": "> 0", "model.lora.alpha": "> 0", "model.lora.dropout": "[0, 1)",
}
"""The valid range of every numeric field of RunConfig, checked at load (`check_ranges`):
"> 0", ">= 0", ">= 1", an interval "[0, 1)" / "(0, 1]" / "[0, 1]", or "any" (finite). A
new numeric field gets its entry here (tests/test_config.py checks that every one has one)."""


def _in_range(v: float, rng: str) -> bool:
    if rng == "any":
        return True
    if rng.startswith(">"):
        op, lo = rng.split()
        return v > float(lo) if op == ">" else v >= float(lo)
    lo, hi = (float(x) for x in rng[1:-1].split(","))
    return (lo <= v if rng[0] == "[" else lo < v) and (v <= hi if rng[-1] == "]" else v < hi)


def _range_values(cfg, key: str):
    """(dotted name, value) pairs of `key` in `cfg` ("rewards[].weight" -> one per reward)."""
    head, _, rest = key.partition(".")
    idx = None
    if head.endswith("]"):
        head, idx = head[:-1].split("[")
    v = getattr(cfg, head)
    if v is None and rest:  # an optional section left out (model.lora: null)
        return []
    if idx == "":
        return [(f"{head}[{i}].{n}", x) for i, item in enumerate(v) for n, x in _range_values(item, rest)]
    if idx is not None:
        v, head = v[int(idx)], f"{head}[{idx}]"
    if not rest:
        return [(head, v)]
    return [(f"{head}.{n}", x) for n, x in _range_values(v, rest)]


def check_ranges(cfg: "RunConfig") -> None:
    """ValueError naming the first numeric field outside its range in RANGES, with the range."""
    for key, rng in RANGES.items():
        for name, v in _range_values(cfg, key):
            if v is None:
                continue
            if not math.isfinite(v) or not _in_range(v, rng):
                what = "an integer" if isinstance(v, int) else "a finite number"
                want = what if rng == "any" else f"{what} {rng}" if rng.startswith(">") else f"in {rng}"
                raise ValueError(f"{name} must be {want}, got {v!r}")


def load_config(src: str | Path | dict | None = None, overrides: list[str] = (), *,
                relative_to: str | Path | None = None) -> RunConfig:
    """A RunConfig from a YAML file (or dict) plus `a.b=value` overrides. With
    `relative_to` (the recipe's folder), the relative input paths the file names (see
    `resolve_input_paths`) resolve against it; overrides stay relative to the working directory."""
    prepare = None if relative_to is None else (lambda data: resolve_input_paths(data, Path(relative_to)))
    return config_io.load(RunConfig, src, overrides, prepare)


def resolve_input_paths(data: dict, base: Path) -> None:
    """Make the relative input paths of recipe data `data` (plain YAML data, changed in
    place) relative to `base`: model.path, model.tokenizer, data.train, data.eval (not hf:),
    the file of a `file.py:function` reward or data.map and a checkpoint.resume folder. Outputs
    (logging.run_dir) stay relative to the working directory, where the run is started."""
    def fix(section: dict | None, key: str, skip=lambda v: False) -> None:
        if not isinstance(section, dict):
            return
        v = section.get(key)
        if isinstance(v, str) and v and not skip(v):
            p = Path(v).expanduser()
            section[key] = str(p if p.is_absolute() else base / p)
    fix(data.get("model"), "path")
    fix(data.get("model"), "tokenizer", lambda v: v == "char")
    for key in ("train", "eval"):
        fix(data.get("data"), key, lambda v: v.startswith(("builtin:", "hf:")))
    fix(data.get("checkpoint"), "resume", lambda v: v in ("never", "auto"))
    ro = data.get("rollout")
    if isinstance(ro, dict):
        fix(ro, "chat_template")
        if isinstance(ro.get("tools"), list):
            ro["tools"] = [_relative_spec(t, base) for t in ro["tools"]]
        if isinstance(ro.get("env"), str):
            ro["env"] = _relative_spec(ro["env"], base)
    for section, key in [*((spec, "name") for spec in data.get("rewards") or []), (data.get("data"), "map")]:
        if isinstance(section, dict) and key in section:
            section[key] = _relative_spec(section.get(key), base)


def _relative_spec(spec, base: Path):
    """`FILE.py:NAME` with a relative FILE -> FILE under `base`; anything else unchanged."""
    if not isinstance(spec, str) or ".py:" not in spec:
        return spec
    file, _, name = spec.rpartition(":")
    p = Path(file).expanduser()
    return f"{p if p.is_absolute() else base / p}:{name}"


def resolved_inputs(data: dict) -> dict:
    """A copy of config data with its relative input paths resolved against the working
    directory, where the run that holds them reads them."""
    data = copy.deepcopy(data)
    resolve_input_paths(data, Path.cwd())
    return data


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    """`cfg` as YAML with its input paths absolute (`resolved_inputs`): a run's config.yaml
    names the same files from any folder (`rlfuse eval RUN/config.yaml` resolves relative
    paths against RUN, which once found RUN/vowels_train.jsonl instead of ./vowels_train.jsonl)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(resolved_inputs(config_io.to_dict(cfg)), sort_keys=False))
    return path
