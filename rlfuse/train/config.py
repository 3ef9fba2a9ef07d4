"""Typed run configuration: one frozen dataclass per concern, a YAML recipe, typed overrides.

    RunConfig
      model       ModelSpec       which weights (HF folder or a random tiny model), dtype, device
      engine      EngineConfig    the rollout engine (rlfuse.engine.config)
      optim       OptimConfig     AdamW, warmup + cosine schedule, grad clipping
      sft         SFTConfig       supervised fine-tuning
      grpo        GRPOConfig      GRPO / DAPO / Dr. GRPO / GSPO / RLOO / REINFORCE++ / CISPO
      dpo         DPOConfig       DPO (sigmoid / IPO / conservative) on preference pairs
      data        DataConfig      train / eval sources, templates, prompt-length filter
      rewards     list[RewardSpec] + on_reward_error
      logging     LoggingConfig   run folder, metrics, TensorBoard, samples
      checkpoint  CheckpointConfig

`load_config(path_or_dict, overrides=["grpo.clip_high=0.28", ...])` reads YAML, applies
`a.b=value` overrides and rejects unknown keys with the list of valid ones (the generic
machinery is `rlfuse.train.config_io`). `save_config` writes what the run folder's
`config.yaml` holds; loading it back gives an equal config. Every key, with its type,
default and meaning: docs/configuration.md (generated: python -m rlfuse.train.config_docs).
Test: python -m pytest -q tests/test_config.py
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rlfuse.engine.config import EngineConfig
from rlfuse.kernels.backend import BACKENDS
from rlfuse.kernels.policy_loss import KL_TYPES, LOSS_TYPES
from rlfuse.train import config_io
from rlfuse.train.advantages import ADV_SCALES, ESTIMATORS
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
    """Recompute each layer's activations in the backward pass (less memory, one more forward)."""
    kernel_backend: str = "auto"
    """rlfuse.kernels backend: auto, torch or triton."""


