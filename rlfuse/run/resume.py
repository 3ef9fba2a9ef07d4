"""Reading checkpoints back: verify a checkpoint folder, pick the one to resume from
(`resolve_resume`: leftovers of an interrupted save removed, the newest intact one, a
fallback to the previous one said so), load it into a plain or sharded run across
layouts and world sizes, and load a model from any folder a run writes
(`load_model_folder`). The layouts are described in rlfuse/run/checkpoint.py.
Test: python -m pytest -q tests/test_checkpoint.py tests/test_distributed.py
"""

from __future__ import annotations

import json
import logging
import struct
import warnings
import zipfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from rlfuse.model import CausalLM, ModelConfig
from rlfuse.model.lora import has_lora
from rlfuse.model.lora_peft import load_peft_weights
from rlfuse.model.weights import load_model, load_state_dict_from_files, parse_dtype
from rlfuse.run.checkpoint import CheckpointError, clean_temporary, list_checkpoints, set_rng_state
from rlfuse.run.distributed.context import DistContext
from rlfuse.run.distributed.dcp import load_full_adamw_state, load_sharded
from rlfuse.run.distributed.fsdp import is_sharded

log = logging.getLogger(__name__)


def _check_safetensors(path: Path) -> str | None:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path.name}: truncated ({size} bytes)"
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            return f"{path.name}: truncated or not a safetensors file ({size} bytes, header length {n:#x})"
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return f"{path.name}: unreadable safetensors header"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return f"{path.name}: truncated ({size} bytes, the header describes {8 + n + end})"
    return None


def verify_checkpoint(path: str | Path) -> str | None:
    """What is wrong with checkpoint folder `path`, or None when it looks intact: COMPLETE
    present, every file it lists present with its recorded size, the weights' safetensors
    headers consistent with their sizes and the torch archives readable. Cheap: no tensor
    is loaded."""
    path = Path(path)
    if not (path / "COMPLETE").is_file():
        return "no COMPLETE file (the save did not finish)"
    lines = (path / "COMPLETE").read_text(errors="replace").splitlines()
    for line in lines[1:]:  # "<bytes> <file>" (checkpoints written before the manifest have none)
        size, _, name = line.partition(" ")
        f = path / name
        if not f.is_file():
            return f"{name}: missing"
        if size.isdigit() and f.stat().st_size != int(size):
            return f"{name}: {f.stat().st_size} bytes, {size} when saved"
    if (path / "dcp").is_dir():
        return _verify_sharded(path)
    if (path / "adapter").is_dir():
        return _verify_adapter(path)
    for name in ("model/config.json", "optimizer.pt", "state.pt"):
        if not (path / name).is_file():
            return f"{name}: missing"
    weights = sorted((path / "model").glob("*.safetensors"))
    if not weights:
        return "model/: no .safetensors file"
    for w in weights:
        if problem := _check_safetensors(w):
            return f"model/{problem}"
    return _archives_and_config_problem(path, ("optimizer.pt", "state.pt"), "model/config.json")


def _archives_and_config_problem(path: Path, archives: tuple[str, ...], config: str) -> str | None:
    """The first of: a torch.save archive that does not open as a zip, a config that is not JSON."""
    for name in archives:
        try:
            with zipfile.ZipFile(path / name) as z:
                z.namelist()
        except (zipfile.BadZipFile, OSError) as e:
            return f"{name}: unreadable ({e})"
    try:
        json.loads((path / config).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"{config}: not valid JSON ({e})"
    return None


def _verify_adapter(path: Path) -> str | None:
    for name in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "optimizer.pt", "state.pt"):
        if not (path / name).is_file():
            return f"{name}: missing"
    if problem := _check_safetensors(path / "adapter" / "adapter_model.safetensors"):
        return f"adapter/{problem}"
    return _archives_and_config_problem(path, ("optimizer.pt", "state.pt"), "adapter/adapter_config.json")


def _verify_sharded(path: Path) -> str | None:
    for name in ("config.json", "state.pt", "dcp/.metadata"):
        if not (path / name).is_file():
            return f"{name}: missing"
    return _archives_and_config_problem(path, ("state.pt",), "config.json")


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """The checkpoint to resume from for checkpoint.resume = never | auto | <folder>.
    Called at start: removes leftover temporary folders first. `auto` takes the newest
    intact checkpoint (a damaged newer one is skipped with a warning), None when there is
    none at all (said plainly); an error when all of them are damaged."""
    clean_temporary(run_dir)
    if resume in ("", "never"):
        return None
    if resume == "auto":
        ckpts = list_checkpoints(run_dir)
        if not ckpts:
            log.warning("checkpoint.resume=auto: nothing to resume (no complete checkpoint in %s); starting at step 0",
                        Path(run_dir) / "checkpoints")
            return None
        damaged = []
        for path in reversed(ckpts):
            problem = verify_checkpoint(path)
            if problem is None:
                if damaged:
                    log.warning("checkpoint %s is damaged (%s); resuming from the previous intact checkpoint %s",
                                damaged[0][0], damaged[0][1], path.name)
                return path
            damaged.append((path.name, problem))
        raise CheckpointError(f"{Path(run_dir) / 'checkpoints'}: no intact checkpoint to resume from ("
                              + "; ".join(f"{n}: {p}" for n, p in damaged) + "); move them away to start afresh")
    path = Path(resume)
    if not (path / "COMPLETE").exists():
        raise ValueError(f"checkpoint.resume: {path} is not a complete checkpoint folder (no COMPLETE file)")
    if problem := verify_checkpoint(path):
        raise CheckpointError(f"checkpoint.resume: {path} is damaged ({problem})")
    return path


