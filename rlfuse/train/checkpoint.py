"""Checkpoints: weights (HF format), optimizer state, RNG states, data position, step.

Layout: RUN_DIR/checkpoints/step_000012/
    model/               config.json + model.safetensors (+ tokenizer files): loads in transformers
    optimizer.pt         MasterAdamW.state_dict() (fp32 masters, moments, step count)
    state.pt             trainer state: step, data stream positions, RNG states (python,
                         numpy, torch CPU, torch CUDA), extra (e.g. the reference-model flag)
    COMPLETE             written last: the step, then "<bytes> <file>" for every file
RUN_DIR/final/ holds the last weights (HF folder) for the next stage (`save_final`).

Data-parallel runs (a DistContext `dist`, FSDP2-sharded model) write the sharded layout:
RUN_DIR/checkpoints/step_000012/
    dcp/                 torch.distributed.checkpoint: one file per rank + .metadata (fp32
                         master weights and AdamW state, sharded; loads at any number of ranks)
    config.json, tokenizer files   the model config (run dtype) and tokenizer: with dcp/ an
                         HF-like folder (`load_model_folder` reads it, so do eval and generate)
    state.pt             rank 0's trainer state, every rank's RNG states, the world size
    COMPLETE             as above
Every rank writes its DCP shard into the shared hidden temporary folder; after they all
finished rank 0 writes the rest, renames, rotates (ranks agree on errors: RankFailed).
`load_checkpoint` detects the layout: a sharded checkpoint resumes at the same N exactly,
at another N by resharding (DCP), and in one process into a plain model + MasterAdamW; a
one-process checkpoint loads into a sharded run too (every rank reads it, keeps its shard).

Rules that keep a checkpoint trustworthy:
  * written into a hidden temporary sibling and renamed into place, so a crash never
    leaves a half-written `step_*` folder; `list_checkpoints()` also requires COMPLETE;
  * weights with NaN/inf are never written (NonFiniteError; the previous checkpoints stay);
  * a full disk or a read-only folder raises CheckpointError naming the path; the
    temporary folder is removed and the previous checkpoints are untouched;
  * rotation (keep the newest `keep_last`) removes a checkpoint's COMPLETE before its files;
  * resume (`resolve_resume`) first removes leftover temporary folders of an interrupted
    save, then verifies the newest checkpoint (files present with the recorded sizes,
    safetensors and torch archives readable) and falls back to the previous intact one,
    saying so.
Test: python -m pytest -q tests/test_checkpoint.py tests/test_bad_inputs.py
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import struct
import tempfile
import warnings
import zipfile
from pathlib import Path

import numpy as np
import torch

import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import distribute_tensor

from rlfuse.model import CausalLM, ModelConfig
from rlfuse.model.weights import load_model, load_state_dict_from_files, parse_dtype, save_model
from rlfuse.train.distributed import (DistContext, gather_results, load_sharded, on_main, save_hf_export,
                                      save_sharded)
from rlfuse.train.optim import NonFiniteError, nonfinite_tensors

log = logging.getLogger(__name__)
_STEP = re.compile(r"^step_(\d+)$")
# hidden leftovers of an interrupted save: checkpoints/.step_N.tmp*, .step_N.old; RUN_DIR/.final.tmp*, .final.old
_LEFTOVER = re.compile(r"^\.(step_\d+|final)\.(tmp.*|old)$")


class CheckpointError(ValueError):
    """A checkpoint could not be written or read (a ValueError so the CLI reports it as
    `rlfuse: error: ...` without a traceback)."""


def rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def check_finite(model, what: str, dist: DistContext | None = None) -> None:
    """NonFiniteError naming `what` when any parameter holds NaN/inf (one host sync); with
    `dist`, any rank's shard (collective: every rank raises)."""
    if dist is None:
        bad = nonfinite_tensors(model.named_parameters())
    else:
        mine = nonfinite_tensors((n, p.to_local()) for n, p in model.named_parameters())
        bad = sorted(set().union(*gather_results(dist, "check weights", lambda: mine)))
    if bad:
        raise NonFiniteError(f"{what}: refusing to write non-finite weights (NaN/inf in {len(bad)} tensors, e.g. "
                             f"{', '.join(bad[:3])}); earlier checkpoints are kept. Training diverged: lower "
                             f"optim.lr or resume from an earlier checkpoint")


