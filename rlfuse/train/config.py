"""Typed run configuration: one frozen dataclass per concern, a YAML recipe, typed overrides.

    RunConfig
      model       ModelSpec       which weights (HF folder or a random tiny model), dtype, device
      engine      dict            keyword arguments of `rlfuse.engine.EngineConfig` (checked there)
      optim       OptimConfig     AdamW, warmup + cosine schedule, grad clipping
      sft         SFTConfig       supervised fine-tuning
      grpo        GRPOConfig      GRPO / DAPO / Dr. GRPO / GSPO
      data        DataConfig      train / eval sources, templates, prompt-length filter
      rewards     list[RewardSpec] + on_reward_error
      logging     LoggingConfig   run folder, metrics, TensorBoard, samples
      checkpoint  CheckpointConfig

`load_config(path_or_dict, overrides=["grpo.clip_high=0.28", ...])` reads YAML, applies
`a.b=value` overrides (values parsed as YAML scalars, then checked against the field's
type) and rejects unknown keys with the list of valid ones. `to_dict(cfg)` is what the
run folder's `config.yaml` holds; loading it back gives an equal config.
Test: python -m pytest -q tests/test_config.py
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from rlfuse.kernels.backend import BACKENDS
from rlfuse.kernels.policy_loss import KL_TYPES, LOSS_TYPES
from rlfuse.train.advantages import ADV_SCALES
from rlfuse.train.optim import SCHEDULES

_DC = dict(frozen=True, kw_only=True, slots=True)


@dataclasses.dataclass(**_DC)
class ModelSpec:
    path: str = ""
    """HF checkpoint folder (config.json, safetensors, tokenizer.json); empty with `random_init`."""
    random_init: dict | None = None
    """ModelConfig fields of a freshly initialized model (vocab_size is taken from the tokenizer)."""
    tokenizer: str = ""
    """Tokenizer folder; empty = the model folder. `char` builds a character-level tokenizer
    over the data's alphabet (the built-in tasks only)."""
    dtype: str = "float32"
    """Parameter dtype: float32 or bfloat16 (the optimizer keeps fp32 master weights either way)."""
    device: str = "auto"
    """auto (cuda if available), cpu or cuda[:i]."""
    gradient_checkpointing: bool = False
    kernel_backend: str = "auto"
    """rlfuse.kernels backend: auto, torch or triton."""


@dataclasses.dataclass(**_DC)
class OptimConfig:
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0
    """Linear warmup from 0 over this many optimizer steps."""
    schedule: str = "cosine"
    """cosine | constant | linear (decay after warmup, to min_lr_ratio * lr at the last step)."""
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping; the norm is logged either way)."""


@dataclasses.dataclass(**_DC)
class SFTConfig:
    steps: int = 100
    """Optimizer steps."""
    batch_size: int = 32
    """Examples per optimizer step (gradients accumulated over the micro-batches)."""
    micro_batch_tokens: int = 4096
    """Token budget of one packed micro-batch (prompt + completion tokens)."""
    max_seq_len: int = 1024
    """Longer examples are truncated (completion side) to this many tokens."""
    eval_every: int = 0
    """Evaluate on the eval set every this many steps (0 = only at the end)."""


@dataclasses.dataclass(**_DC)
class GRPOConfig:
    steps: int = 100
    """Rollout steps (each: generate, score, mu policy updates)."""
    prompts_per_step: int = 16
    group_size: int = 8
    """G completions per prompt."""
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    loss_type: str = "grpo"
    """grpo (mean over sequences of token means) | dr_grpo (sum / (seqs * max_new_tokens)) |
    dapo (token-level mean) | gspo (sequence-level ratio; its paper clips at ~3e-4 / 4e-4)."""
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (None = off)."""
    kl_coef: float = 0.0
    """beta; > 0 keeps a frozen reference copy of the initial weights."""
    kl_type: str = "k3"
    """k1 | k2 | k3 estimator of KL(policy || reference)."""
    adv_scale: str = "group"
    """Divide centred rewards by the group std (group), the batch std (batch) or nothing (none)."""
    adv_eps: float = 1e-6
    mu: int = 1
    """Policy-gradient iterations per rollout batch (old log-probs = the engine's)."""
    mini_batches: int = 1
    """Optimizer steps per pass over the rollout batch (groups split evenly)."""
    micro_batch_tokens: int = 8192
    """Token budget of one packed training micro-batch."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (zero advantage, DAPO); the batch is not
    refilled by extra sampling, so a step may train on fewer groups (logged: groups/kept)."""
    mask_truncated: bool = False
    """Give completions cut at max_new_tokens zero loss weight (DAPO overlong filtering)."""
    log_entropy: bool = True
    sample_every: int = 10
    """Write sample completions every this many steps (0 = never)."""
    eval_every: int = 0
    """Evaluate on the eval set every this many steps (0 = at the start and the end only)."""
    seed: int = 0
    """Base seed for rollout sampling (step s uses seed + s)."""


