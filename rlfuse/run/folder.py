"""Who owns a run folder: start, resume or overwrite, decided before anything is written.

`prepare_run_folder(cfg, kind, resume=..., overwrite=..., force=...)` is called by
`rlfuse sft` / `rlfuse grpo` (and any trainer's command) before the session opens:
  * an empty folder (or one left by a start that failed before its first step: only
    config.yaml / run.json) is taken;
  * a folder holding a run (metrics rows, checkpoints or final/) needs --resume (or
    checkpoint.resume in the recipe) or --overwrite; otherwise an error says so and
    nothing is touched;
  * --overwrite removes the previous run's files (the ones rlfuse writes, listed in
    RUN_FILES), naming each in the log; nothing else in the folder is deleted;
  * resume: the folder's run must be of the same kind (run.json, else the stages in
    metrics.jsonl), and the saved config.yaml is compared with the new config: changes of
    the fields in BREAKING (the model, the training data, the seeds, the algorithm) are
    refused unless `force`, the others are logged as warnings.
RUN_DIR/run.json records the kind ({"kind": "grpo"}).
Before any of this the run takes RUN_DIR/run.lock (`RunLock`: pid, host and start time,
created with O_EXCL) and holds it until it ends: a second run on the same folder is
refused naming the holder; a lock left by a process that no longer exists on this host is
taken over, and the takeover is logged. Under torchrun rank 0 alone calls this, so rank 0
holds the lock for the job.
Test: python -m pytest -q tests/test_bad_inputs.py -k run_folder
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import socket
from pathlib import Path

import yaml

from rlfuse.run.config.io import to_dict
from rlfuse.run.config.run_config import RunConfig, resolved_inputs
from rlfuse.run.metrics import NOT_TRAINING

log = logging.getLogger(__name__)

RUN_MARK = "run.json"
LOCK = "run.lock"
RUN_FILES = ("metrics.jsonl", "samples.jsonl", "tb", "checkpoints", "final", "final_merged", "report", "eval.json",
             "config.yaml", RUN_MARK)
"""What a run writes into its folder (and --overwrite removes)."""

BREAKING = ("model.path", "model.random_init", "model.tokenizer", "model.dtype", "data.", "seed",
            "grpo.loss_type", "grpo.kl_type", "grpo.adv_scale", "grpo.group_size", "grpo.advantage",
            "ppo.loss_type", "ppo.samples_per_prompt", "ppo.critic_path", "dpo.loss", "dpo.reference", "dpo.ref_path")
"""Config keys (a trailing dot: a whole section) whose change makes a resumed run a
different run: other weights or vocabulary, another data order, another objective."""
NOT_BREAKING = ("data.eval", "data.eval_size")
"""Exceptions inside BREAKING sections: the held-out set only changes what is measured."""
IGNORED = ("checkpoint.resume",)
"""Keys that differ on every resume (--resume sets checkpoint.resume)."""


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and prefix + k not in ("model.random_init", "data.task"):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def config_changes(saved: dict, new: RunConfig) -> list[tuple[str, object, object]]:
    """(dotted key, saved value, new value) for every field that differs, in key order; input
    paths compared resolved (config.yaml holds them absolute, a new config may not)."""
    a, b = _flat(resolved_inputs(saved)), _flat(resolved_inputs(to_dict(new)))
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and k not in IGNORED]


def is_breaking(key: str) -> bool:
    if any(key == n or key.startswith(n + ".") for n in NOT_BREAKING):
        return False
    return any(key == b or (b.endswith(".") and key.startswith(b)) for b in BREAKING)


def run_evidence(run_dir: Path) -> list[str]:
    """What shows that `run_dir` holds a run ([] when it holds none)."""
    found = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir():
        n = sum(1 for p in ckpts.iterdir() if p.name.startswith("step_"))
        if n:
            found.append(f"{n} checkpoint{'s' if n > 1 else ''}")
    if (run_dir / "final").is_dir():
        found.append("final/")
    return found


def run_kind(run_dir: Path) -> str | None:
    """The kind of run in `run_dir`: run.json, else the first training stage in metrics.jsonl."""
    mark = run_dir / RUN_MARK
    if mark.is_file():
        try:
            kind = json.loads(mark.read_text()).get("kind")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            kind = None
        if isinstance(kind, str):
            return kind
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text(errors="replace").splitlines():
            try:
                stage = json.loads(line).get("stage")
            except (json.JSONDecodeError, AttributeError):
                continue
            if isinstance(stage, str) and stage not in NOT_TRAINING:
                return stage
    return None


def remove_path(p: Path) -> bool:
    """Remove the file or folder `p`; False when there was nothing."""
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()
    else:
        return False
    return True


def clear_run(run_dir: Path, why: str = "--overwrite") -> list[str]:
    """Remove the files of RUN_FILES from `run_dir` (logged, with `why`); returns their names."""
    removed = [name for name in RUN_FILES if remove_path(run_dir / name)]
    if removed:
        log.warning("%s: removed the previous run's %s from %s", why, ", ".join(removed), run_dir)
    return removed


class RunLock:
    """RUN_DIR/run.lock, held by this process from `acquire` to `release` (module docstring)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self.held = False

    def acquire(self) -> RunLock:
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        for _ in range(2):  # the second try follows the removal of a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if not self._stale(holder):
                    raise ValueError(f"{self.path.parent}: another run is using this run folder ({_who(holder)}); "
                                     f"wait for it to end, stop it, or choose another --run-dir (if that process "
                                     f"is gone, delete {self.path})") from None
                log.warning("%s: taking over the lock of a run that is gone (%s)", self.path, _who(holder))
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me) + "\n")
            self.held = True
            return self
        raise ValueError(f"{self.path}: could not take the run folder's lock (another process keeps creating it)")

    def release(self) -> None:
        if self.held:
            self.held = False
            if self._holder().get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _holder(self) -> dict:
        try:
            d = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return d if isinstance(d, dict) else {}

    @staticmethod
    def _stale(holder: dict) -> bool:
        """A lock whose process is known to be gone: same host, pid not running. A lock
        from another host (a shared file system) or an unreadable one is never stale."""
        pid = holder.get("pid")
        if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, owned by another user
            return False
        return False