def _write_error(path: Path, e: BaseException) -> CheckpointError:
    what = getattr(e, "strerror", None) or str(e)
    at = f" ({e.filename})" if getattr(e, "filename", None) else ""
    try:
        probe = next(p for p in (path, *path.parents) if p.exists())
        free = f"; {shutil.disk_usage(probe).free / 2**30:.1f} GiB free on that disk"
    except (OSError, StopIteration):
        free = ""
    return CheckpointError(f"cannot write {path}: {what}{at}{free}; the previous checkpoints are untouched")


def _manifest(folder: Path) -> str:
    return "".join(f"{p.stat().st_size} {p.relative_to(folder).as_posix()}\n"
                   for p in sorted(folder.rglob("*")) if p.is_file())


def save_checkpoint(run_dir: str | Path, step: int, model, optimizer, state: dict, *, tokenizer=None,
                    keep_last: int = 2, dist: DistContext | None = None) -> Path:
    if dist is not None:
        return _save_sharded_checkpoint(dist, run_dir, step, model, optimizer, state, tokenizer, keep_last)
    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / f"step_{step:06d}"
    check_finite(model, f"checkpoint {final}")
    tmp = ckpt_root / f".{final.name}.tmp{os.getpid()}"
    try:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()  # not tempfile.mkdtemp: its 0700 mode would make the checkpoint private
        tok_dir = None
        if tokenizer is not None:
            tok_dir = tokenizer.save(tmp / "tokenizer")
        save_model(model, tmp / "model", tokenizer_dir=tok_dir)
        if tok_dir is not None:
            shutil.rmtree(tok_dir)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({"step": step, "rng": rng_state(), **state}, tmp / "state.pt")
        (tmp / "COMPLETE").write_text(f"{step}\n{_manifest(tmp)}")
        old = final.with_name(f".{final.name}.old")
        if final.exists():  # the same step saved again: swap, so a crash here keeps one copy
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_error(final, e) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _rotate(run_dir, keep_last)
    log.info("checkpoint step %d -> %s", step, final)
    return final


def _rotate(run_dir: str | Path, keep_last: int) -> None:
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        try:
            (old / "COMPLETE").unlink()  # first: a rotation cut short leaves no "complete" half folder
            shutil.rmtree(old)
        except OSError as e:
            log.warning("checkpoint rotation: could not remove %s (%s)", old, e)


def _save_sharded_checkpoint(dist: DistContext, run_dir, step: int, model, optimizer, state: dict, tokenizer,
                             keep_last: int) -> Path:
    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / f"step_{step:06d}"
    check_finite(model, f"checkpoint {final}", dist)
    tmp = ckpt_root / f".{final.name}.tmp-ranks"  # one name all ranks agree on (not a pid)

    def prepare() -> None:
        try:
            ckpt_root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            raise _write_error(final, e) from e

    def finish(rngs: list) -> None:
        try:
            if tokenizer is not None:
                tokenizer.save(tmp)
            cfg = model.config.to_hf()
            cfg["torch_dtype"] = cfg["dtype"] = str(optimizer.compute_dtype).replace("torch.", "")
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            torch.save({"step": step, "rng": rngs[0], "rng_per_rank": rngs, "world_size": dist.world_size, **state},
                       tmp / "state.pt")
            (tmp / "COMPLETE").write_text(f"{step}\n{_manifest(tmp)}")
            old = final.with_name(f".{final.name}.old")
            if final.exists():
                os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        except (OSError, RuntimeError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _write_error(final, e) from e
        _rotate(run_dir, keep_last)

    on_main(dist, "checkpoint", prepare)
    save_sharded(dist, tmp / "dcp", model, optimizer.opt)  # every rank its shard; returns after all did
    rngs = gather_results(dist, "checkpoint", rng_state)
    on_main(dist, "checkpoint", finish, rngs)
    log.info("checkpoint step %d -> %s (%d ranks, sharded)", step, final, dist.world_size)
    return final


def save_final(run_dir: str | Path, model, tokenizer=None, *, dist: DistContext | None = None,
               dtype: torch.dtype | None = None) -> Path:
    """RUN_DIR/final: the trained weights (+ tokenizer) as an HF folder, for the next stage
    (written atomically by save_model; never with non-finite weights). With `dist`: the
    full weights gathered on rank 0 and written there in `dtype` (the run's)."""
    final = Path(run_dir) / "final"
    check_finite(model, str(final), dist)
    if dist is not None:
        with tempfile.TemporaryDirectory() as tmp:
            tok_dir = tokenizer.save(Path(tmp) / "tokenizer") if tokenizer is not None and dist.is_main else None
            save_hf_export(dist, model, final, dtype=dtype, tokenizer_dir=tok_dir)
        log.info("final weights -> %s (gathered on rank 0)", final)
        return final
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tok_dir = tokenizer.save(Path(tmp) / "tokenizer") if tokenizer is not None else None
            save_model(model, final, tokenizer_dir=tok_dir)
    except (OSError, RuntimeError) as e:
        raise _write_error(final, e) from e
    log.info("final weights -> %s", final)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP.match(p.name)) and (p / "COMPLETE").exists()]
    return [p for _, p in sorted(found)]


