"""Experiment trackers beside metrics.jsonl: Weights & Biases and MLflow, both optional.

On when configured: `logging.wandb.project` (W&B; extra `wandb`) and
`logging.mlflow.experiment` (MLflow; extra `mlflow`, the `mlflow-skinny` client). One
tracker run per training run (each `run_loop`, so the demo's SFT and GRPO stages are two):
  start   the resolved config as the run's parameters (W&B config, nested; MLflow
          params, flattened to dotted keys such as `grpo.clip_high`)
  a row   the scalars RunLog writes to TensorBoard, under the same names
          (`<stage>/<metric>`), at the row's step
  end     the report's PNGs (`rlfuse report RUN_DIR`, rendered into RUN_DIR/report):
          W&B images `report/<name>`, MLflow artifacts under `report/`
Failure policy: logging never stops training. RunLog writes metrics.jsonl (and
TensorBoard) before any tracker sees a row, so those files hold every row whatever a
tracker does. A tracker whose package is missing, or whose start fails (no network, bad
credentials), is a warning at start and the run goes on without it; a call that raises
mid-run is a warning naming the tracker, the call and the error, and that tracker is
switched off for the rest of the run (no retries: a tracker that failed once would
otherwise cost every step a timeout).
Test: python -m pytest -q tests/test_trackers.py
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from rlfuse.run.config import RunConfig, to_dict

log = logging.getLogger(__name__)


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    """{"grpo": {"clip_high": 0.28}} -> {"grpo.clip_high": "0.28"}: MLflow params are flat strings."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)
    return out


class WandbTracker:
    name = "wandb"

    def __init__(self, spec, run_dir: Path, params: dict, run_name: str):
        import wandb  # optional dependency (extra `wandb`)

        self._wandb = wandb
        # reinit="create_new": each training run (and each test) is its own W&B run, even in one process
        self.run = wandb.init(project=spec.project, entity=spec.entity or None, name=spec.name or run_name,
                              tags=list(spec.tags) or None, mode=spec.mode, dir=str(run_dir), config=params,
                              reinit="create_new", settings=wandb.Settings(console="off", silent=True))

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_images(self, step: int, pngs: list[Path]) -> None:
        self.run.log({f"report/{p.stem}": self._wandb.Image(str(p)) for p in pngs}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    name = "mlflow"
    _BATCH = 100  # MLflow's limit on params per log_batch call

    def __init__(self, spec, run_dir: Path, params: dict, run_name: str):
        from mlflow.entities import Param  # optional dependency (extra `mlflow`)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=spec.tracking_uri or None)
        exp = self.client.get_experiment_by_name(spec.experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(spec.experiment)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        flat = [Param(k, v) for k, v in flatten(params).items()]
        for i in range(0, len(flat), self._BATCH):
            self.client.log_batch(self.run_id, params=flat[i:i + self._BATCH])

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def log_images(self, step: int, pngs: list[Path]) -> None:
        for p in pngs:
            self.client.log_artifact(self.run_id, str(p), "report")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackers:
    """The configured trackers behind one interface; see the module docstring's failure policy."""

    def __init__(self, trackers: list):
        self.trackers = list(trackers)
        self.last_step = 0

    def _call(self, what: str, fn_name: str, *args) -> None:
        for t in list(self.trackers):
            try:
                getattr(t, fn_name)(*args)
            # any error of a third-party logging client (network, auth, disk, its own bugs):
            # training must not die for it; the warning names it and the tracker goes off
            except Exception as e:  # noqa: BLE001 -- a tracker's failure (any library error) turns that tracker off, never the run
                log.warning("%s: %s failed (%s: %s); %s logging is off for the rest of this run "
                            "(metrics.jsonl has every row)", t.name, what, type(e).__name__, e, t.name)
                self.trackers.remove(t)

    def log(self, step: int, stage: str, row: dict) -> None:
        """A RunLog row: its scalars (None = not finite: skipped, as TensorBoard does)."""
        values = {f"{stage}/{k}": v for k, v in row.items() if k not in ("step", "stage") and v is not None}
        if self.trackers and values:
            self.last_step = max(self.last_step, step)
            self._call(f"logging step {step}", "log_metrics", step, values)

    def log_images(self, pngs: list[Path]) -> None:
        if self.trackers and pngs:
            self._call("uploading the report's plots", "log_images", self.last_step, pngs)

    def close(self) -> None:
        self._call("closing the run", "close")
        self.trackers = []

    def finish(self, run_dir: str | Path) -> None:
        """At the end of a run: render its report (`rlfuse report RUN_DIR`), hand the PNGs to
        the trackers, close them. A report that cannot be rendered is a warning."""
        if self.trackers:
            # matplotlib comes in only when a tracker wants the plots
            from rlfuse.run.report import render

            try:
                self.log_images(sorted(render(run_dir).parent.glob("*.png")))
            # the report reads the run's files back; a failure there must not fail the run
            except Exception as e:  # noqa: BLE001 -- a tracker's failure (any library error) turns that tracker off, never the run
                log.warning("trackers: could not render the report's plots (%s: %s); the metrics are logged "
                            "(rlfuse report %s renders them)", type(e).__name__, e, run_dir)
        self.close()

    def __bool__(self) -> bool:
        return bool(self.trackers)


def open_trackers(cfg: RunConfig, run_dir: str | Path, run_name: str) -> Trackers:
    """The trackers cfg.logging turns on (`logging.wandb`, `logging.mlflow`), each given the
    resolved config. A missing package or a failed start is a warning."""
    run_dir, logging_cfg, params = Path(run_dir), cfg.logging, to_dict(cfg)
    wanted = []
    if logging_cfg.wandb.project:
        wanted.append((WandbTracker, logging_cfg.wandb))
    if logging_cfg.mlflow.experiment:
        wanted.append((MlflowTracker, logging_cfg.mlflow))
    out = []
    for cls, spec in wanted:
        try:
            out.append(cls(spec, run_dir, params, run_name))
        except ImportError as e:
            log.warning("logging.%s is set but %s is not installed (%s): pip install 'rlfuse[%s]'; training "
                        "goes on without it", cls.name, cls.name, e, cls.name)
        # a tracker that cannot start (network, credentials, a bad tracking_uri) must not stop training
        except Exception as e:  # noqa: BLE001 -- a tracker's failure (any library error) turns that tracker off, never the run
            log.warning("logging.%s: could not start a %s run (%s: %s); training goes on without it "
                        "(metrics.jsonl has every row)", cls.name, cls.name, type(e).__name__, e)
        else:
            log.info("logging.%s: logging this run's config, metrics and report plots to %s", cls.name, cls.name)
    return Trackers(out)
