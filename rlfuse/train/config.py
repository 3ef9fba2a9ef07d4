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
import math
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
    max_nonfinite_steps: int = 5
    """An optimizer step whose loss or gradient norm is NaN/inf is skipped (weights and
    optimizer state unchanged, counted as optim/skipped_steps); this many skips in a row stop
    the run with an error (0 = never stop)."""


@dataclasses.dataclass(**_DC)
class SFTConfig:
    steps: int = 100
    """Optimizer steps."""
    batch_size: int = 32
    """Examples per optimizer step (gradients accumulated over the micro-batches)."""
    micro_batch_tokens: int = 4096
    """Token budget of one packed micro-batch (prompt + completion tokens)."""
    max_seq_len: int = 1024
    """Longest example in tokens (prompt + completion); the model's context caps it too."""
    overlong: str = "truncate"
    """Longer examples: truncate (on the completion side) or drop; counted and logged."""
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
class PPOConfig:
    steps: int = 100
    """Rollout steps (each: generate, score, GAE, mu epochs of policy and critic updates)."""
    prompts_per_step: int = 64
    """Prompts per rollout step."""
    samples_per_prompt: int = 1
    """Completions sampled per prompt (the critic is the baseline, so 1 is the classic setting)."""
    max_new_tokens: int = 256
    """Longest completion (rollouts and held-out evaluation)."""
    temperature: float = 1.0
    """Rollout sampling temperature (log-probs at logprob_temperature(temperature), as in GRPO)."""
    top_p: float = 1.0
    """Rollout nucleus sampling mass in (0, 1]; 1 disables."""
    top_k: int = 0
    """Rollout top-k filter; 0 disables."""
    loss_type: str = "dapo"
    """Token weighting of the clipped policy loss (rlfuse.kernels.policy_loss): dapo (one mean over
    all tokens, the classic PPO mean) | grpo (mean over sequences of token means) | dr_grpo."""
    clip_low: float = 0.2
    """Policy ratio clip below 1."""
    clip_high: float = 0.2
    """Policy ratio clip above 1."""
    mu: int = 4
    """PPO epochs: passes over each rollout batch (old log-probs, values and advantages fixed)."""
    mini_batches: int = 1
    """Optimizer steps (policy and critic each) per epoch; the rollout batch is split evenly."""
    micro_batch_tokens: int = 8192
    """Token budget of one packed training micro-batch (policy and critic)."""
    gamma: float = 1.0
    """GAE discount over completion tokens."""
    lam: float = 0.95
    """GAE lambda (1: Monte-Carlo returns minus V; 0: one-step TD errors)."""
    value_clip: float | None = 0.2
    """Clip of the value update around the rollout's values (None: unclipped squared error)."""
    critic_path: str = ""
    """Critic initialization: empty = a copy of the policy's trunk with a zero head; else an HF
    folder (a *ForSequenceClassification checkpoint with its head, e.g. the reward model, or a
    causal LM whose trunk is used with a zero head)."""
    critic_lr: float = 1e-5
    """Peak learning rate of the critic's own AdamW (same betas, schedule and clipping as optim)."""
    kl_coef: float = 0.05
    """beta of the per-token k1 penalty -beta (logp_old - logp_ref) added to the reward (0 = none,
    and no reference copy); the starting value when kl_target is set."""
    kl_target: float | None = None
    """Adaptive KL: target of the mean per-sequence KL (summed over tokens); None = fixed kl_coef."""
    kl_horizon: int = 10000
    """Adaptive KL horizon (sequences): beta moves by at most 20% per horizon."""
    reward_norm: bool = True
    """Normalize the scalar reward by running mean and std (over all rewards so far)."""
    whiten_advantages: bool = True
    """Whiten the GAE advantages over the tokens of each rollout batch."""
    entropy_coef: float = 0.0
    """Entropy bonus: subtract entropy_coef * (token-mean policy entropy) from the policy loss."""
    sample_every: int = 10
    """Write sample completions every this many steps (0 = never)."""
    eval_every: int = 0
    """Evaluate on the eval set every this many steps (0 = at the start and the end only)."""
    seed: int = 0
    """Base seed for rollout sampling (step s uses seed + s)."""


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
    """A builtin (see rlfuse.train.rewards.BUILTINS), `reward_model`, or `module:function` / `path.py:function`."""
    path: str = ""
    """`reward_model` only: an HF *ForSequenceClassification checkpoint folder (Llama, Qwen2, Qwen3; one output)."""
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
    """Keep only the newest this many checkpoints (0 = keep all)."""
    resume: str = "never"
    """never | auto (latest complete checkpoint in run_dir, if any) | a checkpoint folder."""
    save_final: bool = True
    """Also write a resumable checkpoint (weights, optimizer, data position) at the end;
    RUN_DIR/final (the weights, an HF folder) is written either way."""


ON_REWARD_ERROR = ("raise", "zero")
"""What a failing reward function does (RunConfig.on_reward_error)."""


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
        if g.prompts_per_step % g.mini_batches:
            raise ValueError(f"grpo.prompts_per_step ({g.prompts_per_step}) must be a multiple of "
                             f"grpo.mini_batches ({g.mini_batches})")
        d = self.dpo
        _check_choice("dpo.loss", d.loss, DPO_LOSSES)
        _check_choice("dpo.reference", d.reference, ("precompute", "live"))
        if d.loss == "conservative" and not 0 < d.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing must be in (0, 0.5) for dpo.loss conservative, "
                             f"got {d.label_smoothing}")
        if d.loss != "conservative" and d.label_smoothing != 0:
            raise ValueError(f"dpo.label_smoothing applies to dpo.loss conservative only (loss is {d.loss!r})")
        _check_ppo(self.ppo)