def latest(run_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def clean_temporary(run_dir: str | Path) -> list[Path]:
    """Remove leftovers of an interrupted save (hidden .step_*.tmp* / .final.tmp* folders);
    a `.old` copy whose replacement never arrived is put back. Returns what was removed."""
    run_dir = Path(run_dir)
    removed = []
    for root in (run_dir, run_dir / "checkpoints"):
        if not root.is_dir():
            continue
        for p in sorted(root.iterdir()):
            m = _LEFTOVER.match(p.name)
            if not m or not p.is_dir():
                continue
            target = root / m.group(1)
            if m.group(2) == "old" and not target.exists():
                os.replace(p, target)
                log.warning("%s: restored from %s (a save was interrupted between two renames)", target, p.name)
                continue
            shutil.rmtree(p)
            removed.append(p)
            log.warning("removed %s: a temporary folder left by an interrupted save", p)
    return removed


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
    into a one-process model or, with `dist`, a sharded one."""
    path = Path(path)
    if (path / "dcp").is_dir() or dist is not None:
        return _load_resharded(path, model, optimizer, dist)
    load_state_dict_from_files(model, path / "model")
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=model.lm_head_weight.device,
                                             weights_only=False))
    state = torch.load(path / "state.pt", weights_only=False)
    set_rng_state(state["rng"])
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
    plain = load_model(path / "model", dtype=torch.float32)  # the rounded weights; masters replace them below
    sd = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
    step = torch.tensor(float(sd["step"]))
    for i, ((n, p), (n0, p0)) in enumerate(zip(model.named_parameters(), plain.named_parameters())):
        assert n == n0, (n, n0)

        def shard(full: torch.Tensor) -> torch.Tensor:
            return distribute_tensor(full.float().to(p.device), p.device_mesh, p.placements)

        p.to_local().copy_(shard(sd["master"][i] if sd["master"][i] is not None else p0).to_local())
        optimizer.opt.state[p] = {"step": step.clone(), "exp_avg": shard(sd["exp_avg"][i]),
                                  "exp_avg_sq": shard(sd["exp_avg_sq"][i])}


def load_model_folder(folder: str | Path, *, device: str | torch.device = "cpu",
                      dtype: str | torch.dtype | None = None) -> CausalLM:
    """A model from an HF folder, a checkpoint folder (its model/), or a sharded
    checkpoint folder (config.json + dcp/, read without a process group). dtype defaults
    to the config's torch_dtype."""
    folder = Path(folder)
    if (folder / "model" / "config.json").exists():
        folder = folder / "model"
    if not (folder / "dcp").is_dir():
        return load_model(folder, device=device, dtype=dtype)
    cfg = ModelConfig.from_hf(folder)
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
