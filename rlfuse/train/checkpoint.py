"""Checkpoints: weights (HF format), optimizer state, RNG states, data position, step.

Layout: RUN_DIR/checkpoints/step_000012/
    model/               config.json + model.safetensors (+ tokenizer files): loads in transformers
    optimizer.pt         MasterAdamW.state_dict() (fp32 masters, moments, step count)
    state.pt             trainer state: step, data stream positions, RNG states (python,
                         numpy, torch CPU, torch CUDA), extra (e.g. the reference-model flag)
    COMPLETE             written last
RUN_DIR/final/ holds the last weights (HF folder) for the next stage (`save_final`).
A checkpoint is written into a hidden temporary sibling and renamed into place, so a
crash never leaves a half-written `step_*` folder; `latest()` also requires COMPLETE.
After saving, only the newest `keep_last` checkpoints are kept.
Test: python -m pytest -q tests/test_checkpoint.py
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from rlfuse.model.weights import load_state_dict_from_files, save_model

log = logging.getLogger(__name__)
_STEP = re.compile(r"^step_(\d+)$")


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


def save_checkpoint(run_dir: str | Path, step: int, model, optimizer, state: dict, *, tokenizer=None,
                    keep_last: int = 2) -> Path:
    ckpt_root = Path(run_dir) / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp", dir=ckpt_root))
    try:
        tok_dir = None
        if tokenizer is not None:
            tok_dir = tokenizer.save(tmp / "tokenizer")
        save_model(model, tmp / "model", tokenizer_dir=tok_dir)
        if tok_dir is not None:
            shutil.rmtree(tok_dir)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({"step": step, "rng": rng_state(), **state}, tmp / "state.pt")
        (tmp / "COMPLETE").write_text(f"{step}\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old)
    log.info("checkpoint step %d -> %s", step, final)
    return final


def save_final(run_dir: str | Path, model, tokenizer=None) -> Path:
    """RUN_DIR/final: the trained weights (+ tokenizer) as an HF folder, for the next stage."""
    final = Path(run_dir) / "final"
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = tokenizer.save(Path(tmp) / "tokenizer") if tokenizer is not None else None
        save_model(model, final, tokenizer_dir=tok_dir)
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


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """The checkpoint to resume from for checkpoint.resume = never | auto | <folder>."""
    if resume in ("", "never"):
        return None
    if resume == "auto":
        return latest(run_dir)
    path = Path(resume)
    if not (path / "COMPLETE").exists():
        raise ValueError(f"checkpoint.resume: {path} is not a complete checkpoint folder (no COMPLETE file)")
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