def _check_ppo(p: PPOConfig) -> None:
    _check_choice("ppo.loss_type", p.loss_type, ("dapo", "grpo", "dr_grpo"))
    if p.prompts_per_step % p.mini_batches:
        raise ValueError(f"ppo.prompts_per_step ({p.prompts_per_step}) must be a multiple of "
                         f"ppo.mini_batches ({p.mini_batches})")
    if p.value_clip is not None and not p.value_clip > 0:
        raise ValueError(f"ppo.value_clip must be > 0 (or null), got {p.value_clip}")
    if p.kl_target is not None and not (p.kl_target > 0 and p.kl_coef > 0):
        raise ValueError(f"ppo.kl_target must be > 0 and needs ppo.kl_coef > 0 (its starting value), "
                         f"got kl_target {p.kl_target}, kl_coef {p.kl_coef}")


RANGES: dict[str, str] = {
    "seed": ">= 0",
    "optim.lr": "> 0", "optim.betas[0]": "[0, 1)", "optim.betas[1]": "[0, 1)", "optim.eps": "> 0",
    "optim.weight_decay": ">= 0", "optim.warmup_steps": ">= 0", "optim.min_lr_ratio": "[0, 1]",
    "optim.max_grad_norm": ">= 0", "optim.max_nonfinite_steps": ">= 0",
    "sft.steps": "> 0", "sft.batch_size": "> 0", "sft.micro_batch_tokens": "> 0", "sft.max_seq_len": "> 0",
    "sft.eval_every": ">= 0",
    "grpo.steps": "> 0", "grpo.prompts_per_step": "> 0", "grpo.max_new_tokens": "> 0",
    "grpo.temperature": ">= 0", "grpo.top_p": "(0, 1]", "grpo.top_k": ">= 0", "grpo.clip_low": "[0, 1)",
    "grpo.clip_high": ">= 0", "grpo.kl_coef": ">= 0", "grpo.adv_eps": "> 0", "grpo.mu": "> 0",
    "grpo.mini_batches": "> 0", "grpo.micro_batch_tokens": "> 0", "grpo.sample_every": ">= 0",
    "grpo.eval_every": ">= 0", "grpo.seed": ">= 0", "grpo.check_every": ">= 0",
    "data.eval_size": "> 0", "data.train_size": "> 0", "data.max_prompt_len": "> 0", "data.seed": ">= 0",
    "rewards[].weight": "any",
    "logging.log_every": ">= 1", "logging.num_samples": ">= 0",
    "checkpoint.every": ">= 0", "checkpoint.keep_last": ">= 0",
    "ppo.steps": "> 0", "ppo.prompts_per_step": "> 0", "ppo.samples_per_prompt": "> 0",
    "ppo.max_new_tokens": "> 0", "ppo.temperature": ">= 0", "ppo.top_p": "(0, 1]", "ppo.top_k": ">= 0",
    "ppo.clip_low": "[0, 1)", "ppo.clip_high": ">= 0", "ppo.mu": "> 0", "ppo.mini_batches": "> 0",
    "ppo.micro_batch_tokens": "> 0", "ppo.gamma": "[0, 1]", "ppo.lam": "[0, 1]", "ppo.critic_lr": "> 0",
    "ppo.kl_coef": ">= 0", "ppo.kl_horizon": "> 0", "ppo.entropy_coef": ">= 0", "ppo.sample_every": ">= 0",
    "ppo.eval_every": ">= 0", "ppo.seed": ">= 0",
    "dpo.steps": "> 0", "dpo.batch_size": "> 0", "dpo.micro_batch_tokens": "> 0", "dpo.max_seq_len": "> 0",
    "dpo.beta": "> 0", "dpo.label_smoothing": "[0, 0.5)", "dpo.eval_every": ">= 0",
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


def _check_choice(field: str, value, choices):
    if value not in choices:
        raise ValueError(f"{field} must be one of {list(choices)}, got {value!r}")


def load_config(src: str | Path | dict | None = None, overrides: list[str] = (), *,
                relative_to: str | Path | None = None) -> RunConfig:
    """A RunConfig from a YAML file (or dict) plus `a.b=value` overrides. With
    `relative_to` (the recipe's folder), the relative input paths the file names (see
    `resolve_input_paths`) resolve against it; overrides stay relative to the working directory."""
    prepare = None if relative_to is None else (lambda data: resolve_input_paths(data, Path(relative_to)))
    return config_io.load(RunConfig, src, overrides, prepare)


def resolve_input_paths(data: dict, base: Path) -> None:
    """Make the relative input paths of recipe data `data` (plain YAML data, changed in
    place) relative to `base`: model.path, model.tokenizer, data.train, data.eval, the file
    of a `file.py:function` reward and a checkpoint.resume folder. Outputs
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
        fix(data.get("data"), key, lambda v: v.startswith("builtin:"))
    fix(data.get("checkpoint"), "resume", lambda v: v in ("never", "auto"))
    for spec in data.get("rewards") or []:
        if isinstance(spec, dict) and isinstance(spec.get("name"), str) and ".py:" in spec["name"]:
            file, _, fn = spec["name"].rpartition(":")
            p = Path(file).expanduser()
            spec["name"] = f"{p if p.is_absolute() else base / p}:{fn}"


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    return config_io.save(cfg, path)
