"""Checkpoints: a run stopped after step k and resumed reproduces the uninterrupted run's
next steps exactly (CPU); rotation keeps the last M complete checkpoints; weights load in
transformers; an interrupted save leaves no visible checkpoint."""

import json

import pytest
import torch
from train_setup import tiny_cfg, tiny_session

from rlfuse.train import checkpoint as ck
from rlfuse.train.grpo import run_grpo
from rlfuse.train.sft import run_sft

# metrics that depend on the wall clock or the process, not on the math
_CLOCK = ("time/", "tokens_per_s", "memory/")


def _rows(run_dir, stage):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(_CLOCK)} for r in rows if r["stage"] == stage}


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_resume_reproduces_uninterrupted_run_exactly(tmp_path, kind):
    run = run_grpo if kind == "grpo" else run_sft
    need = kind == "sft"
    extra = ("grpo.mu=2", "grpo.dynamic_sampling=true") if kind == "grpo" else ()
    # uninterrupted: 4 steps, a checkpoint every 2
    full = tiny_cfg(tmp_path / "full", "checkpoint.every=2", *extra)
    run(full, session=tiny_session(full, need))
    # interrupted after step 2, then resumed (fresh model object, weights from the checkpoint)
    part = tiny_cfg(tmp_path / "part", "checkpoint.every=2", *extra)
    run(part, session=tiny_session(part, need), stop_after=2)
    assert ck.latest(tmp_path / "part").name == "step_000002"
    resumed = tiny_cfg(tmp_path / "part", "checkpoint.every=2", "checkpoint.resume=auto", *extra)
    ses = tiny_session(resumed, need)
    run(resumed, session=ses)
    a, b = _rows(tmp_path / "full", kind), _rows(tmp_path / "part", kind)
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        assert a[step] == b[step], f"step {step} differs after resume"
    assert "loss" in a[4]


def test_rotation_and_atomic_save(tmp_path, monkeypatch):
    cfg = tiny_cfg(tmp_path)
    ses = tiny_session(cfg)
    from rlfuse.train.sft import make_optimizer
    opt = make_optimizer(ses.model, cfg)
    for step in (1, 2, 3):
        ck.save_checkpoint(tmp_path, step, ses.model, opt, {"data": {"position": step}}, tokenizer=ses.tokenizer,
                           keep_last=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck.torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(tmp_path, 4, ses.model, opt, {}, keep_last=2)
    # nothing half-written is visible, and resume still finds step 3
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert ck.resolve_resume("auto", tmp_path).name == "step_000003"
    assert ck.resolve_resume("never", tmp_path) is None
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ck.resolve_resume(str(tmp_path / "nope"), tmp_path)


def test_checkpoint_weights_load_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_cfg(tmp_path, "checkpoint.save_final=true")
    ses = tiny_session(cfg, need_target=True)
    run_sft(cfg, session=ses)
    path = ck.latest(tmp_path) / "model"
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([ses.tokenizer.encode("7+8=")])
    with torch.no_grad():
        ours = ses.model.logits(ses.model.forward_padded(ids))
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert tok("7+8=").input_ids == ses.tokenizer.encode("7+8=")
