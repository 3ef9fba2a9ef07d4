"""Hugging Face safetensors checkpoints: load onto the target device, save loadable by
`transformers.AutoModelForCausalLM.from_pretrained` unchanged.

Loading builds the module on the meta device, allocates it once on the target device
and copies one tensor at a time out of the memory-mapped files, so host memory never
holds a second full copy. Missing or unexpected tensors and shape mismatches raise
ValueError naming the tensor and file.

A checkpoint's names may differ from ours by a prefix (`ArchSpec.checkpoint_prefixes`: a
Qwen3.5 multimodal folder loaded `text_only` keeps the text tower under `model.language_model.`)
and hold parts rlfuse does not load (`ArchSpec.skipped_prefixes`: the vision tower when
`text_only`, and the multi-token-prediction head, each logged in one line); a text model is
saved under plain text-model names, which transformers loads for both classes. Without
`text_only` a Qwen3.5 multimodal folder loads as the vision-language model
(`arch.qwen3_5_vl`), vision tower included, said in one line.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rlfuse.model.arch import ARCHS, ArchSpec
from rlfuse.model.causal_lm import CausalLM
from rlfuse.model.config import TEXT_TOWERS, ModelConfig
from rlfuse.model.layers.moe import EXPERT_PARAMS, copy_expert_tensors, named_blocks, per_expert_names, published_layout

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# files we carry along when saving next to the weights (tokenizer and generation settings)
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "chat_template.jinja", "vocab.json", "merges.txt")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


@contextlib.contextmanager
def _open(path: Path, device: str = "cpu"):
    """safe_open with a ValueError naming the file when it is cut short or not safetensors
    (safetensors' own error is "Error while deserializing header: ..." without the file)."""
    try:
        with safe_open(path, framework="pt", device=device) as f:
            yield f
    except SafetensorError as e:
        size = path.stat().st_size if path.exists() else 0
        raise ValueError(f"{path}: incomplete or not a safetensors file ({size} bytes; {e}): it was probably cut "
                         f"short (an interrupted download, copy or save); fetch or write it again") from None


def _weight_files(folder: Path) -> dict[str, Path]:
    """tensor name -> file, from model.safetensors or a sharded index."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: expected a JSON object with a 'weight_map' field ({e})") from None
        return {name: folder / fname for name, fname in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise ValueError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    with _open(single) as f:
        return {name: single for name in f.keys()}


def load_model(folder: str | Path, *, device: str | torch.device = "cpu",
               dtype: str | torch.dtype | None = None, text_only: bool = False) -> CausalLM:
    """Load an HF checkpoint folder. dtype defaults to the config's torch_dtype. text_only:
    a multimodal folder's text tower alone (`ModelConfig.from_hf`)."""
    folder = Path(folder)
    cfg = ModelConfig.from_hf(folder, text_only=text_only)
    if cfg.model_type in TEXT_TOWERS:  # the one line saying which of the two this folder gave
        log.info("%s: loading %s with its vision tower (text_only loads the text tower alone)", folder,
                 cfg.architecture)
    dtype = parse_dtype(dtype or cfg.torch_dtype)
    with torch.device("meta"):
        model = CausalLM(cfg).to(dtype)
    model = model.to_empty(device=device)
    load_state_dict_from_files(model, folder)
    log.info("loaded %s (%s, %d layers) from %s to %s in %s", cfg.architecture, cfg.model_type,
             cfg.num_hidden_layers, folder, device, dtype)
    return model


def hf_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of what an HF checkpoint folder holds: every parameter but an
    adapter's (a module lists those in its `adapter_params`; they are saved as a PEFT
    folder, `rlfuse.model.lora_peft`)."""
    skip = {f"{mn}.{pn}" for mn, m in model.named_modules() for pn in getattr(m, "adapter_params", ())}
    return [(n, p) for n, p in model.named_parameters() if n not in skip]


def checkpoint_names(model: torch.nn.Module) -> Callable[[str], str]:
    """Our parameter name -> the checkpoint's, by the model's architecture (`ArchSpec.checkpoint_name`)."""
    return ARCHS[model.config.model_type].checkpoint_name


def _plan(model: CausalLM, folder: Path) -> tuple[dict, dict[Path, list[str]], dict[str, str]]:
    """(checkpoint name -> parameter, file -> names to read, name -> its name inside the file),
    with the folder's tensors checked against the model's (unexpected or missing ones named)."""
    name = checkpoint_names(model)
    params = {name(n): p for n, p in hf_parameters(model)}
    files, stored = _mapped_names(_weight_files(folder), ARCHS[model.config.model_type], folder)
    _load_per_expert_layout(model, name, params, files, stored, folder)
    tied = model.lm_head is None
    unexpected = [n for n in files if n not in params and not (tied and n == "lm_head.weight")
                  and not n.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise ValueError(f"{folder}: unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} "
                         f"(in {files[unexpected[0]].name})")
    missing = [n for n in params if n not in files]
    if missing:
        raise ValueError(f"{folder}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if name in params:
            by_file.setdefault(path, []).append(name)
    return params, by_file, stored


@torch.no_grad()
def load_state_dict_from_files(model: CausalLM, folder: Path) -> None:
    params, by_file, stored = _plan(model, folder)
    device = next(iter(params.values())).device
    for path, names in by_file.items():
        with _open(path, str(device) if device.type != "meta" else "cpu") as f:
            for name in names:
                t = f.get_tensor(stored[name])
                p = params[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"{path}: tensor {stored[name]!r} has shape {tuple(t.shape)}, "
                                     f"the config expects {tuple(p.shape)}")
                p.copy_(t)


def _load_per_expert_layout(model: torch.nn.Module, name: Callable[[str], str], params: dict,
                            files: dict[str, Path], stored: dict[str, str], folder: Path) -> None:
    """MoE blocks stored one expert per tensor (published checkpoints, transformers'
    save_pretrained): copied into the fused parameters here, then left out of `params` and
    `files` so the name checks that follow see neither."""
    for our_prefix, block in named_blocks(model):
        fused = [name(our_prefix + n) for n in EXPERT_PARAMS]  # checkpoint names
        prefix = fused[0][:-len(EXPERT_PARAMS[0])]
        if fused[0] in files or fused[0] not in params:
            continue  # the fused layout (loaded by name), or expert weights not in the checkpoint (adapters)
        names = per_expert_names(prefix, block.num_experts)
        with contextlib.ExitStack() as stack:
            handles: dict[Path, object] = {}
            device = params[fused[0]].device

            def get(tensor_name, handles=handles, stack=stack, device=device):  # bound: called in this iteration
                if tensor_name not in files:
                    return None
                f = files[tensor_name]
                if f not in handles:
                    handles[f] = stack.enter_context(_open(f, str(device)))
                return handles[f].get_tensor(stored.get(tensor_name, tensor_name))

            copy_expert_tensors(get, prefix, params[fused[0]], params[fused[1]], where=str(folder))
        for n in fused:
            del params[n]
        for n in names:
            del files[n]


def _mapped_names(files: dict[str, Path], spec: ArchSpec,
                      folder: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """(our tensor name -> file, our name -> the name inside the file): the checkpoint's
    names mapped to ours; skipped parts dropped, each logged in one line."""
    out: dict[str, Path] = {}
    stored: dict[str, str] = {}
    renames = spec.checkpoint_prefixes
    skipped: dict[str, int] = {}
    for name, path in files.items():
        what = next((w for p, w in spec.skipped_prefixes if name.startswith(p)), None)
        if what is not None:
            skipped[what] = skipped.get(what, 0) + 1
            continue
        ours = next((mine + name[len(p):] for p, mine in renames if name.startswith(p)), name)
        out[ours], stored[ours] = path, name
    for what, n in skipped.items():
        if spec.has_vision:
            log.info("%s: its %s (%d tensors) is not loaded", folder, what, n)
        else:
            vl = any(w in ARCHS for w in spec.text_tower_of)  # the wrapper loads as a VL model without text_only
            note = ("" if what != "vision tower" else " (text_only)" if vl else
                    " (images and video are not supported yet)")
            log.info("%s: loading the text model only; its %s (%d tensors) is not loaded%s", folder, what, n, note)
    return out, stored


def save_model(model: CausalLM, folder: str | Path, *, tokenizer_dir: str | Path | None = None,
               max_shard_bytes: int = 5 * 1024**3, dtype: str | torch.dtype | None = None,
               tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write config.json + safetensors (sharded with an index above `max_shard_bytes`),
    atomically: into a temporary sibling folder, then renamed over `folder`. The weights
    are `hf_parameters(model)`, or `tensors` (name -> tensor, e.g. LoRA merged in)."""
    folder = Path(folder)
    with atomic_folder(folder) as tmp:
        named = hf_parameters(model) if tensors is None else list(tensors.items())
        name = checkpoint_names(model)
        named = published_layout([(name(n), x) for n, x in named])
        _write_weights(named, tmp, max_shard_bytes, None if dtype is None else parse_dtype(dtype))
        cfg = model.config.to_hf()
        out_dtype = parse_dtype(dtype) if dtype is not None else model.lm_head_weight.dtype
        cfg["torch_dtype"] = cfg["dtype"] = str(out_dtype).replace("torch.", "")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        copy_side_files(tokenizer_dir, tmp)
        if not (tmp / "generation_config.json").exists():
            gen = {"bos_token_id": model.config.bos_token_id, "eos_token_id": model.config.eos_token_id}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return folder


