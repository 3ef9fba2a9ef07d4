"""One sequence (one of the `n` samples of a request) and the finished `Completion`.

A Sequence owns its token ids (prompt + output so far), its block table (KV-cache block
ids, one per `block_size` tokens) and how many of its tokens already have K/V in the
cache (`num_computed`). An image-text prompt also carries its images (`media`, each with
its pad-token run and media hash) and its multimodal RoPE positions (`mrope`: (3, prompt)
positions and the decode delta, rlfuse.engine.media), set once at admission. Invariant: the last sampled token is never computed before the
next step feeds it, so a running sequence always has num_computed < num_tokens.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from array import array

import torch

from rlfuse.engine.config import SamplingParams, logprob_temperature
from rlfuse.engine.media import MediaItem, block_media, media_key


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(slots=True)
class Completion:
    """One finished sample.

    `logprobs[i]` is log softmax(logits / temperature)[output_token_ids[i]] under the
    weights at sampling time, BEFORE top-k/top-p/min-p filtering and min_tokens masking
    (temperature 1 for greedy requests): the policy the trainer optimizes, computed by
    the trainer's own function `rlfuse.kernels.loss.logprob.token_logprobs`. fp32, CPU.
    """
    request_id: str
    index: int
    """Sample index within the request (0..n-1)."""
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logprobs: torch.Tensor
    finish_reason: str
    """"stop" (EOS, a stop id or a stop string), "length" (max_tokens or the context) or "abort"."""
    text: str | None = None
    num_cached_prompt_tokens: int = 0
    """Prompt tokens whose K/V came from the prefix cache at first admission."""
    routing: torch.Tensor | None = None
    """MoE models with EngineConfig.record_routing: (len(output_token_ids), MoE layers, k)
    int16, the experts each layer picked for the row that produced each sampled token
    (the position before it), in layer order; None when not recorded."""

    @property
    def token_ids(self) -> list[int]:
        return self.output_token_ids


class Sequence:
    __slots__ = ("seq_id", "request_id", "index", "params", "token_ids", "num_prompt_tokens", "status",
                 "block_table", "num_computed", "num_ready_blocks", "block_hashes", "logprobs", "finish_reason",
                 "seed", "temperature_lp", "stop_ids", "num_cached_prompt", "row", "row_len", "max_total", "routing",
                 "state_from", "media", "mrope")

    def __init__(self, seq_id: int, request_id: str, index: int, prompt: list[int], params: SamplingParams,
                 seed: int, stop_ids: frozenset[int], media: tuple[MediaItem, ...] = ()):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.params = params
        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_computed = 0       # tokens with K/V in the cache
        self.num_ready_blocks = 0   # leading blocks whose K/V is complete (shareable)
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks, grown lazily
        self.logprobs = array("f")
        self.finish_reason: str | None = None
        self.seed = seed
        self.temperature_lp = logprob_temperature(params.temperature)
        self.stop_ids = stop_ids    # EOS (unless ignore_eos) + stop_token_ids
        self.num_cached_prompt = -1  # prefix-cache hits at first admission (-1: not admitted yet)
        self.row = -1               # row in the model runner's block-table buffer
        self.row_len = 0            # block-table entries already written to that row
        self.max_total = 1 << 62    # length at which it stops ("length"): set by the engine
        self.routing: list[torch.Tensor] = []  # per sampled token (layers, k), when the engine records routing
        self.state_from: Sequence | None = None  # hybrid models: the group member whose state it starts from
        self.media = media          # the prompt's images (shared by the group's samples), in token order
        self.mrope: tuple[torch.Tensor, int] | None = None  # ((3, prompt) positions, delta): at admission

    @property
    def rope_delta(self) -> int:
        """Position of the token at index i >= prompt is i + rope_delta (0 for text prompts)."""
        return 0 if self.mrope is None else self.mrope[1]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def to_completion(self, text: str | None) -> Completion:
        return Completion(self.request_id, self.index, self.token_ids[:self.num_prompt_tokens],
                          self.output_token_ids, torch.frombuffer(bytearray(self.logprobs), dtype=torch.float32)
                          if len(self.logprobs) else torch.zeros(0), self.finish_reason, text,
                          max(self.num_cached_prompt, 0), torch.stack(self.routing) if self.routing else None)

    def __repr__(self):
        return (f"Sequence({self.request_id}#{self.index}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed}, blocks={self.block_table})")


def sample_key_base(seed: int, prompt: list[int], media: tuple[MediaItem, ...] = ()) -> bytes:
    # the images' hashes join the key (b"" for text): equal ids with other images draw anew
    return hashlib.blake2b(seed.to_bytes(8, "little") + array("q", prompt).tobytes() + media_key(media),
                           digest_size=16).digest()


def block_extra(seq: Sequence, block: int, block_size: int) -> bytes:
    """The media hashes a block's prefix-cache key chains after its ids (b"" for text)."""
    return block_media(seq.media, block, block_size) if seq.media else b""