@dataclasses.dataclass(**_DC)
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate (after warmup)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW), applied to every parameter."""
    warmup_steps: int = 0
    """Linear warmup from 0 over this many optimizer steps."""
    schedule: str = "cosine"
    """cosine | constant | linear (decay after warmup, to min_lr_ratio * lr at the last step)."""
    min_lr_ratio: float = 0.0
    """The decay ends at min_lr_ratio * lr at the last step."""
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
    """P prompts per rollout step (each sampled group_size times)."""
    group_size: int = 8
    """G completions per prompt."""
    max_new_tokens: int = 256
    """Longest completion (rollouts, and held-out evaluation of both SFT and GRPO)."""
    temperature: float = 1.0
    """Rollout sampling temperature (0 = greedy). The policy, old and reference log-probs are
    all taken at `rlfuse.engine.config.logprob_temperature(temperature)`: this T, or 1 when greedy."""
    top_p: float = 1.0
    """Rollout nucleus sampling mass in (0, 1]; 1 disables (the log-probs stay the unfiltered policy's)."""
    top_k: int = 0
    """Rollout top-k filter; 0 disables (the log-probs stay the unfiltered policy's)."""
    loss_type: str = "grpo"
    """grpo (mean over sequences of token means) | dr_grpo (sum / (seqs * max_new_tokens)) |
    dapo (token-level mean) | gspo (sequence-level ratio; its paper clips at ~3e-4 / 4e-4) |
    cispo (clipped, detached importance weight times log-prob, token-level mean)."""
    clip_low: float = 0.2
    """PPO clip range below 1: ratios under 1 - clip_low stop pushing down."""
    clip_high: float = 0.2
    """PPO clip range above 1: ratios over 1 + clip_high stop pushing up (DAPO's clip-higher: 0.28)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (None = off)."""
    kl_coef: float = 0.0
    """beta; > 0 keeps a frozen reference copy of the initial weights."""
    kl_type: str = "k3"
    """k1 | k2 | k3 estimator of KL(policy || reference)."""
    advantage: str = "group"
    """Advantage estimator: group (group-relative, scaled per adv_scale) | rloo (leave-one-out
    baseline) | reinforce_pp (REINFORCE++: per-token return with kl_coef * k1 KL folded in,
    normalized over the batch's tokens) | reinforce_pp_baseline (the same on group-centred rewards)."""
    adv_scale: str = "group"
    """advantage group: divide centred rewards by the group std (group), the batch std (batch) or nothing (none)."""
    adv_eps: float = 1e-6
    """Added to the std before dividing (advantage group: groups with equal rewards get
    advantage 0; reinforce_pp: the batch std of the returns)."""
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
    """Log the policy's mean token entropy, over the tokens of each step's first optimizer step (no gradient)."""
    sample_every: int = 10
    """Write sample completions every this many steps (0 = never)."""
    eval_every: int = 0
    """Evaluate on the eval set every this many steps (0 = at the start and the end only)."""
    seed: int = 0
    """Base seed for rollout sampling (step s uses seed + s)."""
    old_logprobs: str = "rollout"
    """The old policy of the PPO ratio: rollout (the engine's log-probs, no extra forward) |
    recompute (a no-grad trainer forward before the update; the rollout log-probs then feed
    only the corrections below). Exact numerics never recomputes: the two are equal bitwise."""
    tis_cap: float | None = None
    """Truncated importance sampling (fast numerics): each token's advantage is weighted by
    min(pi_old / pi_rollout, tis_cap), pi_old from the trainer. None = off. Implies recompute."""
    mis_bounds: tuple[float, float] | None = None
    """Sequence masking (fast numerics): a completion whose geometric-mean ratio
    exp(mean_t log(pi_old / pi_rollout)) lies outside [low, high] gets no loss. Implies recompute."""
    icepop_bounds: tuple[float, float] | None = None
    """Token masking (fast numerics, IcePop): tokens whose ratio pi_old / pi_rollout lies
    outside [low, high] get no loss. Implies recompute."""
    check_every: int = 0
    """Exact numerics: every this many steps, recompute the trainer's log-probs of the whole
    rollout batch (no grad) and log their mismatch against the engine's (must be 0; a
    nonzero value is logged as an error). 0 = only the free check on the first mini-batch."""


DPO_LOSSES = ("sigmoid", "ipo", "conservative")
"""Values of `dpo.loss` (rlfuse.train.dpo)."""


@dataclasses.dataclass(**_DC)
class DPOConfig:
    steps: int = 100
    """Optimizer steps."""
    batch_size: int = 32
    """Preference pairs per optimizer step (gradients accumulated over the micro-batches)."""
    micro_batch_tokens: int = 4096
    """Token budget of one packed micro-batch; a pair's two sequences always share one."""
    max_seq_len: int = 1024
    """Longer prompt + response sequences are truncated (response side) to this many tokens."""
    loss: str = "sigmoid"
    """sigmoid (DPO) | ipo (squared distance of the margin to 1 / (2 beta)) | conservative
    (DPO with label smoothing: chosen/rejected flipped with probability label_smoothing)."""
    beta: float = 0.1
    """beta: the strength of the implicit KL constraint to the reference (> 0)."""
    label_smoothing: float = 0.0
    """loss conservative: the assumed probability that a label is flipped, in (0, 0.5)."""
    reference: str = "precompute"
    """precompute (the reference log-probs of every training pair, computed once before the
    first step and cached; no reference weights kept) | live (a frozen reference model kept
    in memory, evaluated on each micro-batch)."""
    ref_path: str = ""
    """HF folder of the reference model; empty = the policy's weights at the start of the run."""
    chosen_field: str = "chosen"
    """Column of the preferred response (text, an assistant message, or a list of messages)."""
    rejected_field: str = "rejected"
    """Column of the dispreferred response (same forms)."""
    eval_every: int = 0
    """Evaluate on the eval set every this many steps (0 = at the start and the end only)."""


@dataclasses.dataclass(**_DC)
class DataConfig:
    train: str = ""
    """A .jsonl / .json / .parquet file, or builtin:arithmetic / builtin:arithmetic_pref / builtin:countdown."""
    eval: str = ""
    """Held-out set (same forms). For builtin tasks: a disjoint split of eval_size problems."""
    eval_size: int = 200
    """Held-out problems generated for builtin tasks."""
    train_size: int = 20000
    """Problems generated for builtin tasks."""
    task: dict = dataclasses.field(default_factory=dict)
    """Keyword arguments of the builtin task generator (e.g. {digits: 2, ops: "+-"})."""
    prompt_field: str = "prompt"
    """Column holding the prompt text of prompt rows."""
    answer_field: str = "answer"
    """Column holding the reference answer (handed to rewards; the SFT target when there is no completion)."""
    completion_field: str = "completion"
    """SFT target text for prompt/completion rows."""
    messages_field: str = "messages"
    """Column holding a chat ([{role, content}, ...]); rows with it are chat rows."""
    prompt_template: str = "{prompt}"
    """str.format template over the row's columns, applied to prompt rows."""
    system_prompt: str = ""
    """Prepended as a system message (chat template) or as text before the prompt."""
    use_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (messages rows always are)."""
    max_prompt_len: int = 512
    """Prompts with more tokens are dropped (counted and logged)."""
    shuffle: bool = True
    """Visit the training rows in a seeded random order, a new one each epoch."""
    seed: int = 0
    """Seeds the data order and the builtin tasks' problem generation."""


@dataclasses.dataclass(**_DC)
class RewardSpec:
    name: str
    """A builtin (see rlfuse.train.rewards.BUILTINS) or `module:function` / `path.py:function`."""
    weight: float = 1.0
    """The total reward is the weighted sum of the functions' rewards."""
    kwargs: dict = dataclasses.field(default_factory=dict)
    """Keyword arguments bound to the function."""


@dataclasses.dataclass(**_DC)
class LoggingConfig:
    run_dir: str = "runs/latest"
    """Run folder: config.yaml, metrics.jsonl, samples.jsonl, tb/, checkpoints/, final/."""
    log_every: int = 1
    """Write metrics every this many steps (and at the last)."""
    tensorboard: bool = True
    """Also write the metrics as TensorBoard events under RUN_DIR/tb."""
    progress: bool = True
    """tqdm progress bar with reward and step time."""
    num_samples: int = 4
    """Completions written per sample dump."""


@dataclasses.dataclass(**_DC)
class CheckpointConfig:
    every: int = 0
    """Save every this many steps (0 = only at the end)."""
    keep_last: int = 2
    """Keep only the newest this many checkpoints."""
    resume: str = "never"
    """never | auto (latest complete checkpoint in run_dir, if any) | a checkpoint folder."""
    save_final: bool = True
    """Also write a resumable checkpoint (weights, optimizer, data position) at the end;
    RUN_DIR/final (the weights, an HF folder) is written either way."""


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
    dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)
    """Direct preference optimization (`rlfuse dpo`)."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Training and held-out data, prompt formatting."""
    rewards: list[RewardSpec] = dataclasses.field(default_factory=list)
    """Reward functions (a list of {name, weight, kwargs}); their weighted sum is the reward."""
    on_reward_error: str = "raise"
    """raise (stop with the failing example) | zero (score it 0, count and log)."""
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """Run folder and metrics."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpoint cadence, rotation and resume."""
    seed: int = 0
    """Seeds model init, data order and torch's RNG."""

    def __post_init__(self):
        _check_choice("on_reward_error", self.on_reward_error, ("raise", "zero"))
        _check_choice("grpo.loss_type", self.grpo.loss_type, LOSS_TYPES)
        _check_choice("grpo.kl_type", self.grpo.kl_type, KL_TYPES)
        _check_choice("grpo.adv_scale", self.grpo.adv_scale, ADV_SCALES)
        _check_choice("grpo.advantage", self.grpo.advantage, ESTIMATORS)
        _check_choice("optim.schedule", self.optim.schedule, SCHEDULES)
        _check_choice("model.dtype", self.model.dtype, ("float32", "bfloat16", "float16"))
        _check_choice("model.kernel_backend", self.model.kernel_backend, BACKENDS)
        g = self.grpo
        if g.group_size < 2:
            raise ValueError(f"grpo.group_size must be >= 2 for group-relative advantages, got {g.group_size}")
        if g.dual_clip is not None and g.dual_clip <= 1:
            raise ValueError(f"grpo.dual_clip must be > 1 (or null), got {g.dual_clip}")
        if g.dual_clip is not None and g.loss_type == "cispo":
            raise ValueError("grpo.dual_clip does not apply to grpo.loss_type cispo (its clipped weight is detached)")
        _check_choice("grpo.old_logprobs", g.old_logprobs, ("rollout", "recompute"))
        if g.tis_cap is not None and not g.tis_cap > 0:
            raise ValueError(f"grpo.tis_cap must be > 0 (or null), got {g.tis_cap}")
        for name in ("mis_bounds", "icepop_bounds"):
            b = getattr(g, name)
            if b is not None and not (len(b) == 2 and 0 <= b[0] < 1 < b[1]):
                raise ValueError(f"grpo.{name} must be [low, high] with 0 <= low < 1 < high (or null), got {b}")
        if g.check_every < 0:
            raise ValueError(f"grpo.check_every must be >= 0, got {g.check_every}")
        for name, v in (("grpo.mu", g.mu), ("grpo.mini_batches", g.mini_batches),
                        ("grpo.prompts_per_step", g.prompts_per_step), ("grpo.max_new_tokens", g.max_new_tokens)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if g.prompts_per_step % g.mini_batches:
            raise ValueError(f"grpo.prompts_per_step ({g.prompts_per_step}) must be a multiple of "
                             f"grpo.mini_batches ({g.mini_batches})")
        d = self.dpo
        _check_choice("dpo.loss", d.loss, DPO_LOSSES)
        _check_choice("dpo.reference", d.reference, ("precompute", "live"))
        if not d.beta > 0:
            raise ValueError(f"dpo.beta must be > 0, got {d.beta}")
        if d.loss == "conservative" and not 0 < d.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing must be in (0, 0.5) for dpo.loss conservative, "
                             f"got {d.label_smoothing}")
        if d.loss != "conservative" and d.label_smoothing != 0:
            raise ValueError(f"dpo.label_smoothing applies to dpo.loss conservative only (loss is {d.loss!r})")
        for name, v in (("dpo.steps", d.steps), ("dpo.batch_size", d.batch_size),
                        ("dpo.micro_batch_tokens", d.micro_batch_tokens), ("dpo.max_seq_len", d.max_seq_len)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")


def _check_choice(field: str, value, choices):
    if value not in choices:
        raise ValueError(f"{field} must be one of {list(choices)}, got {value!r}")


def load_config(src: str | Path | dict | None = None, overrides: list[str] = ()) -> RunConfig:
    """A RunConfig from a YAML file (or dict) plus `a.b=value` overrides."""
    return config_io.load(RunConfig, src, overrides)


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    return config_io.save(cfg, path)
