"""Observability: per-step metrics to metrics.jsonl and TensorBoard, a progress bar,
sample completions, phase timers and peak memory.

RUN_DIR/metrics.jsonl   one JSON object per logged step: {"step", "stage", <name>: float, ...};
                        stage "data" (step 0, once per run): rows kept / dropped by reason
RUN_DIR/samples.jsonl   {"step", "prompt", "completion", "reward", ...} every N steps
RUN_DIR/tb/             TensorBoard event files (same scalars; `tensorboard --logdir RUN_DIR/tb`)
W&B / MLflow            the same scalars, when logging.wandb / logging.mlflow are set (rlfuse.run.trackers)
Metric names use "/" groups: reward/<fn>, time/generate, tokens_per_s/train, ...
`rlfuse report RUN_DIR` reads these files back (rlfuse.run.report).

Crash safety: a kill or a full disk during an append can leave a torn last line; readers
(`read_jsonl`, a resuming RunLog, the report) drop it with a warning. A line that is not
JSON anywhere else is an error naming file:line. A failed write names the file.
Test: python -m pytest -q tests/test_bad_inputs.py -k metrics
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DATA_STAGE = "data"
"""Stage of the one metrics row (step 0) holding the data checks' counts (rlfuse.data.prompts)."""
NOT_TRAINING = ("eval", DATA_STAGE)
"""Stages of metrics rows that are not training steps."""


def device_sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)  # host sync: phase timing, a few per step


class PhaseTimer:
    """Wall time of named phases; `with timer("generate"): ...` (syncs the device at the
    boundaries so GPU work is attributed to its phase)."""

    def __init__(self, device="cpu", profile=None):
        self.device = device
        self.times: dict[str, float] = {}
        self.profile = profile
        """This step's rlfuse.run.profile.StepProfiler (logging.profile_step), or None: not profiled."""

    def __call__(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                # the profiler starts outside the timed span and stops after it: its own start,
                # stop and trace export are not in the phase's time
                self.prof = timer.profile.start(name) if timer.profile is not None else None
                device_sync(timer.device)
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                device_sync(timer.device)
                dt = time.perf_counter() - self.t0
                timer.times[name] = timer.times.get(name, 0.0) + dt
                if self.prof is not None and exc[0] is None:
                    self.prof.finish(dt)
                elif self.prof is not None:  # the phase raised: the profiler stops, nothing is written
                    self.prof.stop()

        return _Ctx()


def peak_memory_mb(device) -> float:
    """Peak allocated CUDA memory since the last reset, or the process peak RSS on CPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 if sys.platform != "darwin" else rss / 2**20


def to_floats(metrics: dict) -> dict:
    """Python floats (None for NaN/inf); tensors come to the host in one transfer per
    device (host sync: metrics, once per logged step)."""
    out = {}
    by_dev: dict[torch.device, list[str]] = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor):
            by_dev.setdefault(v.device, []).append(k)
        else:
            out[k] = float(v)
    for keys in by_dev.values():
        vals = torch.stack([metrics[k].detach().float().reshape(()) for k in keys]).cpu().tolist()
        out.update(zip(keys, vals))
    return {k: (out[k] if math.isfinite(out[k]) else None) for k in metrics}


def _jsonl_rows(path: Path) -> list[tuple[str, dict]]:
    """[(line, row)] of a JSON-lines file; a torn last line is dropped with a warning."""
    text = path.read_bytes().decode("utf-8", errors="replace")  # a torn write may split a character
    lines = [(i, x) for i, x in enumerate(text.split("\n"), 1) if x.strip()]
    out = []
    for k, (i, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if k == len(lines) - 1:
                log.warning("%s:%d: dropping a torn last line (an append cut short by a kill or a full disk): %.60r",
                            path, i, line)
                break
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg}); only a torn last line is dropped "
                             f"automatically, this one is in the middle of the file") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i}: expected a JSON object per line, got {type(row).__name__}")
        out.append((line, row))
    return out


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a metrics.jsonl / samples.jsonl file ([] when it does not exist)."""
    path = Path(path)
    return [row for _, row in _jsonl_rows(path)] if path.exists() else []


def _write_error(path: Path, e: OSError) -> ValueError:
    return ValueError(f"cannot write {path}: {e.strerror or e}; free space or fix the folder's permissions, then "
                      f"resume (the last checkpoint is not affected)")


class RunLog:
    """Metric and sample sink for one run folder."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, progress: bool = True,
                 total: int | None = None, desc: str = "train", initial: int = 0, trackers=None):
        """`initial` = the step the run starts from: 0 starts the files afresh; a resumed run
        keeps the rows up to `initial` and drops later ones (logged after the checkpoint).
        `trackers` (rlfuse.run.trackers.Trackers): also sent every row, after the files are
        written; `close` hands them the report's plots."""
        self.run_dir = Path(run_dir)
        self._trackers = trackers
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _write_error(self.run_dir, e) from e
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        for path in (self.metrics_path, self.samples_path):
            if path.exists():
                rows = _jsonl_rows(path)
                keep = [x for x, row in rows if initial and row.get("step", 0) <= initial]
                if len(keep) < len(rows):
                    log.info("%s: %s %d rows %s", path, "dropping" if initial else "starting afresh; removed",
                             len(rows) - len(keep), f"after step {initial} (resume)" if initial else "of a previous run")
                tmp = path.with_name(f".{path.name}.tmp")
                try:  # rewritten beside and renamed, so a crash here cannot lose the rows kept
                    tmp.write_text("".join(x + "\n" for x in keep))
                    os.replace(tmp, path)
                except OSError as e:
                    raise _write_error(path, e) from e
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard is a declared dependency; say so if it is gone
                log.warning("TensorBoard logging off: %s (pip install tensorboard)", e)
            else:
                self._tb = SummaryWriter(str(self.run_dir / "tb"))
        self._bar = None
        if progress:
            from tqdm import tqdm
            self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=True)

    def log(self, step: int, metrics: dict, stage: str = "train") -> dict:
        row = {"step": step, "stage": stage}
        row.update(to_floats(metrics))
        try:
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as e:
            raise _write_error(self.metrics_path, e) from e
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("step", "stage") and v is not None:
                    self._tb.add_scalar(f"{stage}/{k}", v, step)
            self._tb.flush()
        if self._trackers is not None:
            self._trackers.log(step, stage, row)
        return row

    def progress(self, n: int = 1, **postfix) -> None:
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in postfix.items()},
                                      refresh=False)

    def samples(self, step: int, rows: list[dict]) -> None:
        try:
            with self.samples_path.open("a") as f:
                f.write("".join(json.dumps({"step": step, **r}, ensure_ascii=False) + "\n" for r in rows))
        except OSError as e:
            raise _write_error(self.samples_path, e) from e

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._trackers is not None:
            self._trackers.finish(self.run_dir)


