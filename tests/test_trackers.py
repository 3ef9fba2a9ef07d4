"""Experiment trackers (rlfuse.run.trackers), offline: W&B in offline mode (its run file
read back), MLflow against a local file store. A missing package, a failed start and a
tracker failing mid-run are warnings; training and metrics.jsonl go on.
Run: PYTHONPATH=$PWD python -m pytest -q tests/test_trackers.py
"""

from __future__ import annotations

import json
import logging
import shutil
import sys

import pytest

from rlfuse.run.config import load_config
from rlfuse.run.trackers import Trackers, flatten, open_trackers


def _cfg(*overrides):
    return load_config({"grpo": {"clip_high": 0.28, "loss_type": "dapo"}, "seed": 0}, list(overrides))


def _png(path):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1, 1))
    fig.add_subplot().plot([0, 1])
    fig.savefig(path)
    return path


def wandb_records(run_dir):
    """The records of the offline W&B run under run_dir: its .wandb file is a LevelDB-style
    log (7-byte file header; records of crc32 (4), length (2), type (1: full, 2 first,
    3 middle, 4 last) in 32 KiB blocks) of wandb_internal_pb2.Record messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, block, parts, out = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        n, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 1:
            out.append(chunk)
        elif kind in (2, 3):
            parts = (parts if kind == 3 else b"") + chunk
        elif kind == 4:
            out.append(parts + chunk)
    return [pb.Record.FromString(x) for x in out]


def test_flatten():
    params = {"grpo": {"clip_high": 0.28, "loss_type": "dapo"}, "rewards": [{"name": "arithmetic"}], "seed": 0}
    assert flatten(params) == {"grpo.clip_high": "0.28", "grpo.loss_type": "dapo",
                               "rewards": "[{'name': 'arithmetic'}]", "seed": "0"}


def test_wandb_offline_and_mlflow_file_store(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="needs the optional dependency wandb (pip install -e .[wandb])")
    pytest.importorskip("mlflow", reason="needs the optional dependency mlflow (pip install -e .[mlflow])")
    from mlflow.tracking import MlflowClient

    # MLflow 3 keeps its file store behind this opt-in (its default is a SQL database)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    cfg = _cfg("logging.wandb.project=rlfuse-test", "logging.wandb.name=tiny", "logging.wandb.tags=[ci]",
               "logging.wandb.mode=offline", f"logging.mlflow.tracking_uri={uri}", "logging.mlflow.experiment=rlfuse-test")
    tr = open_trackers(cfg, tmp_path, run_name="grpo")
    assert [t.name for t in tr.trackers] == ["wandb", "mlflow"]
    tr.log(0, "eval", {"step": 0, "stage": "eval", "accuracy": 0.25})
    tr.log(1, "grpo", {"step": 1, "stage": "grpo", "loss": 0.5, "kl": None})
    tr.log(2, "grpo", {"step": 2, "stage": "grpo", "loss": 0.25, "kl": 0.1})
    tr.log_images([_png(tmp_path / "grpo_reward.png")])
    run_id = tr.trackers[1].run_id
    tr.close()

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "grpo"
    assert run.data.params["grpo.clip_high"] == "0.28" and run.data.params["seed"] == "0"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "grpo/loss")] == [(1, 0.5), (2, 0.25)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "grpo/kl")] == [(2, 0.1)]  # None skipped
    assert [a.path for a in client.list_artifacts(run_id, "report")] == ["report/grpo_reward.png"]

    recs = wandb_records(tmp_path)
    runs = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    assert runs[0].project == "rlfuse-test" and runs[0].display_name == "tiny" and list(runs[0].tags) == ["ci"]
    config = {i.key: json.loads(i.value_json) for i in runs[0].config.update}
    assert config["grpo"]["clip_high"] == 0.28 and config["grpo"]["loss_type"] == "dapo" and config["seed"] == 0
    history = [{i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in recs
               if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["grpo/loss"]) for h in history if "grpo/loss" in h] == [(1, 0.5), (2, 0.25)]
    assert [h["eval/accuracy"] for h in history if "eval/accuracy" in h] == [0.25]
    assert any(h.get("report/grpo_reward._type") == "image-file" for h in history)


def test_missing_package_and_failed_start_are_warnings(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = _cfg("logging.wandb.project=p", "logging.mlflow.tracking_uri=nosuchscheme://x", "logging.mlflow.experiment=e")
    with caplog.at_level(logging.WARNING, logger="rlfuse.run.trackers"):
        tr = open_trackers(cfg, tmp_path, run_name="sft")
    assert not tr and tr.trackers == []
    text = caplog.text
    assert "logging.wandb is set but wandb is not installed" in text and "pip install 'rlfuse[wandb]'" in text
    assert "logging.mlflow: could not start" in text and "training goes on" in text
    tr.log(1, "sft", {"loss": 1.0})  # nothing to log to: no error
    tr.close()


def test_tracker_failing_mid_run_is_switched_off(tmp_path, monkeypatch, caplog):
    pytest.importorskip("mlflow", reason="needs the optional dependency mlflow (pip install -e .[mlflow])")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    cfg = _cfg(f"logging.mlflow.tracking_uri={(tmp_path / 'mlruns').as_uri()}", "logging.mlflow.experiment=e")
    tr = open_trackers(cfg, tmp_path, run_name="sft")
    tr.log(1, "sft", {"loss": 1.0})
    shutil.rmtree(tmp_path / "mlruns")  # the store vanishes mid-run

    class Recorder:  # a second tracker that keeps working
        name = "recorder"
        rows = []

        def log_metrics(self, step, values):
            self.rows.append((step, values))

        def close(self):
            pass

    tr.trackers.append(Recorder())
    with caplog.at_level(logging.WARNING, logger="rlfuse.run.trackers"):
        tr.log(2, "sft", {"loss": 0.5})
        tr.log(3, "sft", {"loss": 0.25})
    assert [t.name for t in tr.trackers] == ["recorder"]
    assert caplog.text.count("mlflow: logging step 2 failed") == 1 and "logging is off for the rest" in caplog.text
    assert Recorder.rows == [(2, {"sft/loss": 0.5}), (3, {"sft/loss": 0.25})]
    tr.close()


def test_no_tracker_configured(tmp_path):
    tr = open_trackers(_cfg(), tmp_path, run_name="sft")
    assert isinstance(tr, Trackers) and not tr
    with pytest.raises(ValueError, match="logging.wandb.mode must be one of"):
        _cfg("logging.wandb.mode=cloud")


def test_training_run_logs_to_both_trackers(tmp_path, monkeypatch):
    """A tiny SFT run with W&B (offline) and MLflow on: every metrics.jsonl row reaches both,
    the resolved config is the runs' parameters, the report's plots are uploaded at the end."""
    pytest.importorskip("wandb", reason="needs the optional dependency wandb (pip install -e .[wandb])")
    pytest.importorskip("mlflow", reason="needs the optional dependency mlflow (pip install -e .[mlflow])")
    from mlflow.tracking import MlflowClient
    from train_setup import one_thread, tiny_cfg, tiny_session

    from rlfuse.run.metrics import read_metrics
    from rlfuse.train.sft import run_sft

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    run_dir = tmp_path / "run"
    cfg = tiny_cfg(run_dir, "sft.steps=3", "logging.wandb.project=rlfuse-test", "logging.wandb.mode=offline",
                   f"logging.mlflow.tracking_uri={uri}", "logging.mlflow.experiment=rlfuse-test")
    with one_thread():
        run_sft(cfg, session=tiny_session(cfg, need_target=True))
    rows = read_metrics(run_dir)
    sft = [r for r in rows if r["stage"] == "sft"]
    assert [r["step"] for r in sft] == [1, 2, 3]

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("rlfuse-test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "run/sft" and run.info.status == "FINISHED"
    assert run.data.params["sft.steps"] == "3" and run.data.params["logging.mlflow.experiment"] == "rlfuse-test"
    hist = client.get_metric_history(run.info.run_id, "sft/loss")
    assert [(m.step, m.value) for m in hist] == [(r["step"], r["loss"]) for r in sft]
    pngs = sorted(p.name for p in (run_dir / "report").glob("*.png"))
    assert pngs and [a.path for a in client.list_artifacts(run.info.run_id, "report")] == [f"report/{p}" for p in pngs]

    recs = wandb_records(run_dir)
    history = [{i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in recs
               if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["sft/loss"]) for h in history if "sft/loss" in h] == [(r["step"], r["loss"]) for r in sft]
    assert sum(k.startswith("report/") and k.endswith("._type") for h in history for k in h) == len(pngs)
