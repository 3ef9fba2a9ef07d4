"""Writing checkpoints: weights (HF format), optimizer state, RNG states, data position,
step. Reading them back, verification and resume: rlfuse/run/resume.py.

Layout: RUN_DIR/checkpoints/step_000012/
    model/               config.json + model.safetensors (+ tokenizer files): loads in transformers
    adapter/             instead of model/ with LoRA (model.lora): the PEFT adapter folder
                         (A and B + tokenizer files); the frozen base is the recipe's model.path
    optimizer.pt         MasterAdamW.state_dict() (fp32 masters, moments, step count)
    state.pt             trainer state: step, data stream positions, RNG states (python,
                         numpy, torch CPU, torch CUDA), extra (e.g. the reference-model flag)
    COMPLETE             written last: the step, then "<bytes> <file>" for every file
RUN_DIR/final/ holds the last weights (HF folder) for the next stage (`save_final`); with
LoRA the PEFT adapter folder (use it as model.lora.path, or `--adapter` of generate / eval).

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
Replicated runs (LoRA data-parallel: every rank holds the same adapters) write the
one-process layout from rank 0, plus every rank's RNG states and the world size in state.pt.
`load_checkpoint` detects the layout: a sharded checkpoint resumes at the same N exactly,
at another N by resharding (DCP), and in one process into a plain model + MasterAdamW; a
one-process checkpoint loads into a sharded run too (every rank reads it, keeps its shard).

Rules that keep a checkpoint trustworthy:
  * written into a hidden temporary sibling and renamed into place, so a crash never
    leaves a half-written `step_*` folder; `list_checkpoints()` also requires COMPLETE;
  * weights with NaN/inf are never written (NonFiniteError; the previous checkpoints stay);
  * a full disk or a read-only folder raises CheckpointError naming the path, whichever
    writer failed (Python's OSError, torch.save's RuntimeError, safetensors'
    SafetensorError, the tokenizers library's Exception); the temporary folder is removed
    and the previous checkpoints are untouched;
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
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from rlfuse.model.lora import has_lora, lora_config
from rlfuse.model.lora_peft import save_merged, save_peft_adapter
from rlfuse.model.weights import save_model
from rlfuse.run.distributed.context import DistContext, gather_results, on_main
from rlfuse.run.distributed.dcp import save_hf_export, save_sharded
from rlfuse.run.distributed.fsdp import is_sharded
from rlfuse.run.distributed.replicated import check_replicas
from rlfuse.run.optim import NonFiniteError, nonfinite_tensors

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
        # one state per device the saving process saw: a 2-GPU torchrun rank saves two, a
        # 1-GPU resume of its checkpoint sees one (measured on 2 x H100: set_rng_state_all
        # raised IndexError there), so restore the devices both saw
        for i, s in enumerate(st["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


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


# how the writers that are not Python's own report a write that did not go through (a full
# disk, most often): torch.save's C++ writer "[enforce fail at inline_container.cc:...] .
# unexpected pos N vs M", "PytorchStreamWriter failed writing file data/0: file write
# failed"; safetensors (Rust) "Error while serializing: IoError(Os { code: 28, kind:
# StorageFull, message: \"No space left on device\" })"
_WRITE_FAILED = re.compile(r"unexpected pos|file write failed|failed writing file|StorageFull|No space left|"
                           r"IoError")


def _write_error(path: Path, e: BaseException) -> CheckpointError:
    """The one line every writer's failure ends in: the path, the cause, the free space."""
    what = getattr(e, "strerror", None) or str(e)
    if not isinstance(e, OSError):
        writer, label = {"RuntimeError": ("torch.save", "torch"), "SafetensorError": ("safetensors", "safetensors")
                         }.get(type(e).__name__, (type(e).__name__, type(e).__name__))
        first = (what.strip().splitlines() or [""])[0][:160]
        what = (f"no space left on device? {writer} could not write its data ({label}: {first})"
                if _WRITE_FAILED.search(what) else f"{label}: {first}")
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
    if dist is not None and is_sharded(model):
        return _save_sharded_checkpoint(dist, run_dir, step, model, optimizer, state, tokenizer, keep_last)
    if dist is not None:
        # replicated (LoRA): the one-process layout, written by rank 0, with every rank's RNG states
        check_replicas(dist, model, f"checkpoint step {step}")
        rngs = gather_results(dist, "checkpoint", rng_state)
        state = {**state, "rng_per_rank": rngs, "world_size": dist.world_size}
        on_main(dist, "checkpoint", lambda: save_checkpoint(run_dir, step, model, optimizer, state,
                                                            tokenizer=tokenizer, keep_last=keep_last))
        return Path(run_dir) / "checkpoints" / f"step_{step:06d}"
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
        save_weights(model, tmp, tokenizer_dir=tok_dir)
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
    except ValueError:  # rlfuse's own errors (CheckpointError, NonFiniteError) as they are
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:  # noqa: BLE001 -- every writer (torch, safetensors, tokenizers) fails its own way
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_error(final, e) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _rotate(run_dir, keep_last)
    log.info("checkpoint step %d -> %s", step, final)
    return final


