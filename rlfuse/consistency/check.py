"""Rollout vs training log-probs over a sweep of engine settings (`rlfuse check`).

For each `Setting` the engine generates completions on the live model, then the same
tokens are teacher-forced through the trainer's forward -- packed varlen sequences,
autograd recording, `token_logprobs` at the sampling temperature -- and the two
log-probs are compared token by token. In exact numerics every row must be equal
bitwise (`bitwise_frac` 1.0); in fast numerics the rows show the drift.

The sweep covers what may change a rollout's arithmetic: batch size, n > 1 samples
sharing a prompt (prefix-cache hits), prefix caching off, chunked prefill, forced
preemption (recompute), look-ahead decode, the static/graph decode path and the eager
one, the trainer's micro-batch packing, an fp8 KV cache; `combined` turns the engine's
settings on at once (bf16 cache).
Test: `python -m pytest -q tests/test_exact_engine.py`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time

import torch

from rlfuse.consistency.mismatch import logprob_mismatch
from rlfuse.engine import LLM, EngineConfig, SamplingParams
from rlfuse.engine.naive import teacher_forced_logprobs
from rlfuse.kernels.backend import use_numerics
from rlfuse.model import CausalLM, pack_by_tokens

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    name: str
    """Row label."""
    num_prompts: int
    """Distinct prompts generated together (the first num_prompts of the prompt list)."""
    n: int = 1
    """Samples per prompt (they share the prompt's KV blocks when prefix caching is on)."""
    engine: dict = dataclasses.field(default_factory=dict)
    """EngineConfig overrides (numerics and seed are set by the check)."""
    micro_batch_tokens: int = 1 << 30
    """Token budget of one teacher-forced forward: sequences are packed up to it."""
    ragged: bool = False
    """Prompt i asks for max_tokens * (i + 1) // num_prompts tokens: sequences finish one
    after another, so the decode batch shrinks through every CUDA-graph bucket mid-run."""
    min_prompt_len: int = 0
    """Prompts shorter than this are repeated up to it (long prompts, whose shared blocks
    cover whole attention tiles: shared-prefix decode)."""

    @property
    def batch(self) -> int:
        return self.num_prompts * self.n


@dataclasses.dataclass(slots=True)
class SettingResult:
    name: str
    tokens: int
    bitwise_frac: float
    max_abs: float
    mean_abs: float
    kl_k3: float
    first_diff: tuple[int, int] | None = None
    """(completion index, output position) of the first differing token, if any."""
    seconds: dict = dataclasses.field(default_factory=dict)
    """Wall time of the setting's phases: engine start, generate, teacher-forced trainer."""
    engine_stats: dict = dataclasses.field(default_factory=dict)
    """The engine's counters for the generate (preemptions, cached prompt tokens, ...): what
    the setting actually exercised."""
    sequences: list[tuple[list[int], list[int]]] = dataclasses.field(default_factory=list, repr=False)

    def row(self) -> dict:
        return {"name": self.name, "tokens": self.tokens, "bitwise_frac": self.bitwise_frac,
                "max_abs": self.max_abs, "mean_abs": self.mean_abs, "kl_k3": self.kl_k3,
                "seconds": self.seconds, "engine_stats": self.engine_stats}


LONG_PROMPT = 140  # > two 64-key attention tiles of shared blocks


def default_sweep(max_batch: int, *, small_pool_blocks: int, chunk_tokens: int) -> list[Setting]:
    """The settings `rlfuse check` runs. `small_pool_blocks` KV blocks force preemption;
    `chunk_tokens` is a per-step token budget that splits prompts into prefill chunks."""
    n = 4 if max_batch >= 4 else 1
    groups = max(1, max_batch // n)
    pool, chunk = dict(num_kv_blocks=small_pool_blocks), dict(max_num_batched_tokens=chunk_tokens)
    return [
        Setting(name="batch 1", num_prompts=1),
        Setting(name=f"batch {groups * n}, n={n} shared prompts", num_prompts=groups, n=n),
        Setting(name="prefix cache off", num_prompts=groups, n=n, engine=dict(enable_prefix_caching=False)),
        Setting(name="ragged lengths (buckets crossed)", num_prompts=groups, n=n, ragged=True),
        Setting(name="chunked prefill", num_prompts=groups, n=n, engine=chunk),
        Setting(name="forced preemption", num_prompts=groups, n=n, engine=pool),
        Setting(name="eager, no look-ahead", num_prompts=groups, n=n,
                engine=dict(enforce_eager=True, look_ahead=False)),
        Setting(name="micro-batches of 1 sequence", num_prompts=groups, n=n, micro_batch_tokens=1),
        Setting(name=f"n={n} long shared prompts", num_prompts=groups, n=n, min_prompt_len=LONG_PROMPT,
                engine=dict(share_prefix_decode=True)),  # the shared-prefix decode, even where it does not pay
        # an fp8 KV cache (the trainer reads K/V quantized with the engine's scales): prefill
        # chunks reading cached fp8 blocks, prefix-cache hits, and the shared-prefix decode
        # where prompts share whole attention tiles (tests/test_gpu_kv_fp8.py forces it)
        Setting(name="fp8 KV cache", num_prompts=groups, n=n,
                engine=dict(kv_cache_dtype="fp8_e4m3", share_prefix_decode=True, **chunk)),
        Setting(name="combined", num_prompts=groups, n=n, micro_batch_tokens=96,
                engine=dict(**pool, **chunk, enable_prefix_caching=True, look_ahead=True)),
    ]


def trainer_logprobs(model: CausalLM, sequences: list[tuple[list[int], list[int]]], temperature: float,
                     *, micro_batch_tokens: int = 1 << 30, media: list | None = None) -> list[torch.Tensor]:
    """The trainer's log-probs of each completion token: sequences packed into micro-batches
    of at most `micro_batch_tokens`, each one packed forward in train mode with autograd
    recording (the forward that feeds the loss), `token_logprobs` at `temperature` (the
    engine's `teacher_forced_logprobs`; `media[i]`: sequence i's images). Returns detached
    fp32 (L_i,) on the CPU."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    was_training = model.training
    model.train()
    with torch.enable_grad():
        for pack in pack_by_tokens([len(p) + len(c) for p, c in sequences], micro_batch_tokens):
            lps = teacher_forced_logprobs(model, [sequences[i][0] for i in pack], [sequences[i][1] for i in pack],
                                          temperature, None if media is None else [media[i] for i in pack])
            for i, lp in zip(pack, lps):
                out[i] = lp.detach().float().cpu()
    model.train(was_training)
    return out


def run_setting(model: CausalLM, prompts: list[list[int]], setting: Setting, *, numerics: str,
                max_tokens: int, temperature: float, seed: int = 0, media: list | None = None) -> SettingResult:
    """Generate with the engine under `setting`, teacher-force, compare. `media[i]`: prompt
    i's images (MediaItems; vision models), used by the engine and the trainer alike."""
    if media is not None and setting.min_prompt_len:
        raise ValueError(f"setting {setting.name!r}: repeating prompts (min_prompt_len) would move their images")
    cfg = EngineConfig(**{"max_num_seqs": max(setting.batch, 1), **setting.engine, "numerics": numerics,
                          "seed": seed})
    t0 = time.perf_counter()
    llm = LLM(model, config=cfg)
    t1 = time.perf_counter()
    k = setting.num_prompts
    params = [SamplingParams(n=setting.n, temperature=temperature, seed=seed, ignore_eos=True,
                             max_tokens=max(1, max_tokens * (i + 1) // k) if setting.ragged else max_tokens)
              for i in range(k)]
    chosen = [list(p) * -(-setting.min_prompt_len // max(len(p), 1)) if len(p) < setting.min_prompt_len else list(p)
              for p in prompts[:setting.num_prompts]]
    chosen_media = None if media is None else media[:setting.num_prompts]
    outs = llm.generate(chosen, params, chosen_media)
    t2 = time.perf_counter()
    stats = dataclasses.asdict(llm.stats)
    llm.sleep()  # frees the KV pool and the graphs' memory itself
    del llm
    if model.lm_head_weight.device.type == "cuda":
        # whatever the engine's reference cycles still hold, before the trainer's pass; on
        # CPU not worth a full collection (~0.2 s a setting in a test process's heap)
        gc.collect()
    seqs = [(list(o.prompt_token_ids), list(o.output_token_ids)) for o in outs]
    lp_temp = temperature if temperature > 0 else 1.0  # greedy reports T = 1 log-probs
    with use_numerics(numerics):
        train = trainer_logprobs(model, seqs, lp_temp, micro_batch_tokens=setting.micro_batch_tokens,
                                 media=None if media is None else [media[i // setting.n] for i in range(len(outs))])
    seconds = {"engine": round(t1 - t0, 2), "generate": round(t2 - t1, 2), "trainer": round(time.perf_counter() - t2, 2)}
    roll = [torch.as_tensor(o.logprobs, dtype=torch.float32) for o in outs]
    t, r = torch.cat(train), torch.cat(roll)
    mm = {k: float(v) for k, v in logprob_mismatch(t, r).items()}
    first = None
    for i, (a, b) in enumerate(zip(train, roll)):
        diff = (a != b).nonzero()
        if diff.numel():
            first = (i, int(diff[0, 0]))
            break
    n = t.numel()
    return SettingResult(name=setting.name, tokens=n, bitwise_frac=float((t == r).sum()) / max(n, 1),
                         max_abs=mm["max_abs"], mean_abs=mm["mean_abs"], kl_k3=mm["kl_k3"], first_diff=first,
                         seconds=seconds, engine_stats=stats, sequences=seqs)
