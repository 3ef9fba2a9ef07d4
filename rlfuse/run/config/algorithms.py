"""The algorithm sections of a recipe: `sft`, `grpo` (and its variants), `ppo`, `dpo`,
with the advantage-estimator and scaling names they accept. Field docstrings feed
`--help` and docs/configuration.md; ranges are checked in `run_config.check_ranges`.
Test: python -m pytest -q tests/test_config.py
"""

from __future__ import annotations

import dataclasses

from rlfuse.run.config.sections import _DC, _check_choice

TRL_NAMES = {
    "learning_rate": "optim.lr", "num_generations": "grpo.group_size", "max_completion_length": "grpo.max_new_tokens",
    "beta": "grpo.kl_coef (dpo.beta for DPO)", "epsilon": "grpo.clip_low", "epsilon_high": "grpo.clip_high",
    "delta": "grpo.dual_clip", "num_iterations": "grpo.mu", "scale_rewards": "grpo.adv_scale",
    "mask_truncated_completions": "grpo.mask_truncated", "max_steps": "steps", "num_train_epochs": "steps",
    "per_device_train_batch_size": "grpo.prompts_per_step (sft.batch_size for SFT)",
    "gradient_accumulation_steps": "grpo.mini_batches / micro_batch_tokens", "max_prompt_length": "data.max_prompt_len",
    "max_length": "sft.max_seq_len", "warmup_steps": "optim.warmup_steps", "lr_scheduler_type": "optim.schedule",
    "max_grad_norm": "optim.max_grad_norm", "weight_decay": "optim.weight_decay", "bf16": "model.dtype",
    "gradient_checkpointing": "model.gradient_checkpointing", "output_dir": "run_dir= (logging.run_dir)",
    "logging_steps": "logging.log_every", "save_steps": "checkpoint.every", "save_total_limit": "checkpoint.keep_last",
    "seed": "seed", "reward_weights": "reward_weights= (rewards[].weight)",
}
"""TRL's config names -> rlfuse's keys (docs/coming-from-trl.md), for the error a TRL name gets."""


class _Section:
    """Base of the algorithm sections: an unknown keyword is a ValueError naming the field
    and, for a TRL name, rlfuse's key (a dataclass alone raises a bare TypeError)."""
    __slots__ = ()

    def __new__(cls, *args, **kwargs):
        unknown = [k for k in kwargs if k not in cls.__dataclass_fields__]
        if unknown:
            k = unknown[0]
            hint = (f"that is TRL's name; rlfuse's is {TRL_NAMES[k]}" if k in TRL_NAMES else
                    f"fields: {', '.join(sorted(cls.__dataclass_fields__))}")
            where = "" if "." not in TRL_NAMES.get(k, "") or TRL_NAMES[k].startswith(cls.section + ".") else (
                " (set other sections through config=, e.g. config={'optim': {'lr': 1e-6}})")
            raise ValueError(f"{cls.__name__}: unknown field {k!r} ({hint}; docs/coming-from-trl.md){where}")
        return super().__new__(cls)


