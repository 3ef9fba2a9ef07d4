"""The sections of a recipe every command shares: `model`, `optim`, `data`, `rewards`,
`logging`, `checkpoint`. Field docstrings feed `--help` and docs/configuration.md.
Test: python -m pytest -q tests/test_config.py
"""

from __future__ import annotations

import dataclasses

from rlfuse.model.lora import LoRAConfig

_DC = dict(frozen=True, kw_only=True, slots=True)


@dataclasses.dataclass(**_DC)
class ModelSpec:
    path: str = ""
    """HF checkpoint folder (config.json, safetensors, tokenizer.json); empty with `random_init`."""
    random_init: dict | None = None
    """ModelConfig fields of a freshly initialized model (vocab_size is taken from the tokenizer)."""
    init: str = "stream"
    """How `random_init` draws the weights: stream (one generator in parameter order) or keyed
    (each block of 64 rows from a generator keyed by seed, name and block: data-parallel runs
    build on the meta device and draw only their shard, with the weights of one process;
    other values than stream's). docs/distributed.md."""
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
    lora: LoRAConfig | None = None
    """LoRA adapters trained on the frozen base (docs/lora.md); null: full fine-tune. `lora: {}`
    takes every default (rank 16, alpha 32, all linear layers); set optim.lr ~10x the full
    fine-tune's."""
    router_aux_loss_coef: float | None = None
    """MoE models: weight of the load-balancing loss every training loss adds (SFT, GRPO, PPO,
    DPO); null = transformers' rule: config.json's router_aux_loss_coef when its
    output_router_logits is true, else 0. Logged as moe/aux_loss either way."""
    processor: dict = dataclasses.field(default_factory=dict)
    """Vision models: image processor settings over the checkpoint's preprocessor_config.json
    (its keys: min_pixels, max_pixels, image_mean, image_std, ...); docs/vision.md."""
    train_vision: bool = False
    """Vision models: train the vision tower too (frozen by default; LoRA adapts the language model only)."""
    text_only: bool = False
    """Qwen3.5 folders (Qwen3_5ForConditionalGeneration): load the text tower alone (Qwen3_5ForCausalLM: no
    vision tower, no images); false: the folder's vision-language model, vision tower included."""
    router_z_loss_coef: float = 0.0
    """MoE models: weight of the router z-loss (ST-MoE: mean logsumexp(router logits)^2)
    added to every training loss; logged as moe/z_loss either way."""


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
class DataConfig:
    train: str = ""
    """A .jsonl / .json / .parquet file, builtin:arithmetic / builtin:arithmetic_pref / builtin:countdown,
    builtin:lookup / builtin:count (the agent demo's tool tasks), builtin:count_squares (images),
    a Hugging Face dataset hf:NAME[:CONFIG] (from the local cache, or downloaded) or a folder
    written by Dataset.save_to_disk (both need the `datasets` extra)."""
    eval: str = ""
    """Held-out set (same forms). For builtin tasks: a disjoint split of eval_size problems."""
    split: str = "train"
    """Split of a Hugging Face data.train (hf:NAME or a saved DatasetDict)."""
    eval_split: str = "test"
    """Split of a Hugging Face data.eval."""
    columns: dict = dataclasses.field(default_factory=dict)
    """Renames applied to every row first, {dataset column: rlfuse column}, e.g.
    {question: prompt, solution: answer} (the *_field keys then name the renamed columns)."""
    map: str = ""
    """A row transform `file.py:fn` or `module:fn`, fn(row: dict) -> dict, applied to every row
    after the renames (empty: none)."""
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
    """Column holding a chat ([{role, content}, ...]); rows with it are chat rows. A content may be a
    list of OpenAI-style parts: text, image_url, image (docs/vision.md)."""
    images_field: str = "images"
    """Column holding a row's images (a list, or one image: a path, a data: URL, a PIL image, a
    datasets Image cell), taken in order by image_placeholder or {type: image} parts (docs/vision.md)."""
    image_placeholder: str = "<image>"
    """In a prompt row's text, where the next image of images_field goes."""
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
    """A builtin (see rlfuse.rollout.rewards.BUILTINS), `reward_model`, or `module:function` / `path.py:function`."""
    path: str = ""
    """`reward_model` only: an HF *ForSequenceClassification checkpoint folder (Llama, Qwen2, Qwen3; one output)."""
    weight: float = 1.0
    """The total reward is the weighted sum of the functions' rewards."""
    kwargs: dict = dataclasses.field(default_factory=dict)
    """Keyword arguments bound to the function."""


