"""Build the run's objects from a RunConfig: device, tokenizer, model, engine.

Every automatic choice is logged with its reason (device "auto", tokenizer source,
vocabulary size of a random model). The model is built once; the engine is constructed
on that same object (no copy), so trainer updates are what the next rollout uses.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from rlfuse.engine import IMAGE_TOKENS, LLM, EngineConfig
from rlfuse.kernels.backend import set_backend, triton_available, triton_interpreting
from rlfuse.model import CausalLM, ModelConfig
from rlfuse.model.config import check_kernel_support
from rlfuse.model.lora import attach_lora, has_lora, lora_memory
from rlfuse.model.lora_peft import load_peft_adapter
from rlfuse.model.tokenizer import Tokenizer
from rlfuse.model.vision import VisionConfig
from rlfuse.model.weights import parse_dtype
from rlfuse.run.config.sections import ModelSpec
from rlfuse.run.distributed.build import build_sharded_random, init_keyed, load_sharded_folder
from rlfuse.run.distributed.context import DistContext
from rlfuse.run.distributed.fsdp import shard_model
from rlfuse.run.resume import load_model_folder, model_folder

log = logging.getLogger(__name__)

CHAR_SPECIALS = ("<pad>", "<eos>", "<unk>")


SMALL_MODEL_PARAMS = 20_000_000
"""Below this many parameters a CPU run takes 1 thread: the ops are too small to gain from
intra-op threads (the demo's 0.4M-parameter model: 14.3 s at 2 threads on a busy 2-core box
against 1.1 s at 1, issue 37)."""
_threads_set_by: list[str] = []  # who set torch's CPU threads in this process (the first says it)


def choose_threads(n_params: int | None = None) -> tuple[int, str]:
    """torch CPU threads for a run nobody chose them for, and why: 1 for a model below
    SMALL_MODEL_PARAMS; else the idle cores (the cores less the 1-minute load average, at
    least 1, at most torch's default), since threads that share cores with other jobs wait
    on each other at every op."""
    if n_params is not None and n_params < SMALL_MODEL_PARAMS:
        return 1, f"a {n_params / 1e6:.1f}M-parameter model gains nothing from intra-op threads"
    cores = torch.get_num_threads()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform: torch's default
        return cores, "torch's default, one per core"
    idle = max(1, min(cores, cores - round(load)))
    return idle, f"{cores} cores, 1-minute load average {load:.1f}"


def set_threads(n: int, why: str) -> None:
    """Set torch's CPU threads and log the choice with its reason (`threads_chosen()` is then true)."""
    torch.set_num_threads(n)
    _threads_set_by.append(why)
    log.info("torch CPU threads: %d (%s; --threads N or RLFUSE_THREADS=N to change)", n, why)


def threads_chosen() -> bool:
    """Whether this process already chose torch's CPU threads (`set_threads`)."""
    return bool(_threads_set_by)


def pick_device(spec: str, what: str = "model.device") -> torch.device:
    """model.device (or the option `what`) as a torch.device; a device this machine does not
    have is a ValueError."""
    if spec == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        log.info("device auto -> %s (%s)", dev, "CUDA available" if dev.type == "cuda" else "no CUDA device")
        return dev
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"{what}: {spec!r} is not a device; expected auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{what}: {spec!r} is not supported; expected auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"{what}: {spec!r} asked for, but this machine has no usable CUDA device "
                             f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                             f"use {what}{':' if '.' in what else ''} cpu (or auto)")
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"{what}: {spec!r} asked for, but this machine has {n} CUDA device(s) "
                             f"(cuda:0..cuda:{n - 1})")
    return dev


def check_backend(backend: str, device: torch.device) -> None:
    """model.kernel_backend must be runnable here: "triton" needs triton installed, and on
    CPU tensors Triton's interpreter (TRITON_INTERPRET=1 in the environment at start)."""
    if backend != "triton":
        return
    if not triton_available():
        raise ValueError("model.kernel_backend: 'triton' asked for, but triton is not installed "
                         "(pip install triton, or use model.kernel_backend: auto / torch)")
    if device.type == "cpu" and not triton_interpreting():
        raise ValueError("model.kernel_backend: 'triton' on cpu runs only under Triton's interpreter "
                         "(TRITON_INTERPRET=1 set before start; slow, for tests); use model.kernel_backend: "
                         "auto or torch on cpu")


def char_tokenizer(alphabet: str, *, control: tuple[str, ...] = (), phrases: tuple[str, ...] = (),
                   chat_template: str | None = None) -> Tokenizer:
    """A character-level tokenizer built in memory: ids 0..2 = <pad>, <eos>, <unk>, then
    one id per character of `alphabet` (sorted, deduplicated), then the `control` tokens
    (special: a chat template's markers) and the `phrases` (one id per fixed string, e.g.
    the tool-call scaffolding of rlfuse.rollout.agent.chat.char_chat_tokenizer)."""
    vocab = {t: i for i, t in enumerate(CHAR_SPECIALS)}
    for c in sorted(set(alphabet)):
        vocab.setdefault(c, len(vocab))
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    if control:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if phrases:
        backend.add_tokens([AddedToken(t, normalized=False) for t in phrases])
    return Tokenizer(backend, eos_token="<eos>", pad_token="<pad>", special_tokens={"unk_token": "<unk>"},
                     generation_config={"eos_token_id": 1, "pad_token_id": 0}, chat_template=chat_template,
                     source="char tokenizer")


