"""Engine and sampling configuration.

`EngineConfig` sizes the engine (KV blocks, batch limits, CUDA graphs); `SamplingParams`
says how one request is sampled. Both are frozen, keyword-only and validated on
construction: a bad field raises ValueError naming the field and what was expected.
Request-level checks that need the model (prompt length against the context, token ids
against the vocabulary, stop strings without a tokenizer) happen in `LLM.add_request`,
which names the request.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rlfuse.kernels.backend import NUMERICS
from rlfuse.kernels.kv_quant import KV_CACHE_DTYPES

_MAX_SEED = 2**32
_MAX_TOP_K = 2**31 - 1  # the sampler holds top-k in int32
MIN_TEMPERATURE = 1e-5
"""The smallest non-zero temperature: below ~1e-38 T is subnormal in fp32 and the log-probs
become NaN (1e-40 did); far above it sampling is already greedy to fp32 precision."""


def logprob_temperature(temperature: float) -> float:
    """The temperature of the log-probs that go with samples drawn at `temperature` (the
    engine reports them, the trainer recomputes them): T itself, and 1 for greedy (T = 0),
    whose samples come from no scaled distribution, so the unscaled policy's log-probs."""
    return temperature if temperature > 0 else 1.0


def _positive_int(owner: str, name: str, v, allow_none: bool = False):
    if v is None and allow_none:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{owner}.{name} must be a positive integer, got {v!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    block_size: int = 16
    """Tokens per KV-cache block (a power of two >= 16 for the Triton kernels)."""
    max_num_seqs: int = 256
    """Most sequences in one step (decode batch size)."""
    max_num_batched_tokens: int = 8192
    """Most tokens computed in one step; longer prompts are prefilled in chunks."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output); None: the model's max_position_embeddings."""
    gpu_memory_fraction: float = 0.9
    """Share of the GPU's total memory the process may use once the KV pool is allocated
    (weights, activations of a warm-up forward and other processes' memory come off first)."""
    num_kv_blocks: int | None = None
    """Force the number of KV blocks (tests: a tiny pool forces preemption). None: from
    the memory budget on CUDA; on CPU enough for max_num_seqs full-length sequences,
    capped at `cpu_kv_cache_gib`."""
    cpu_kv_cache_gib: float = 1.0
    """Cap on the KV pool on CPU, where no memory budget is measured."""
    enable_prefix_caching: bool = True
    """Share full prompt blocks between sequences with the same prefix (GRPO groups,
    system prompts) by hash of the block's tokens chained with its prefix."""
    share_prefix_decode: bool | None = None
    """Decode steps on CUDA graphs read a prompt's cached K/V once for every running
    sequence that shares those blocks (a GRPO group's completions), not once per sequence
    (rlfuse.kernels.attention.paged, "Shared prefixes"). Exact numerics keep their bits;
    fast numerics round as a split decode does. None (default): where it pays
    (`shared_prefix_pays`: enough groups to fill the GPU, or prompts whose K/V outgrow the
    L2 cache); True: whenever prompts share blocks; False: never. Needs prefix caching."""
    enforce_eager: bool = False
    """No CUDA graphs. On CPU, False runs decode through the same static, bucket-padded
    buffers the graphs use (without capture) so CPU tests cover that bookkeeping."""
    look_ahead: bool = True
    """While a decode step runs on the device, schedule and launch the next one (its input
    ids fed on the device from the running step's samples) and do the host bookkeeping
    meanwhile: the device no longer idles through the engine's Python between steps.
    Only for pure decode steps on the static (graph) path, with nothing waiting or the
    running set full; a sequence that stops on a token (EOS, stop string) computes one
    extra token that is discarded. Off: every step waits for the previous one (the plain loop)."""
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    """Decode batch-size buckets captured as CUDA graphs; None: 1, 2, 4, 8, then every
    16 up to max_num_seqs. Larger decode batches run eagerly."""
    seed: int = 0
    """Seeds the per-request seeds of requests that do not set one."""
    record_routing: bool | None = None
    """MoE models: record each sampled token's top-k expert ids in every MoE layer
    (`Completion.routing`, (tokens, layers, k) int16), read by the trainer's
    moe/routing_mismatch. None: on for models with MoE blocks; a (T, k) copy per layer per step."""
    numerics: str = "fast"
    """"fast": cuBLAS GEMMs and split-KV decode, rollout log-probs within ~1e-2 of the
    trainer's. "exact": batch-invariant kernels, so every rollout log-prob equals the
    trainer's bitwise (`rlfuse check` proves it; docs/numerics.md lists the cost)."""
    kv_cache_dtype: str = "auto"
    """"auto": the KV cache in the model's dtype. "fp8_e4m3": float8_e4m3fn, half the bytes
    (twice the tokens in the same memory, half the K/V reads per decode step), one
    power-of-two scale per layer, K or V and KV head, calibrated on the prompts whenever the
    weights changed; the trainer's forwards read K/V quantized with the same scales, so exact
    numerics stay bitwise (docs/numerics.md, "FP8 KV cache")."""
    fuse_projections: bool | None = None
    """Run q/k/v, gate/up and a hybrid's linear-attention input projections of each layer as
    one GEMM each (the engine fuses the model in place when built: the parameters become views
    of one buffer per group, names and checkpoints unchanged; the trainer's forward runs fused
    too). Exact numerics keep their bits; a group whose projections all carry adapters of one
    rank and scale stays fused, a partly adapted one runs separate; FSDP-sharded models fuse the gathered
    weights at each rollout and join the gathered parts in their training forwards (rlfuse.model.fuse).
    None (default): on CUDA, where it speeds decode up; not on a CPU, where it would only move
    fast-mode rounding. True / False: always / never (False leaves the model as it is: one
    fused earlier by another engine stays fused)."""

    def __post_init__(self):
        o = "EngineConfig"
        if self.numerics not in NUMERICS:
            raise ValueError(f"{o}.numerics must be one of {NUMERICS}, got {self.numerics!r}")
        for f in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _positive_int(o, f, getattr(self, f))
        _positive_int(o, "max_model_len", self.max_model_len, allow_none=True)
        _positive_int(o, "num_kv_blocks", self.num_kv_blocks, allow_none=True)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"{o}.block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"{o}.gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if not self.cpu_kv_cache_gib > 0:
            raise ValueError(f"{o}.cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        if self.cuda_graph_batch_sizes is not None:
            sizes = self.cuda_graph_batch_sizes
            if not isinstance(sizes, (tuple, list)) or not sizes:
                raise ValueError(f"{o}.cuda_graph_batch_sizes must be a non-empty tuple of ints, got {sizes!r}")
            for s in sizes:
                _positive_int(o, "cuda_graph_batch_sizes[]", s)
            object.__setattr__(self, "cuda_graph_batch_sizes", tuple(sorted(set(sizes))))
        if self.fuse_projections is not None and not isinstance(self.fuse_projections, bool):
            raise ValueError(f"{o}.fuse_projections must be true, false or null (auto: on CUDA), "
                             f"got {self.fuse_projections!r}")
        if self.share_prefix_decode is not None and not isinstance(self.share_prefix_decode, bool):
            raise ValueError(f"{o}.share_prefix_decode must be true, false or null (where it pays), "
                             f"got {self.share_prefix_decode!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"{o}.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"{o}.seed must be an int >= 0, got {self.seed!r}")

    def fuses_on(self, device: torch.device) -> bool:
        """fuse_projections resolved for a model on `device`: as set, else on CUDA only."""
        return device.type == "cuda" if self.fuse_projections is None else self.fuse_projections

    def graph_batch_sizes(self) -> tuple[int, ...]:
        if self.cuda_graph_batch_sizes is not None:
            return tuple(s for s in self.cuda_graph_batch_sizes if s <= self.max_num_seqs) or (1,)
        sizes = [s for s in (1, 2, 4, 8) if s < self.max_num_seqs]
        sizes += range(16, self.max_num_seqs + 1, 16)
        return tuple(sorted(set(sizes) | {self.max_num_seqs}))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How one request is sampled. Filters apply in the order temperature, top-k, top-p,
    min-p (see `rlfuse.kernels.sampling.draw`). The reported log-prob of each sampled token is
    log softmax(logits / T)[token] BEFORE the filters, T = `logprob_temperature(temperature)`."""
    n: int = 1
    """Completions per prompt; they share the prompt's KV blocks (prefill once)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables."""
    min_p: float = 0.0
    """Keep tokens with p >= min_p * p_max; 0 disables."""
    max_tokens: int = 16
    """Most new tokens (the context length also stops a sequence)."""
    min_tokens: int = 0
    """EOS and stop token ids are masked out of the sampling until this many tokens exist
    (the reported log-probs stay those of the unmasked policy)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra ids that end a completion (kept in the output, like EOS)."""
    stop: tuple[str, ...] = ()
    """Strings that end a completion; the text is cut before the match (needs a tokenizer)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    seed: int | None = None
    """Per-request seed in [0, 2**32); None: drawn from the engine's seed. Sample k draws
    with a key hashed from (seed, prompt token ids, k) and each token's draw depends only on
    that key and the token's position: a seed reproduces a prompt's samples whatever the
    batch, and prompts sharing a seed still get independent noise."""
    skip_special_tokens: bool = True
    """Drop special tokens from `Completion.text`."""
    adapter: int | None = None
    """With an adapter bank (`rlfuse.model.lora_bank`, `rlfuse serve --lora`): the slot of
    the adapter this request runs under; None: the base model."""

    def __post_init__(self):
        o = "SamplingParams"
        _positive_int(o, "n", self.n)
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"{o}.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"{o}.min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"{o}.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"{o}.temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{o}.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"{o}.min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not -1 <= self.top_k <= _MAX_TOP_K:
            raise ValueError(f"{o}.top_k must be an integer in [-1, 2**31 - 1] (0 or -1 disables), "
                             f"got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < _MAX_SEED):
            raise ValueError(f"{o}.seed must be None or an int in [0, 2**32), got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"{o}.stop_token_ids must be a list of token ids (e.g. [{self.stop_token_ids!r}]), "
                             f"got {type(self.stop_token_ids).__name__} {self.stop_token_ids!r}")
        ids = tuple(self.stop_token_ids)
        if not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ValueError(f"{o}.stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"{o}.stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "temperature", float(self.temperature))
        if self.adapter is not None and (not isinstance(self.adapter, int) or isinstance(self.adapter, bool)
                                         or self.adapter < 0):
            raise ValueError(f"{o}.adapter must be None (the base model) or a bank slot >= 0, got {self.adapter!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