WANDB_MODES = ("online", "offline", "disabled")
"""Values of logging.wandb.mode (wandb.init's)."""


@dataclasses.dataclass(**_DC)
class WandbConfig:
    project: str = ""
    """W&B project; non-empty turns Weights & Biases logging on (the `wandb` extra)."""
    entity: str = ""
    """W&B team or user; empty: your default entity."""
    name: str = ""
    """Run name; empty: the run folder's name and the stage (e.g. my_run/grpo)."""
    tags: list[str] = dataclasses.field(default_factory=list)
    """Run tags."""
    mode: str = "online"
    """online | offline (written under RUN_DIR/wandb, `wandb sync` it later) | disabled."""


@dataclasses.dataclass(**_DC)
class MlflowConfig:
    experiment: str = ""
    """MLflow experiment name; non-empty turns MLflow logging on (the `mlflow` extra)."""
    tracking_uri: str = ""
    """Tracking server or store URI (http://..., sqlite:///mlflow.db, file:///path); empty: MLflow's
    default (MLflow 3: ./mlflow.db, which needs the full mlflow package, not the extra's mlflow-skinny)."""


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
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    """Weights & Biases: the resolved config, the same metrics as TensorBoard, the report's plots."""
    mlflow: MlflowConfig = dataclasses.field(default_factory=MlflowConfig)
    """MLflow: the resolved config as params, the same metrics as TensorBoard, the report's plots as artifacts."""
    profile_step: int = 0
    """Profile one step (its number as logged, 1-based; 0 = off) on every rank with torch.profiler:
    the `profile_phase` of that step only. Writes RUN_DIR/profile/step<N>_rank<R>.trace.json.gz (a
    Chrome / Perfetto trace) and step<N>_rank<R>.json (wall, collective / compute / idle device
    time, collective counts, top host ops; rlfuse.run.profile). GRPO only; the profiled step runs
    slower (benchmarks leave it out of their means)."""
    profile_phase: str = "train"
    """The phase `profile_step` profiles: train | generate | score (GRPO's timed phases)."""


PROFILE_PHASES = ("train", "generate", "score")
"""Values of logging.profile_phase (GRPO's timed phases)."""
GRAD_SYNC = ("every", "last")
"""Values of distributed.grad_sync."""
FSDP_TRADES = ("auto", "memory", "communication")
"""Values of distributed.trade."""


@dataclasses.dataclass(**_DC)
class DistributedConfig:
    """FSDP2 settings of a data-parallel (torchrun) run's sharded models. Each of the five
    settings below left unset (null) follows `trade`; a value given overrides it
    (docs/distributed.md has the measurements)."""
    trade: str = "auto"
    """How the unset settings lean. memory: FSDP2's own (layers re-gathered for backward, a
    reduce-scatter after every micro-batch, single-tensor AdamW): the least memory.
    communication: weights stay gathered from forward to the optimizer step, gradients are
    reduced once a step (grad_sync last), prefetch 2, foreach AdamW: 6 bytes more per
    parameter on each rank (the bf16 model gathered, its fp32 gradients unsharded) for far
    fewer collectives (Qwen3-0.6B GRPO on 4 H200s: weak scaling 0.83 -> 0.91). auto:
    communication when those bytes fit in a tenth of the GPU's memory, else memory (on
    CPU: memory); the choice and its numbers are logged."""
    reshard_after_forward: bool | None = None
    """true: decoder layers free their gathered weights after forward and gather them again
    for backward. false: they stay gathered from forward to backward (the whole model's
    gathered bytes at the peak), saving the backward all-gathers. Bitwise the same training."""
    reshard_after_backward: bool | None = None
    """true: free the gathered weights after each backward. false: they stay gathered until
    the optimizer step (which always reshards first), so the next micro-batch gathers nothing.
    Bitwise the same training."""
    prefetch: int | None = None
    """0: FSDP2's implicit prefetch (the next layer's all-gather is issued when its forward
    starts; backward prefetches one layer). k >= 1: each layer explicitly prefetches the next
    k layers in forward and the previous k in backward (more gathered layers in memory).
    Bitwise the same training."""
    grad_sync: str | None = None
    """every: reduce-scatter the gradients after every micro-batch's backward | last: only
    after the last micro-batch of an optimizer step (earlier ones accumulate full-size fp32
    gradients on each rank, 4 bytes per parameter more; fewer reduce-scatters). `last`
    changes the fp32 summation order (each rank's micro-batches first, then the ranks), so
    the training equals `every`'s within fp32 rounding, not bitwise. GRPO only (the other
    trainers reduce every micro-batch)."""
    optimizer_foreach: bool | None = None
    """AdamW on the fp32 shards by torch's multi-tensor (foreach) path instead of one parameter at
    a time: far fewer DTensor ops on the host per optimizer step. The same elementwise math:
    bitwise equal to the single-tensor path on CPU, within one fp32 rounding on CUDA (tested)."""


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