def copy_side_files(tokenizer_dir: str | Path | None, folder: Path) -> None:
    """The tokenizer and generation files of `tokenizer_dir` (SIDE_FILES) into `folder`."""
    if tokenizer_dir is None:
        return
    for name in SIDE_FILES:
        src = Path(tokenizer_dir) / name
        if src.exists():
            shutil.copy2(src, folder / name)


@contextlib.contextmanager
def atomic_folder(folder: Path):
    """Yield a temporary sibling of `folder` to fill; on success it is renamed over
    `folder` (an old one moved aside first, removed last), on an error it is removed."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    # not tempfile.mkdtemp: its 0700 mode would stay on the renamed folder, private to this user
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        if folder.exists():
            old = folder.with_name(f".{folder.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old)
        else:
            os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@functools.cache
def _file_mode() -> int:
    # The process umask, read once (os.umask can only be read by setting it).
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def save_tensors_file(tensors: dict[str, torch.Tensor], path: Path, meta: dict) -> None:
    """safetensors' save_file creates its file with mode 0600; give it the mode any other
    file of the run gets (0666 less the umask), so a checkpoint is as readable as its folder."""
    save_file(tensors, path, metadata=meta)
    os.chmod(path, _file_mode())


def _write_weights(named: list[tuple[str, torch.Tensor]], folder: Path, max_shard_bytes: int,
                   dtype: torch.dtype | None) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, p in named:
        t = p.detach()
        if dtype is not None:
            t = t.to(dtype)
        t = t.contiguous().cpu()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view into a larger buffer (fused projections): safetensors refuses shared storage
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_tensors_file(shards[0], folder / "model.safetensors", meta)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_tensors_file(shard, folder / fname, meta)
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


@torch.no_grad()
def load_rows_from_files(model: CausalLM, folder: str | Path, shard_of: Callable,
                         via: torch.dtype | None = None) -> None:
    """Fill a model whose parameters are dim-0 shards (FSDP2) from an HF folder, each
    tensor read only for its rows (safetensors slices: no full copy in memory).
    `shard_of(parameter)` -> (the local tensor to fill, its first global row); the rows
    are read in the file's dtype, rounded to `via` when given (the run dtype: fp32 masters
    then hold the run-dtype values, as `load_model` + `shard_model` give), cast by the copy."""
    folder = Path(folder)
    params, by_file, stored = _plan(model, folder)
    for path, names in by_file.items():
        with _open(path) as f:
            for name in names:
                p = params[name]
                local, row0 = shard_of(p)
                sl = f.get_slice(stored[name])
                if tuple(sl.get_shape()) != tuple(p.shape):
                    raise ValueError(f"{path}: tensor {stored[name]!r} has shape {tuple(sl.get_shape())}, "
                                     f"the config expects {tuple(p.shape)}")
                if local.numel():
                    rows = sl[row0:row0 + local.shape[0]]
                    local.copy_(rows if via is None else rows.to(via))