def _who(holder: dict) -> str:
    if not holder:
        return "the lock file is empty or unreadable: a run may be starting right now"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


def _show(v) -> str:
    return "(absent)" if v is None else json.dumps(v) if isinstance(v, (dict, list)) else repr(v)


def make_folder(path: str | Path, what: str,
                expected: str = "a folder (an existing one, or a path that does not exist yet)") -> Path:
    """Folder `path`, created with its parents if absent. A ValueError naming `what` (the
    option or field that gave the path) and `expected` when the path, or a folder it would be
    created in, is a file: every command that writes into a folder it is given checks here."""
    path = Path(path)
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker == path:
        raise ValueError(f"{what}: {path} is a file; expected {expected}")
    if blocker is not None:
        raise ValueError(f"{what}: {path} cannot be created: {blocker} is a file; expected {expected}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def prepare_run_folder(cfg: RunConfig, kind: str, *, resume: bool = False, overwrite: bool = False,
                       force: bool = False) -> RunLock:
    """Take the folder's lock, then decide start / resume / overwrite for cfg.logging.run_dir
    (module docstring); a ValueError, with nothing changed, when another run holds the folder
    or the folder's state and the flags disagree. Returns the held lock: release it (or use
    it as a context manager) when the run ends."""
    run_dir = Path(cfg.logging.run_dir)
    if resume and overwrite:
        raise ValueError("--resume and --overwrite contradict each other: continue the run in "
                         f"{run_dir} or replace it, not both")
    resume = resume or cfg.checkpoint.resume != "never"
    existed = run_dir.is_dir()
    make_folder(run_dir, "logging.run_dir", "a folder (new or a run's)")
    lock = RunLock(run_dir).acquire()
    try:
        evidence = run_evidence(run_dir)
        if evidence and overwrite:
            clear_run(run_dir)
        elif evidence and not resume:
            other = run_kind(run_dir)
            raise ValueError(f"{run_dir}: already holds {'a ' + other if other else 'a'} run ({', '.join(evidence)}); "
                             f"continue it with --resume, replace it with --overwrite, or choose another --run-dir "
                             f"(nothing was changed)")
        elif evidence:
            _check_resume(cfg, kind, run_dir, force)
        (run_dir / RUN_MARK).write_text(json.dumps({"kind": kind}) + "\n")
    except BaseException:
        lock.release()
        if not existed:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return lock


def _check_resume(cfg: RunConfig, kind: str, run_dir: Path, force: bool) -> None:
    other = run_kind(run_dir)
    if other is not None and other != kind:
        raise ValueError(f"--resume: {run_dir} holds a {other} run, not a {kind} run; resume it with "
                         f"`rlfuse {other}`, or give this {kind} run another --run-dir")
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        log.warning("--resume: %s has no config.yaml to compare the new config with", run_dir)
        return
    try:
        saved = yaml.safe_load(saved_path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"{saved_path}: not valid YAML ({e}); the run's saved config cannot be compared") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{saved_path}: expected a mapping (the run's saved config)")
    changes = config_changes(saved, cfg)
    breaking = [c for c in changes if is_breaking(c[0])]
    text = "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, a, b in breaking)
    if breaking and not force:
        raise ValueError(f"--resume: the config differs from {saved_path} in fields a resumed run cannot change "
                         f"({text}); undo the change, start a new --run-dir, or pass --force to resume anyway")
    if breaking:
        log.warning("--resume --force: resuming with changed %s", text)
    for k, a, b in changes:
        if not is_breaking(k):
            log.warning("--resume: %s changed from %s to %s", k, _show(a), _show(b))