def read_metrics(run_dir: str | Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


DATA_REASONS = {
    "dropped/empty_prompt": "the prompt is empty (or only white space)",
    "dropped/prompt_too_long": "the prompt is longer than data.max_prompt_len tokens",
    "dropped/sft_too_long": "SFT: the example is longer than sft.max_seq_len or the model context "
                            "(sft.overlong: drop)",
    "truncated/sft_too_long": "SFT: the example is longer than sft.max_seq_len or the model context; "
                              "cut on the completion side (sft.overlong: truncate)",
    "dropped/sft_no_target": "SFT: no target token left within the length limit",
    "dropped/dpo_same_responses": "DPO: the chosen and rejected responses tokenize the same",
    "dropped/dpo_no_response_room": "DPO: the prompt leaves no response token within dpo.max_seq_len",
    "kept/unknown_tokens": "text the tokenizer cannot represent (encoded as its unknown token); the row is kept",
}
"""What can happen to a row before training, by metric slug (`<action>/<reason>`): the
names metrics.jsonl, TensorBoard and the report use. Stable: dashboards key on them."""


def data_lines(stats: dict) -> list[str]:
    """One line per split of the data metrics (`stats=` of the builders, or a metrics.jsonl
    "data" row): "train: 98 of 100 rows kept; dropped: 1 empty_prompt, 1 prompt_too_long"."""
    splits = dict.fromkeys(k.split("/", 1)[0] for k in stats if k.endswith("/rows"))
    out = []
    for sp in splits:
        line = f"{sp}: {int(stats[f'{sp}/kept'])} of {int(stats[f'{sp}/rows'])} rows kept"
        for action in ("dropped", "truncated"):
            got = [(k.split("/", 2)[2], int(v)) for k, v in stats.items()
                   if k.startswith(f"{sp}/{action}/") and v]
            if got:
                line += f"; {action}: " + ", ".join(f"{n} {r}" for r, n in got)
        if stats.get(f"{sp}/kept/unknown_tokens"):
            line += f"; {int(stats[f'{sp}/kept/unknown_tokens'])} with unknown tokens"
        out.append(line)
    return out