def save_weights(model, folder: Path, *, tokenizer_dir=None) -> None:
    """A one-process checkpoint's weights into `folder`: model/ (HF folder), or with LoRA
    adapter/ (the PEFT folder: A and B only, the base is frozen)."""
    if has_lora(model):
        save_peft_adapter(model, folder / "adapter", tokenizer_dir=tokenizer_dir)
    else:
        save_model(model, folder / "model", tokenizer_dir=tokenizer_dir)


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
        except ValueError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except Exception as e:  # noqa: BLE001 -- as in save_checkpoint
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
    (`export_model`); with LoRA and `model.lora.export_merged`, RUN_DIR/final_merged too."""
    return export_model(Path(run_dir) / "final", model, tokenizer, dist=dist, dtype=dtype)


def merged_folder(folder: str | Path) -> Path:
    """Where `export_model(folder, ...)` writes the merged HF folder of a LoRA model."""
    folder = Path(folder)
    return folder.with_name(folder.name + "_merged")


def export_model(folder: str | Path, model, tokenizer=None, *, dist: DistContext | None = None,
                 dtype: torch.dtype | None = None) -> Path:
    """The weights (+ tokenizer) as an HF folder (written atomically by save_model; never
    with non-finite weights); with LoRA adapters, the PEFT adapter folder instead, and, when
    the adapters' LoRAConfig.export_merged is set, the merged HF folder at
    `merged_folder(folder)` as well. With `dist`: the full weights gathered on rank 0 and
    written there in `dtype` (the run's)."""
    final = Path(folder)
    if dist is not None and not is_sharded(model):  # replicated (LoRA): rank 0 writes what one process writes
        check_replicas(dist, model, str(final))
        on_main(dist, "export", lambda: export_model(final, model, tokenizer, dtype=dtype))
        return final
    check_finite(model, str(final), dist)
    if dist is not None:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            tok_dir = tokenizer.save(Path(tmp) / "tokenizer") if tokenizer is not None and dist.is_main else None
            save_hf_export(dist, model, final, dtype=dtype, tokenizer_dir=tok_dir)
        log.info("weights -> %s (gathered on rank 0, %.1f s)", final, time.perf_counter() - t0)
        return final
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tok_dir = tokenizer.save(Path(tmp) / "tokenizer") if tokenizer is not None else None
            if has_lora(model):
                save_peft_adapter(model, final, tokenizer_dir=tok_dir)
                if lora_config(model).export_merged:
                    save_merged(model, merged_folder(final), tokenizer_dir=tok_dir)
                    log.info("LoRA merged into the weights (HF folder) -> %s", merged_folder(final))
            else:
                save_model(model, final, tokenizer_dir=tok_dir)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 -- as in save_checkpoint
        raise _write_error(final, e) from e
    log.info("%s -> %s", "LoRA adapter (PEFT folder)" if has_lora(model) else "weights", final)
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
    """Remove leftovers of an interrupted save (hidden .step_*.tmp* / .final.tmp* folders)
    and of an interrupted rotation (a step_* folder without COMPLETE older than the newest
    complete checkpoint: `_rotate` deletes COMPLETE first, and a save publishes its folder
    with COMPLETE inside, so nothing else leaves one); a `.old` copy whose replacement never
    arrived is put back. Returns what was removed."""
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
    complete = list_checkpoints(run_dir)
    newest = int(_STEP.match(complete[-1].name).group(1)) if complete else -1
    root = run_dir / "checkpoints"
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        m = _STEP.match(p.name)
        if m and p.is_dir() and int(m.group(1)) < newest and not (p / "COMPLETE").exists():
            shutil.rmtree(p)
            removed.append(p)
            log.warning("removed %s: a checkpoint whose deletion by the rotation (checkpoint.keep_last) was cut short",
                        p)
    return removed






