def sample_key(base: bytes, k: int) -> int:
    """63-bit sampling key of sample k: a hash of (seed, prompt tokens, images, k), so the draws of a
    sequence depend on nothing else (not the batch, not other prompts sharing the seed)."""
    return int.from_bytes(hashlib.blake2b(base + k.to_bytes(8, "little"), digest_size=8).digest(), "little") >> 1


# ---------------------------------------------------------------------- stops and results
def stop_reason(seq: Sequence, tok: int, tokenizer) -> str | None:
    """Why `seq` ends after sampling `tok` ("stop": a stop id or stop string once min_tokens
    are out; "length": max_tokens or the context), or None."""
    p, n_out = seq.params, seq.num_output_tokens
    if n_out >= p.min_tokens:
        if tok in seq.stop_ids:
            return "stop"
        if p.stop and stop_string(seq, tokenizer) is not None:
            return "stop"
    if seq.num_tokens >= seq.max_total:  # max_tokens or the context length
        return "length"
    return None


def stop_string(seq: Sequence, tokenizer, text: str | None = None) -> int | None:
    """Index in `text` (default: the decoded tail) of the first stop string, or None."""
    if text is None:
        # a stop string of c characters spans at most 4c byte-level tokens; it is checked
        # every step, so it can only newly appear at the tail
        w = 4 * max(len(s) for s in seq.params.stop) + 4
        text = tokenizer.decode(seq.output_token_ids[-w:])
    hits = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
    return min(hits) if hits else None


def completion(seq: Sequence, tokenizer) -> Completion:
    """The finished `seq` as a Completion, its text decoded (and cut at a stop string) when
    there is a tokenizer."""
    text = None
    if tokenizer is not None:
        text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
        if seq.params.stop and seq.finish_reason == "stop":
            cut = stop_string(seq, tokenizer, text)
            if cut is not None:
                text = text[:cut]
    return seq.to_completion(text)


def prompt_list(prompts, params) -> tuple[list, list[SamplingParams]]:
    """`LLM.generate`'s arguments as (prompts, one SamplingParams per prompt): a single prompt
    (text or token ids) becomes a list of one; one SamplingParams (or None) is shared."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
    if len(plist) != len(prompts):
        raise ValueError(f"generate: {len(prompts)} prompts but {len(plist)} SamplingParams")
    return prompts, plist


def validate_request(rid: str, prompt, params, *, tokenizer, vocab_size: int, max_model_len: int,
                     block_manager, adapters: int = 0) -> list[int]:
    """A request's prompt ids, or a ValueError naming the request and what is wrong (before
    anything is queued)."""
    def bad(msg):
        return ValueError(f"request {rid!r}: {msg}")
    if not isinstance(params, SamplingParams):
        raise bad(f"params must be a SamplingParams, got {type(params).__name__}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise bad("a text prompt needs a tokenizer (LLM(model, tokenizer, ...)); pass token ids instead")
        ids = list(tokenizer.encode(prompt))
    else:
        ids = list(prompt)
    if not ids:
        raise bad("the prompt is empty")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise bad(f"prompt token ids must be ints in [0, {vocab_size})")
    if not all(t < vocab_size for t in params.stop_token_ids):
        raise bad(f"stop_token_ids must be in [0, {vocab_size}), got {list(params.stop_token_ids)}")
    if len(ids) >= max_model_len:
        raise bad(f"the prompt has {len(ids)} tokens; max_model_len {max_model_len} leaves no room "
                  f"for output")
    if params.stop and tokenizer is None:
        raise bad("stop strings need a tokenizer")
    if params.adapter is not None and params.adapter >= adapters:
        raise bad(f"adapter slot {params.adapter}: the model's adapter bank has {adapters} slots"
                  + ("" if adapters else " (no bank: rlfuse.model.lora_bank.load_adapter_bank)"))
    need = block_manager.blocks_for(min(len(ids) + params.max_tokens, max_model_len))
    if need > block_manager.num_blocks:
        raise bad(f"needs {need} KV blocks, the pool has {block_manager.num_blocks}")
    return ids