@dataclasses.dataclass(**_DC)
class DataConfig:
    train: str = ""
    """A .jsonl / .json / .parquet file, or builtin:arithmetic / builtin:countdown."""
    eval: str = ""
    """Held-out set (same forms). For builtin tasks: a disjoint split of eval_size problems."""
    eval_size: int = 200
    train_size: int = 20000
    """Problems generated for builtin tasks."""
    task: dict = dataclasses.field(default_factory=dict)
    """Keyword arguments of the builtin task generator (e.g. {digits: 2, ops: "+-"})."""
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    completion_field: str = "completion"
    """SFT target text for prompt/completion rows."""
    messages_field: str = "messages"
    prompt_template: str = "{prompt}"
    """str.format template over the row's columns, applied to prompt rows."""
    system_prompt: str = ""
    use_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (messages rows always are)."""
    max_prompt_len: int = 512
    """Prompts with more tokens are dropped (counted and logged)."""
    shuffle: bool = True
    seed: int = 0


@dataclasses.dataclass(**_DC)
class RewardSpec:
    name: str
    """A builtin (see rlfuse.train.rewards.BUILTINS) or `module:function` / `path.py:function`."""
    weight: float = 1.0
    kwargs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(**_DC)
class LoggingConfig:
    run_dir: str = "runs/latest"
    log_every: int = 1
    tensorboard: bool = True
    progress: bool = True
    """tqdm progress bar with reward and step time."""
    num_samples: int = 4
    """Completions written per sample dump."""


@dataclasses.dataclass(**_DC)
class CheckpointConfig:
    every: int = 0
    """Save every this many steps (0 = only at the end)."""
    keep_last: int = 2
    resume: str = "never"
    """never | auto (latest complete checkpoint in run_dir, if any) | a checkpoint folder."""
    save_final: bool = True


@dataclasses.dataclass(**_DC)
class RunConfig:
    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    engine: dict = dataclasses.field(default_factory=dict)
    """Keyword arguments of rlfuse.engine.EngineConfig."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rewards: list[RewardSpec] = dataclasses.field(default_factory=list)
    on_reward_error: str = "raise"
    """raise (stop with the failing example) | zero (score it 0, count and log)."""
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    seed: int = 0
    """Seeds model init, data order and torch's RNG."""

    def __post_init__(self):
        _check_choice("on_reward_error", self.on_reward_error, ("raise", "zero"))
        _check_choice("grpo.loss_type", self.grpo.loss_type, LOSS_TYPES)
        _check_choice("grpo.kl_type", self.grpo.kl_type, KL_TYPES)
        _check_choice("grpo.adv_scale", self.grpo.adv_scale, ADV_SCALES)
        _check_choice("optim.schedule", self.optim.schedule, SCHEDULES)
        _check_choice("model.dtype", self.model.dtype, ("float32", "bfloat16", "float16"))
        _check_choice("model.kernel_backend", self.model.kernel_backend, BACKENDS)
        g = self.grpo
        if g.group_size < 2:
            raise ValueError(f"grpo.group_size must be >= 2 for group-relative advantages, got {g.group_size}")
        if g.dual_clip is not None and g.dual_clip <= 1:
            raise ValueError(f"grpo.dual_clip must be > 1 (or null), got {g.dual_clip}")
        for name, v in (("grpo.mu", g.mu), ("grpo.mini_batches", g.mini_batches),
                        ("grpo.prompts_per_step", g.prompts_per_step), ("grpo.max_new_tokens", g.max_new_tokens)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if g.prompts_per_step % g.mini_batches:
            raise ValueError(f"grpo.prompts_per_step ({g.prompts_per_step}) must be a multiple of "
                             f"grpo.mini_batches ({g.mini_batches})")


def _check_choice(field: str, value, choices):
    if value not in choices:
        raise ValueError(f"{field} must be one of {list(choices)}, got {value!r}")


# ------------------------------------------------------------------ dict <-> dataclass
@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def to_dict(cfg) -> Any:
    """Plain YAML-able data (tuples become lists)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(x) for x in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def from_dict(cls, data: Any, where: str = ""):
    """Build dataclass `cls` from nested dicts, checking keys and types; ValueError names
    the dotted field (`grpo.clip_high`) and what was expected."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {type(data).__name__} {data!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ValueError(f"{where + '.' if where else ''}{unknown[0]}: unknown key; valid keys"
                         f"{' of ' + where if where else ''}: {', '.join(names)}")
    hints = _hints(cls)
    kw = {k: _coerce(hints[k], v, f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        return cls(**kw)
    except TypeError as e:  # a required field is missing
        raise ValueError(f"{where or 'config'}: {e}") from None


def _coerce(tp, v, where: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, v, where)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{where}: got {v!r}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, v, where)
    if origin is list:
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {v!r}")
        return [_coerce(args[0], x, f"{where}[{i}]") for i, x in enumerate(v)]
    if origin is tuple:
        if not isinstance(v, (list, tuple)) or len(v) != len(args):
            raise ValueError(f"{where}: expected a list of {len(args)} values, got {v!r}")
        return tuple(_coerce(a, x, f"{where}[{i}]") for i, (a, x) in enumerate(zip(args, v)))
    if tp is dict or origin is dict:
        if not isinstance(v, dict):
            raise ValueError(f"{where}: expected a mapping, got {v!r}")
        return dict(v)
    if tp is bool:
        if not isinstance(v, bool):
            raise ValueError(f"{where}: expected true or false, got {v!r}")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{where}: expected an integer, got {v!r}")
        return v
    if tp is float:
        if isinstance(v, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept what Python reads as a number
            try:
                v = float(v)
            except ValueError:
                raise ValueError(f"{where}: expected a number, got {v!r}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{where}: expected a number, got {v!r}")
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            raise ValueError(f"{where}: expected a string, got {v!r}")
        return v
    return v


# ------------------------------------------------------------------ overrides and files
def apply_override(data: dict, item: str, cls=None) -> dict:
    """Set `a.b.c=value` in nested dict `data` (in place). With `cls`, unknown keys raise
    ValueError listing the valid ones. The value is parsed as a YAML scalar/flow value."""
    if "=" not in item:
        raise ValueError(f"override {item!r}: expected KEY=VALUE, e.g. grpo.clip_high=0.28")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ValueError(f"override {item!r}: value is not valid YAML ({e})") from None
    node, node_cls = data, cls
    for i, p in enumerate(parts):
        prefix = ".".join(parts[:i])
        if node_cls is not None:
            names = [f.name for f in dataclasses.fields(node_cls)]
            if p not in names:
                raise ValueError(f"override {key!r}: unknown key {p!r}"
                                 f"{' in ' + prefix if prefix else ''}; valid keys: {', '.join(names)}")
            tp = _hints(node_cls)[p]
            node_cls = tp if dataclasses.is_dataclass(tp) else None
        if i == len(parts) - 1:
            node[p] = value
        else:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ValueError(f"override {key!r}: {'.'.join(parts[:i + 1])} is not a mapping")
            node = nxt
    return data


def load_config(src: str | Path | dict | None = None, overrides: list[str] = ()) -> RunConfig:
    """A RunConfig from a YAML file (or dict) plus `a.b=value` overrides."""
    where = "config"
    if src is None:
        data = {}
    elif isinstance(src, dict):
        data = to_dict(src)
    else:
        path = Path(src)
        where = str(path)
        if not path.exists():
            raise ValueError(f"{path}: no such config file")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
    for item in overrides:
        apply_override(data, item, RunConfig)
    try:
        return from_dict(RunConfig, data)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def replace(cfg, **changes):
    """A copy of dataclass `cfg` with dotted-key changes, type-checked like a loaded file:
    replace(cfg, **{"grpo.steps": 3, "rewards": [{"name": "arithmetic"}]})."""
    data = to_dict(cfg)
    for key, value in changes.items():
        node, parts = data, key.split(".")
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                raise ValueError(f"replace: {key!r}: {p!r} is not a section")
            node = node[p]
        node[parts[-1]] = to_dict(value)
    return from_dict(type(cfg), data)


# ------------------------------------------------------------------ help text
def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field), for --help."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def describe(cls=RunConfig, prefix: str = "") -> list[str]:
    """One line per leaf key: `grpo.clip_high (float, default 0.2): doc`."""
    lines = []
    docs = field_docs(cls)
    default = cls() if all(f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
                           for f in dataclasses.fields(cls)) else None
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        key = prefix + f.name
        if dataclasses.is_dataclass(tp):
            lines += describe(tp, key + ".")
            continue
        d = getattr(default, f.name) if default is not None else "required"
        tname = getattr(tp, "__name__", str(tp).replace("typing.", ""))
        lines.append(f"{key} ({tname}, default {to_dict(d)!r})" + (f": {docs[f.name]}" if f.name in docs else ""))
    return lines
