"""`LLM`: the inference engine on an already-loaded model (the trainer's own weights).

    llm = LLM(model, tokenizer, EngineConfig())
    outs = llm.generate(["2+2=", [1, 2, 3]], SamplingParams(n=4, temperature=1.0, max_tokens=64))
    # -> 8 Completions, prompt-major: outs[i * n + k] is sample k of prompt i

The engine owns no weights. Every step reads the model's parameters as they are, so an
in-place update (optimizer step, `p.copy_`) is used by the next `generate` with no copy
and no sync step; CUDA graphs replay over the same parameter tensors. Cached prompt K/V
would be stale after an update: the prefix cache is dropped when the parameters' version
counters changed since the last request (in-place ops bump them; writes through `.data`
do not -- call `reset_prefix_cache()` after those), and on `wake()`. LoRA adapters
(`rlfuse.model.lora`) are parameters like any other; attaching them or switching them
off/on between requests drops the prefix cache and the decode graphs too.

Streaming: `add_request` (validates, names the request in any ValueError, leaves the
other requests untouched), `step()` (one scheduler step; returns the completions that
finished in it; `rlfuse.engine.loop`), `abort(request_id)`, `has_unfinished()`,
`partial(request_id, start)` (the tokens running samples have so far: what a streaming
server sends). `sleep()` frees the KV pool, a hybrid's linear-attention state and the
graphs' memory for training (running requests are preempted, resumed by recompute after
`wake()`, which re-creates them).

Log-probs: see `Completion` -- log softmax(logits / T) of the sampled token before any
filtering, from `rlfuse.kernels.loss.logprob.token_logprobs`, the function the trainer uses.
Test: python -m pytest -q tests/test_engine.py
"""

from __future__ import annotations

import logging
import random
import time

import torch

from rlfuse.engine.cache.blocks import BlockManager
from rlfuse.engine.cache.parked import Parked
from rlfuse.engine.config import EngineConfig, SamplingParams
from rlfuse.engine.loop import EngineLoop
from rlfuse.engine.media import FeatureCache, admit
from rlfuse.engine.scheduler import Launched, Scheduler
from rlfuse.engine.sequence import (
    Completion,
    Sequence,
    completion,
    prompt_list,
    sample_key,
    sample_key_base,
    validate_request,
)
from rlfuse.engine.stats import EngineStats
from rlfuse.engine.step import ModelRunner, param_version
from rlfuse.model import CausalLM
from rlfuse.model.fuse import fuse_projections
from rlfuse.model.lora import adapter_switches

log = logging.getLogger(__name__)