@dataclasses.dataclass(**_DC)
class SFTConfig(_Section):
    section = "sft"
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
class GRPOConfig(_Section):
    section = "grpo"
    steps: int = 100
    """Rollout steps (each: generate, score, mu policy updates)."""
    prompts_per_step: int = 16
    """P prompts per rollout step (each sampled group_size times)."""
    group_size: int = 8
    """G completions per prompt."""
    max_new_tokens: int = 256
    """Longest completion (rollouts, and held-out evaluation of both SFT and GRPO)."""
    temperature: float = 1.0
    """Rollout sampling temperature, > 0 (greedy rollouts give a group identical completions
    and zero advantages). The policy, old and reference log-probs are
    all taken at `rlfuse.engine.config.logprob_temperature(temperature)`: this T, or 1 when greedy."""
    top_p: float = 1.0
    """Rollout nucleus sampling mass in (0, 1]; 1 disables (the log-probs stay the unfiltered policy's)."""
    top_k: int = 0
    """Rollout top-k filter; 0 disables (the log-probs stay the unfiltered policy's)."""
    loss_type: str = "grpo"
    """grpo (mean over sequences of token means) | dr_grpo (sum / (seqs * max_new_tokens)) |
    dapo (token-level mean) | gspo (sequence-level ratio; its paper clips at ~3e-4 / 4e-4) |
    cispo (importance weight capped above at 1 + clip_high and detached, times the log-prob,
    token-level mean). TRL's names and defaults: docs/coming-from-trl.md."""
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
    kl_ratio: bool = False
    """Weight each token's KL term by its importance ratio, with the ratio's gradient (TRL's
    use_bias_correction_kl, on there by default): the expected gradient is then that of
    KL(policy || reference) even off-policy. Off: the GRPO paper's k3 term. Not with gspo."""
    cispo_clip_low: bool = False
    """loss_type cispo: also bound the importance weight below at 1 - clip_low (off: capped
    above only, as the MiniMax-M1 paper and TRL)."""
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
    share_prefix: bool = False
    """Pack each group's prompt once in training, its completions attending to it (positions
    continuing from the prompt), instead of G copies of prompt + completion: the prompt's
    forward and backward run once per group and micro-batch, and micro_batch_tokens counts
    it once. Exact numerics: log-probs bitwise the unshared ones; gradients equal to fp32
    rounding (docs/numerics.md, "Shared prompts"). Off by default until timed on a GPU."""
    share_prefix_min_tokens: int = 16
    """share_prefix: the shortest prompt shared, in tokens (shorter ones pack unshared; a
    few-token prompt saves little forward; 16 is not tuned)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (zero advantage, DAPO); the batch is not
    refilled by extra sampling, so a step may train on fewer groups (logged: groups/kept)."""
    mask_truncated: bool = False
    """Give completions cut at max_new_tokens zero loss weight (DAPO overlong filtering)."""
    log_entropy: bool = True
    """Log the policy's mean token entropy, over the tokens of each step's first optimizer step (no gradient)."""
    warm_kernels: bool = False
    """CUDA, one process: compile the update's Triton kernels in worker processes while the
    first rollout decodes (rlfuse/train/warm.py; logged under compile/). On a cold Triton
    cache it took ~5 s off the first update and added ~3 s to the first rollout (H100,
    docs/benchmarks.md), hence off by default."""
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
    overlap: str = "sync"
    """sync (generate the whole batch, then train on it) | stream (each group's rewards,
    advantages and forward+backward run as soon as its G completions finish, while the
    engine decodes the rest; on CUDA on a side stream; one optimizer step after the last
    group, so training stays exactly on-policy). Same parameters as sync (docs/algorithms.md,
    "Streaming GRPO"); needs mu 1, mini_batches 1, a per-group advantage, single-turn. Under
    torchrun each rank streams its groups (LoRA, or FSDP2-sharded: then equal to sync to fp32
    rounding, not bitwise; docs/distributed.md)."""


DPO_LOSSES = ("sigmoid", "ipo", "conservative")
"""Values of `dpo.loss` (rlfuse.train.dpo)."""


@dataclasses.dataclass(**_DC)
class DPOConfig(_Section):
    section = "dpo"
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
class PPOConfig(_Section):
    section = "ppo"
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
    """Token weighting of the clipped policy loss (rlfuse.kernels.loss.policy): dapo (one mean over
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


OVERLAP_MODES = ("sync", "stream")
"""Values of `grpo.overlap` (rlfuse.train.grpo_stream)."""


def check_stream(g: GRPOConfig, *, multi_turn: bool) -> None:
    """grpo.overlap stream trains each group before the batch is complete: settings that
    need the whole batch first (or update the weights mid-rollout) are refused by name."""
    _check_choice("grpo.overlap", g.overlap, OVERLAP_MODES)
    if g.overlap != "stream":
        return
    why = {"grpo.mu": (g.mu != 1, f"{g.mu}: a second pass needs the first pass's update"),
           "grpo.mini_batches": (g.mini_batches != 1, (f"{g.mini_batches}: an optimizer step before the last "
                                                       "group would change the weights the engine samples from")),
           "grpo.advantage": (g.advantage not in ("group", "rloo"), (f"{g.advantage!r}: it normalizes over "
                                                                     "the whole batch's tokens; use group or rloo")),
           "grpo.adv_scale": (g.advantage == "group" and g.adv_scale == "batch", ("'batch': the batch std "
                                                                                  "needs every group's rewards; "
                                                                                  "use group or none")),
           "rollout.tools / rollout.env": (multi_turn, "multi-turn episodes are not streamed by group")}
    bad = [f"{k} is {msg}" for k, (hit, msg) in why.items() if hit]
    if bad:
        raise ValueError("grpo.overlap stream: " + "; ".join(bad) + " (or use grpo.overlap sync)")


ADV_SCALES = ("group", "batch", "none")
"""Normalizers of the centred group rewards (module docstring)."""


ESTIMATORS = ("group", "rloo", "reinforce_pp", "reinforce_pp_baseline")
"""Values of `grpo.advantage` (module docstring)."""