@dataclasses.dataclass(**_DC)
class RolloutConfig:
    tools: list[str] = dataclasses.field(default_factory=list)
    """Tools the model may call, making rollouts multi-turn episodes: the built-ins `calculator`,
    `lookup` and `count` (the agent demo's tool tasks) and `python` (model-written code, run
    where `sandbox` says) or `FILE.py:FUNCTION` (a typed function whose docstring describes it).
    docs/agents.md."""
    sandbox: str = "bwrap"
    """Where the `python` tool runs code: bwrap (isolated by bubblewrap: no network, no access
    to your files or processes; the run refuses to start if bwrap is unusable) | none (a plain
    subprocess with limits, warned every run) | http(s)://HOST:PORT (a SandboxFusion server)."""
    env: str = ""
    """An environment class `FILE.py:CLASS` (reset(row, *, seed) -> messages, step(turn) -> Step),
    instead of `tools`; built with `env_kwargs` once per episode."""
    env_kwargs: dict = dataclasses.field(default_factory=dict)
    """Keyword arguments of the environment class."""
    max_turns: int = 4
    """Most model turns per episode; an episode still going after them is truncated."""
    max_turn_tokens: int = 256
    """Most tokens of one model turn."""
    max_total_tokens: int = 1024
    """Most tokens after the prompt (model turns and observations); past it the episode is truncated."""
    max_obs_tokens: int = 256
    """Most tokens of one observation message's content; longer content is cut (`obs_truncation`)."""
    obs_truncation: str = "right"
    """right: keep the head of a long observation | left: keep its tail."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit of one tool call (an error observation past it, counted as a timeout)."""
    tool_call_format: str = "auto"
    """auto (from the chat template's markup) | hermes (<tool_call>{json}</tool_call>) | json (a bare
    {"name", "arguments"} object, Llama-3.1 style)."""
    chat_template: str = ""
    """A .jinja chat template file for the episodes; empty: the tokenizer's."""
    env_timeout_s: float = 60.0
    """Longest an environment step may take before its episode ends with an error."""
    env_workers: int = 0
    """Threads running environment steps (tool calls) while the engine decodes other episodes.
    0 (auto): one per episode of the rollout, at most MAX_ENV_WORKERS = 256 (tools mostly wait:
    sleep, I/O, a sandbox's subprocess). Fewer workers than episodes queue a turn's tool calls,
    and the decode batch thins while they wait: with 8 workers, 64 episodes and 50 ms tools,
    benchmarks/bench_multi_turn.py --small ran at 0.87x the single-turn tokens/s, with 64 at
    0.97x (CPU, docs/benchmarks.md)."""
    agent: str = ""
    """Your own agent `FILE.py:FUNCTION`, `async def agent(client, row) -> float | dict | None`, run
    with an openai.AsyncOpenAI client bound to one recorded session of the training process's own
    server, instead of `tools` / `env` (docs/agents.md, "Bring your own agent")."""
    agent_timeout_s: float = 300.0
    """Longest one agent episode may run; past it the episode fails (reward 0, counted)."""
    failed_episode: str = "zero"
    """A failed agent episode (raised, timed out, no call, past max_turns or the token budget):
    zero (trained with reward 0, so the policy learns to avoid what failed) | drop (left out
    of the loss, and its group's baseline counts it as the mean reward of the others: an
    infrastructure fault then teaches nothing). Counted in rollout/agent_failed_* either way."""

    @property
    def multi_turn(self) -> bool:
        return bool(self.tools or self.env or self.agent)


OBS_TRUNCATION = ("right", "left")
TOOL_CALL_FORMATS = ("auto", "hermes", "json")
ON_REWARD_ERROR = ("raise", "zero")
"""What a failing reward function does (RunConfig.on_reward_error)."""


def _check_choice(field: str, value, choices):
    if value not in choices:
        raise ValueError(f"{field} must be one of {list(choices)}, got {value!r}")