class LLM(EngineLoop):
    def __init__(self, model: CausalLM, tokenizer=None, config: EngineConfig | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.config = cfg = config or EngineConfig()
        mcfg = model.config
        if cfg.fuses_on(model.lm_head_weight.device):
            fuse_projections(model)  # moves the parameters' storage: before any graph records a pointer
        self.max_model_len = cfg.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            log.warning("max_model_len %d exceeds the model's max_position_embeddings %d", self.max_model_len,
                        mcfg.max_position_embeddings)
        self.eos_ids = frozenset(int(e) for e in (mcfg.eos_token_ids if tokenizer is None else tokenizer.eos_token_ids))
        self.vocab_size = mcfg.vocab_size
        self.runner = ModelRunner(model, cfg, self.max_model_len)
        self.kv = self.runner.plan_and_allocate(self.max_model_len)
        caching = cfg.enable_prefix_caching
        self._new_scheduler()
        if caching and self.runner.linear is not None:
            log.info("prefix caching for this hybrid model: a request's n samples share their prompt (the linear-"
                     "attention state copied from the member that computed it), and a request continuing a finished "
                     "sequence (multi-turn) takes over its state and blocks; no other reuse across requests")
        self.stats = EngineStats()
        self._rng = random.Random(cfg.seed)
        self._next_id = self._next_seq = 0
        self._requests: dict[str, list[Sequence]] = {}
        self._pending: Launched | None = None  # a look-ahead step launched, not read yet
        self._ready: list[Completion] = []      # finished samples read by _drain, for the next step()
        self._weights_version = param_version(self.model)
        self._adapters = adapter_switches(model)
        self._kv_stale = self.runner.kv_quant is not None  # fp8 scales to calibrate before the next request
        self.asleep = False
        log.info("engine: %s on %s, max_model_len %d, %d KV blocks x %d tokens, max_num_seqs %d, "
                 "max_num_batched_tokens %d, prefix caching %s, decode %s, numerics %s", mcfg.architecture,
                 self.runner.device, self.max_model_len, self.kv.num_blocks, cfg.block_size, cfg.max_num_seqs,
                 cfg.max_num_batched_tokens, "on" if caching else "off",
                 "CUDA graphs" if self.runner.use_graphs else
                 ("static buffers (no capture on CPU)" if self.runner.static else "eager"), cfg.numerics)

    def _new_scheduler(self) -> None:
        """A fresh block manager and scheduler over the allocated pool."""
        cfg = self.config
        self.block_manager = BlockManager(self.kv.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.block_manager)
        if cfg.enable_prefix_caching and self.runner.linear is not None:
            # a cached block restores the attention layers' K/V but not the linear-attention
            # state at that token: hits only within a group, from a member holding that state,
            # or by a continuation of a parked sequence (rlfuse/engine/cache/parked.py)
            self.scheduler.group_state = True
            self.scheduler.parked = Parked(self.block_manager, self.runner.release)

    # ------------------------------------------------------------------ weights
    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()
        if self.scheduler.parked is not None:
            self.scheduler.parked.clear()

    def _check_weights(self) -> None:
        v = param_version(self.model)
        if v != self._weights_version:
            self._weights_version = v
            self.reset_prefix_cache()
            self._kv_stale = self.runner.kv_quant is not None
            if self.runner.features is not None:
                self.runner.features.clear()  # image features are stale too
            log.debug("parameters changed in place: prefix cache dropped")
        switches = adapter_switches(self.model)
        if switches != self._adapters:
            # LoRA adapters attached or switched on/off: cached prefixes were computed, and
            # the decode graphs recorded, under the old forward
            self._adapters = switches
            self.reset_prefix_cache()
            self._kv_stale = self.runner.kv_quant is not None
            if self.runner.graphs and self.runner.device.type == "cuda":
                torch.cuda.synchronize(self.runner.device)  # host sync: no replay in flight when its graph goes
            self.runner.drop_graphs()
            log.info("LoRA adapters changed (%d, %d on): prefix cache and decode graphs dropped", len(switches),
                     sum(switches))

    def _calibrate_kv(self, prompts: list[list[int]]) -> None:
        """fp8 cache: recalibrate the scales if the weights changed since the last time (the
        engine is idle and the prefix cache was dropped with that change, so no cached block
        holds K/V quantized with the old scales). `prompts`: the requests about to run."""
        if self._kv_stale:
            self.runner.calibrate_kv(prompts)
            self._kv_stale = False
            self.stats.kv_calibrations += 1

    # ------------------------------------------------------------------ requests
    def _validate(self, rid: str, prompt, params, media=()) -> tuple[list[int], tuple | None]:
        """(prompt ids, (mRoPE positions, delta) of an image model's prompt, else None)."""
        ids = validate_request(rid, prompt, params, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                               max_model_len=self.max_model_len, block_manager=self.block_manager,
                               adapters=0 if self.runner.bank is None else len(self.runner.bank.names))
        return ids, admit(rid, ids, tuple(media), self.runner.vision, self.runner.mcfg.architecture)

    @property
    def adapters(self) -> tuple[str, ...]:
        """The adapter bank's names, in slot order (`SamplingParams.adapter`); () without a bank."""
        return () if self.runner.bank is None else self.runner.bank.names

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, media=()) -> str:
        """Queue a request (its `params.n` samples); returns its id. Raises ValueError naming
        the request if it is invalid; nothing is queued then. `media`: the prompt's images
        (`rlfuse.engine.media.MediaItem`s, matching its image-pad runs)."""
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        request_id = str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r}: the id is already in use")
        params = SamplingParams() if params is None else params
        ids, mrope = self._validate(request_id, prompt, params, media)
        self._enqueue(request_id, ids, params, tuple(media), mrope)
        return request_id

    def _enqueue(self, rid: str, ids: list[int], params: SamplingParams, media=(), mrope=None) -> None:
        if not self.has_unfinished():
            self._check_weights()
            self._calibrate_kv([ids])
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        base = sample_key_base(seed, ids, media)
        seqs = []
        for k in range(params.n):
            seq = Sequence(self._next_seq, rid, k, ids, params, sample_key(base, k), stop, media)
            seq.mrope = mrope  # shared by the group: computed once
            if media:
                self.runner.features.acquire(media)
            seq.max_total = min(len(ids) + params.max_tokens, self.max_model_len)
            seqs.append(seq)
            self._next_seq += 1
        self._requests[rid] = seqs
        for s in seqs:
            self.scheduler.add(s)

    def has_unfinished(self) -> bool:
        """Requests still running or waiting, or finished samples `step()` has not returned yet."""
        return self.scheduler.has_unfinished() or self._pending is not None or bool(self._ready)

    def partial(self, request_id: str, start: list[int]) -> list[tuple[list[int], list[float]]]:
        """Streaming: per sample k of a request, the output token ids sampled so far after
        the first `start[k]`, with their log-probs; empty for a finished sample (its
        Completion comes from `step()`) and for a request that is not running."""
        seqs = self._requests.get(str(request_id), [])
        out: list[tuple[list[int], list[float]]] = [([], []) for _ in start]
        for s in seqs:
            if not s.is_finished() and s.index < len(start):
                a = start[s.index]
                out[s.index] = (s.token_ids[s.num_prompt_tokens + a:], s.logprobs[a:].tolist())
        return out

    def abort(self, request_id: str) -> list[Completion]:
        """Stop a request now; returns its unfinished samples with finish_reason "abort"."""
        self._drain()
        seqs = [s for s in self._requests.pop(str(request_id), []) if not s.is_finished()]
        self.scheduler.abort(seqs)
        for s in seqs:
            self.runner.release(s)
            self._drop_media(s)
        return [completion(s, self.tokenizer) for s in seqs]

    def abort_all(self) -> None:
        """Recover from a failed `step()`: drop every request and any launched step unread
        (a failure may leave the bookkeeping half-written, so the block manager and the
        scheduler start afresh: all KV blocks free, prefix cache empty); the engine is idle."""
        self._pending, self._ready, self._requests = None, [], {}
        self.runner.reset_state()
        self._new_scheduler()
        if self.runner.features is not None:
            self.runner.features = FeatureCache(self.runner._encode)

    # ------------------------------------------------------------------ batch API
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 media: list | None = None) -> list[Completion]:
        """Complete every prompt (text, or a list of token ids; a single prompt is accepted
        too). `params`: one SamplingParams for all, or one per prompt. Returns
        len(prompts) * n Completions, prompt-major (sample k of prompt i at i * n + k when
        n is shared). All requests are validated before any runs: an invalid one raises
        ValueError naming it (request "i" is prompt i) and nothing is queued. `media`: per
        prompt, its images (a tuple of MediaItems, () for text), as in `add_request`."""
        prompts, plist = prompt_list(prompts, params)
        done = {(i, c.index): c for i, c in self.stream(prompts, plist, media)}
        return [done[(i, k)] for i, p in enumerate(plist) for k in range(p.n)]

    def stream(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, media: list | None = None):
        """`generate`, yielding (prompt index, Completion) as each sample finishes, between
        engine steps: the caller's work between two yields runs while the engine is paused
        (on CUDA, its own kernels on another stream overlap the queued decode step). The
        same requests and steps as `generate`, so the same completions. Validation happens
        at the first `next()`, before anything is queued."""
        prompts, plist = prompt_list(prompts, params)
        if self.has_unfinished():
            raise RuntimeError("LLM.generate needs an idle engine: finish or abort the streaming requests first")
        errors, checked = [], []
        media = [()] * len(prompts) if media is None else [tuple(m) for m in media]
        if len(media) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(media)} media entries")
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            try:
                checked.append(self._validate(f"{i}", prompt, p, media[i]))
            except ValueError as e:  # collect all, report together
                errors.append(str(e))
        if errors:
            raise ValueError("; ".join(errors))
        t0, out0 = time.perf_counter(), self.stats.output_tokens
        self._check_weights()
        self._calibrate_kv([ids for ids, _ in checked])  # fp8 cache: on all the prompts, not the first alone
        index = {}
        for i, ((ids, mrope), p) in enumerate(zip(checked, plist)):
            rid = f"gen-{self._next_id}-{i}"
            self._enqueue(rid, ids, p, media[i], mrope)
            index[rid] = i
        self._next_id += 1
        n_done = 0
        while self.has_unfinished():
            for c in self.step():
                n_done += 1
                yield index[c.request_id], c
        n_out, dt = self.stats.output_tokens - out0, time.perf_counter() - t0
        log.info("generate: %d completions, %d tokens in %.2f s (%.0f tok/s)", n_done, n_out, dt,
                 n_out / max(dt, 1e-9))

    # ------------------------------------------------------------------ sleep / wake
    def sleep(self) -> None:
        """Free the KV pool and the CUDA graphs' memory (training phase). Running requests
        are preempted and resume by recompute after wake()."""
        if self.asleep:
            return
        self._drain()
        for s in self.scheduler.preempt_all():
            self.runner.release(s)
        self.reset_prefix_cache()  # parked sequences (hybrids) give back their state slots too
        self.runner.drop_graphs()
        self.kv.release()
        if (lin := self.runner.linear) is not None:  # a hybrid's linear-attention state (GiBs at 2B)
            lin.release()
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True
        log.info("engine asleep: KV pool of %.2f GiB released", self.kv.nbytes / 1024**3)

    def wake(self) -> None:
        """Re-create the KV pool (same number of blocks); graphs are recaptured on use."""
        if not self.asleep:
            return
        self.kv.allocate()
        if self.runner.linear is not None:  # zeroed, every slot free
            self.runner.linear.allocate()
        self.block_manager.reset_prefix_cache()
        self.asleep = False
        log.info("engine awake: KV pool of %.2f GiB allocated", self.kv.nbytes / 1024**3)

    def capture_graphs(self, up_to: int | None = None) -> None:
        """Capture the decode CUDA graphs now (all, or those batches of at most `up_to`
        sequences use): keeps capture out of benchmark timings, and out of the time another
        thread launches work (a capture forbids that thread some CUDA calls)."""
        if self.asleep:
            raise RuntimeError("LLM.capture_graphs: the engine is asleep; call wake() first")
        self.runner.capture_graphs(up_to)