@torch.no_grad()
def load_checkpoint(path: str | Path, model, optimizer, *, dist: DistContext | None = None) -> dict:
    """Load weights into `model` in place, the optimizer state and RNG states; returns
    the saved trainer state (step, data positions, extras). Either layout (module doc),
    into a one-process model or, with `dist`, a sharded one. A replicated model (`dist`, not
    sharded: LoRA) reads the one-process layout on every rank."""
    path = Path(path)
    if (path / "dcp").is_dir() or (dist is not None and is_sharded(model)):
        return _load_resharded(path, model, optimizer, dist)
    adapter = (path / "adapter").is_dir()
    if adapter != has_lora(model):
        raise CheckpointError(f"checkpoint {path}: holds {'a LoRA adapter' if adapter else 'full weights'}, but the "
                              f"run {'has' if has_lora(model) else 'has no'} model.lora; resume with the recipe "
                              f"that wrote it")
    if adapter:
        load_peft_weights(model, path / "adapter")  # the base: the recipe's model.path, frozen
    else:
        load_state_dict_from_files(model, path / "model")
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=model.lm_head_weight.device,
                                             weights_only=False))
    state = torch.load(path / "state.pt", weights_only=False)
    # each rank's own RNG states when the same number of ranks wrote them (replicated runs), else rank 0's
    same_n = dist is not None and state.get("world_size", 1) == dist.world_size and "rng_per_rank" in state
    set_rng_state(state["rng_per_rank"][dist.rank] if same_n else state["rng"])
    log.info("resumed from %s (step %d)", path, state["step"])
    return state


def _load_resharded(path: Path, model, optimizer, dist: DistContext | None) -> dict:
    """load_checkpoint across layouts: sharded -> sharded at any N (DCP reshards), sharded
    -> one process (DCP without a process group, into MasterAdamW's state), one process
    -> sharded (every rank reads the full files and keeps its shard)."""
    if (path / "dcp").is_dir() and dist is not None:
        load_sharded(path / "dcp", model, optimizer.opt)
    elif (path / "dcp").is_dir():
        _load_sharded_into_one_process(path / "dcp", model, optimizer)
    else:
        _load_one_process_into_sharded(path, model, optimizer)
    state = torch.load(path / "state.pt", weights_only=False)
    saved_n = state.get("world_size", 1)
    same_n = dist is not None and saved_n == dist.world_size
    set_rng_state(state["rng_per_rank"][dist.rank] if same_n else state["rng"])
    log.info("resumed from %s (step %d, written by %d rank%s%s)", path, state["step"], saved_n,
             "s" if saved_n > 1 else "", "" if same_n or (dist is None and saved_n == 1) else ", resharded")
    return state


def _dcp_load_here(state: dict, folder: Path) -> None:
    """dcp.load by this process alone, reading every rank's file (torch warns that it
    assumes exactly that; here it is the intent, so the warning is dropped)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)


def _load_sharded_into_one_process(folder: Path, model, optimizer) -> None:
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    req = {"model": {n: torch.empty(p.shape, dtype=torch.float32) for n, p in params.items()},
           "optim": {"state": {n: {"step": torch.zeros(()), "exp_avg": torch.empty(p.shape, dtype=torch.float32),
                                   "exp_avg_sq": torch.empty(p.shape, dtype=torch.float32)} for n, p in params.items()}}}
    _dcp_load_here(req, folder)
    w, st = req["model"], req["optim"]["state"]
    for n, p in params.items():
        p.copy_(w[n])  # bf16 parameters: round(master), as MasterAdamW writes them
    optimizer.load_state_dict({"step": int(st[names[0]]["step"]),
                               "master": [None if params[n].dtype == torch.float32 else w[n] for n in names],
                               "exp_avg": [st[n]["exp_avg"] for n in names],
                               "exp_avg_sq": [st[n]["exp_avg_sq"] for n in names]})


def _load_one_process_into_sharded(path: Path, model, optimizer) -> None:
    plain = load_model(path / "model", dtype=torch.float32)  # the rounded weights; saved masters replace them
    sd = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
    load_full_adamw_state(model, optimizer.opt, dict(plain.named_parameters()), sd)


def model_folder(folder: str | Path) -> Path:
    """Where the weights and tokenizer of `folder` are: an HF folder itself, a one-process
    training checkpoint's model/, or a sharded checkpoint folder itself (config.json, dcp/
    and the tokenizer side by side)."""
    folder = Path(folder)
    return folder / "model" if (folder / "model" / "config.json").exists() else folder


def load_model_folder(folder: str | Path, *, device: str | torch.device = "cpu",
                      dtype: str | torch.dtype | None = None, text_only: bool = False) -> CausalLM:
    """A model from an HF folder, a checkpoint folder (its model/), or a sharded
    checkpoint folder (config.json + dcp/, read without a process group). dtype defaults
    to the config's torch_dtype; text_only: a multimodal folder's text tower alone."""
    folder = model_folder(folder)
    if not (folder / "dcp").is_dir():
        return load_model(folder, device=device, dtype=dtype, text_only=text_only)
    cfg = ModelConfig.from_hf(folder, text_only=text_only)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device)
    sd = {n: torch.empty(p.shape, dtype=torch.float32) for n, p in model.named_parameters()}
    _dcp_load_here({"model": sd}, folder / "dcp")
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(sd[n])
    log.info("loaded %s from the sharded checkpoint %s", cfg.architecture, folder)
    return model.to(parse_dtype(dtype or cfg.torch_dtype))


