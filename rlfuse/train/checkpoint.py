"""Checkpoints: weights (HF format), optimizer state, RNG states, data position, step.

Layout: RUN_DIR/checkpoints/step_000012/
    model/               config.json + model.safetensors (+ tokenizer files): loads in transformers
    optimizer.pt         MasterAdamW.state_dict() (fp32 masters, moments, step count)
    state.pt             trainer state: step, data stream positions, RNG states (python,
                         numpy, torch CPU, torch CUDA), extra (e.g. the reference-model flag)
    COMPLETE             written last: the step, then "<bytes> <file>" for every file
RUN_DIR/final/ holds the last weights (HF folder) for the next stage (`save_final`).

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
import zipfile
from pathlib import Path

import numpy as np
import torch

from rlfuse.model.weights import load_state_dict_from_files, save_model
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


def check_finite(model, what: str) -> None:
    """NonFiniteError naming `what` when any parameter holds NaN/inf (one host sync)."""
    bad = nonfinite_tensors(model.named_parameters())
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
                    keep_last: int = 2) -> Path:
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
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        try:
            (old / "COMPLETE").unlink()  # first: a rotation cut short leaves no "complete" half folder
            shutil.rmtree(old)
        except OSError as e:
            log.warning("checkpoint rotation: could not remove %s (%s)", old, e)
    log.info("checkpoint step %d -> %s", step, final)
    return final


def save_final(run_dir: str | Path, model, tokenizer=None) -> Path:
    """RUN_DIR/final: the trained weights (+ tokenizer) as an HF folder, for the next stage
    (written atomically by save_model; never with non-finite weights)."""
    final = Path(run_dir) / "final"
    check_finite(model, str(final))
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
    for name in ("model/config.json", "optimizer.pt", "state.pt"):
        if not (path / name).is_file():
            return f"{name}: missing"
    weights = sorted((path / "model").glob("*.safetensors"))
    if not weights:
        return "model/: no .safetensors file"
    for w in weights:
        if problem := _check_safetensors(w):
            return f"model/{problem}"
    for name in ("optimizer.pt", "state.pt"):
        try:
            with zipfile.ZipFile(path / name) as z:
                z.namelist()
        except (zipfile.BadZipFile, OSError) as e:
            return f"{name}: unreadable ({e})"
    try:
        json.loads((path / "model/config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"model/config.json: not valid JSON ({e})"
    return None


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
def load_checkpoint(path: str | Path, model, optimizer) -> dict:
    """Load weights into `model` in place, the optimizer state and RNG states; returns
    the saved trainer state (step, data positions, extras)."""
    path = Path(path)
    load_state_dict_from_files(model, path / "model")
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=model.lm_head_weight.device,
                                             weights_only=False))
    state = torch.load(path / "state.pt", weights_only=False)
    set_rng_state(state["rng"])
    log.info("resumed from %s (step %d)", path, state["step"])
    return state