def build_tokenizer(spec: ModelSpec, alphabet: str = "") -> Tokenizer:
    if spec.tokenizer == "char":
        if not alphabet:
            raise ValueError("model.tokenizer: 'char' builds its alphabet from the data's text, and there is none")
        # a random vision-language model: the image markers are tokens too (rlfuse.engine.media)
        tok = char_tokenizer(alphabet, control=IMAGE_TOKENS if (spec.random_init or {}).get("vision") else ())
        log.info("tokenizer: character-level over %d characters (model.tokenizer=char)", len(set(alphabet)))
        return tok
    folder = spec.tokenizer or spec.path
    if not folder:
        raise ValueError("model.tokenizer: give a tokenizer folder, 'char', or model.path")
    check_model_folder(folder, "model.tokenizer" if spec.tokenizer else "model.path")
    return Tokenizer.from_pretrained(model_folder(folder))  # a training checkpoint's too


def check_model_folder(path: str, what: str = "model.path") -> None:
    """A missing or non-folder `path` is said so, before anything reads inside it."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{what}: {p}: no such model folder (expected an HF folder with config.json and "
                         f"*.safetensors{', e.g. the final/ of an earlier run' if 'final' in p.parts else ''})")
    if not p.is_dir():
        raise ValueError(f"{what}: {p} is a file; expected an HF model folder (config.json, *.safetensors)")


def random_model_config(spec: ModelSpec, tokenizer: Tokenizer, device: torch.device) -> ModelConfig:
    """The ModelConfig of model.random_init (vocab from the tokenizer, checked against the
    kernels and the tokenizer)."""
    if spec.init not in ("stream", "keyed"):
        raise ValueError(f"model.init: expected stream or keyed, got {spec.init!r}")
    dtype = parse_dtype(spec.dtype)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    bad = [k for k in spec.random_init if k not in fields]
    if bad:
        raise ValueError(f"model.random_init.{bad[0]}: unknown ModelConfig field; valid: {sorted(fields)}")
    kw = {"model_type": "qwen3", "tie_word_embeddings": True, **spec.random_init}
    vocab = -(-tokenizer.vocab_size // 8) * 8
    if "vocab_size" not in kw:
        log.info("random model: vocab_size %d (tokenizer's %d rounded up to a multiple of 8)",
                 vocab, tokenizer.vocab_size)
    kw.setdefault("vocab_size", vocab)
    kw.setdefault("eos_token_id", tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None)
    kw.setdefault("pad_token_id", tokenizer.pad_token_id)
    kw["torch_dtype"] = str(dtype).replace("torch.", "")
    if isinstance(kw.get("vision"), dict):
        kw["vision"] = _random_vision(kw["vision"], tokenizer)
    if kw.get("mrope_section") is not None:
        kw["mrope_section"] = tuple(kw["mrope_section"])
    try:
        cfg = ModelConfig(**kw)
    except (TypeError, ValueError) as e:  # ModelConfig's own messages name the field, not the recipe key
        raise ValueError(f"model.random_init: {e}") from None
    check_kernel_support(cfg, spec.kernel_backend, device.type, "model.random_init")
    check_vocab(cfg.vocab_size, tokenizer, "model.random_init")
    return cfg


def build_model(spec: ModelSpec, tokenizer: Tokenizer, device: torch.device, seed: int = 0) -> CausalLM:
    set_backend(spec.kernel_backend)
    check_backend(spec.kernel_backend, device)
    dtype = parse_dtype(spec.dtype)
    if spec.path and spec.random_init:
        raise ValueError("model: give either model.path or model.random_init, not both")
    if spec.path:
        check_model_folder(spec.path)
        # HF folder or a checkpoint
        model = load_model_folder(spec.path, device=device, dtype=dtype, text_only=spec.text_only)
        config_json = model_folder(spec.path) / "config.json"
        check_kernel_support(model.config, spec.kernel_backend, device.type, str(config_json))
        check_vocab(model.config.vocab_size, tokenizer, str(config_json))
    elif spec.text_only:
        raise ValueError("model.text_only: loads a folder's text tower (model.path); with model.random_init give "
                         "the text model's fields instead")
    elif spec.random_init:
        cfg = random_model_config(spec, tokenizer, device)
        if spec.init == "keyed":  # drawn on `device`, as each rank of a sharded build draws its rows
            with torch.device("meta"):
                model = CausalLM(cfg)
            model = model.to_empty(device=device)
            init_keyed(model, seed)
            model = model.to(dtype)
        else:
            model = CausalLM(cfg)
            model.init_weights(generator=torch.Generator().manual_seed(seed))
            model = model.to(device=device, dtype=dtype)
        n = sum(p.numel() for p in model.parameters())
        log.info("random %s model: %d layers, hidden %d, %.2fM params, %s on %s", cfg.model_type,
                 cfg.num_hidden_layers, cfg.hidden_size, n / 1e6, dtype, device)
    else:
        raise ValueError("model: set model.path (an HF folder) or model.random_init (ModelConfig fields)")
    model.gradient_checkpointing = spec.gradient_checkpointing
    return model


def build_sharded(spec: ModelSpec, tokenizer: Tokenizer, ctx: DistContext, seed: int = 0) -> CausalLM:
    """The data-parallel model, FSDP2-sharded, built on the meta device with each rank
    materializing only its rows (rlfuse.run.distributed.build): an HF folder (model.path)
    read shard by shard, or model.random_init with model.init keyed drawn shard by shard.
    The masters equal `shard_model(build_model(...))`'s bitwise. Another model (a training
    checkpoint's sharded dcp/ folder, the stream init) is built whole and then sharded.
    Collective."""
    dtype = parse_dtype(spec.dtype)
    if spec.path and spec.random_init:
        raise ValueError("model: give either model.path or model.random_init, not both")
    folder = model_folder(spec.path) if spec.path else None
    if (folder is not None and (folder / "dcp").is_dir()) or (folder is None and spec.init != "keyed"):
        if folder is None and ctx.is_main:
            log.info("model.init stream: every rank builds the whole random model, then shards it; "
                     "model.init: keyed draws only each rank's rows (an 8B: 113 s streamed on 4 H200s, 10 s keyed on 2), "
                     "other values than stream's")
        return shard_model(build_model(spec, tokenizer, ctx.device, seed=seed), ctx)
    set_backend(spec.kernel_backend)
    check_backend(spec.kernel_backend, ctx.device)
    if folder is not None:
        check_model_folder(spec.path)
        config_json = folder / "config.json"
        cfg = ModelConfig.from_hf(folder, text_only=spec.text_only)
        check_kernel_support(cfg, spec.kernel_backend, ctx.device.type, str(config_json))
        check_vocab(cfg.vocab_size, tokenizer, str(config_json))
        model = load_sharded_folder(folder, ctx, dtype=dtype, text_only=spec.text_only)
    else:
        model = build_sharded_random(random_model_config(spec, tokenizer, ctx.device), ctx, dtype=dtype, seed=seed)
    model.gradient_checkpointing = spec.gradient_checkpointing
    return model


def apply_lora(model: CausalLM, spec: ModelSpec, seed: int = 0) -> None:
    """model.lora onto `model` (in place, before any engine or optimizer is built on it):
    adapters from model.lora.path (a PEFT folder), else fresh ones (PEFT's init from
    `seed`); every base parameter frozen. A model that has adapters already (a caller's)
    is left as it is."""
    if spec.lora is None or has_lora(model):
        return
    if spec.lora.path:
        load_peft_adapter(model, spec.lora.path, spec.lora, what="model.lora.path")
    else:
        attach_lora(model, spec.lora, seed=seed)
    mem = lora_memory(model)
    log.info("LoRA: %.2fM trainable parameters, %.2fM frozen; %.2f GiB of training state (gradients, fp32 "
             "masters, Adam moments) not kept for the base, by formula", mem["lora/trainable_params"] / 1e6,
             mem["lora/frozen_params"] / 1e6, mem["lora/saved_train_state_gib"])


def _random_vision(fields: dict, tokenizer: Tokenizer) -> VisionConfig:
    """model.random_init.vision (VisionConfig fields) with the image-token ids the tokenizer
    gives the markers (rlfuse.engine.media.IMAGE_TOKENS) where not set."""
    ids = {}
    for name, tok in zip(("vision_start_token_id", "image_token_id", "vision_end_token_id"), IMAGE_TOKENS):
        got = tokenizer.encode(tok, add_special_tokens=False)
        if len(got) == 1:
            ids[name] = got[0]
    kw = {**ids, "video_token_id": ids.get("image_token_id", 0), **fields}
    if "deepstack_visual_indexes" in kw:
        kw["deepstack_visual_indexes"] = tuple(kw["deepstack_visual_indexes"])
    try:
        return VisionConfig(**kw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"model.random_init.vision: {e}") from None


def check_vocab(vocab_size: int, tokenizer: Tokenizer, where: str) -> None:
    """The model's embedding must have a row for every id the tokenizer can produce."""
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"{where}: vocab_size is {vocab_size}, smaller than the tokenizer's {tokenizer.vocab_size} "
                         f"ids: ids {vocab_size}..{tokenizer.vocab_size - 1} would index past "
                         f"the embedding; expected vocab_size >= {tokenizer.vocab_size} (a tokenizer of another model?)")


def build_engine(model: CausalLM, tokenizer: Tokenizer, engine: EngineConfig) -> LLM:
    """rlfuse.engine.LLM on the live model object."""
    return LLM(model, tokenizer, engine)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
