"""Checkpoints: a run stopped after step k and resumed reproduces the uninterrupted run's
next steps exactly (CPU); rotation keeps the last M complete checkpoints; weights load in
transformers; an interrupted save leaves no visible checkpoint."""

import json
from pathlib import Path

import pytest
import torch
from train_setup import tiny_cfg, tiny_session

from rlfuse.run import checkpoint as ck
from rlfuse.run import resume as rs
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
    # the data checks' row: written once, at the start; the resumed run keeps it, adds none
    data = [[r for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())
             if r["stage"] == "data"] for run in ("full", "part")]
    assert len(data[0]) == 1 and data[0] == data[1] and data[0][0]["train/kept"] > 0


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
    with pytest.raises(ck.CheckpointError, match=r"cannot write .*step_000004: disk full.*GiB free on that disk; "
                                                 r"the previous checkpoints are untouched"):
        ck.save_checkpoint(tmp_path, 4, ses.model, opt, {}, keep_last=2)
    # nothing half-written is visible, and resume still finds step 3
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert rs.resolve_resume("auto", tmp_path).name == "step_000003"
    assert rs.resolve_resume("never", tmp_path) is None
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        rs.resolve_resume(str(tmp_path / "nope"), tmp_path)


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


@pytest.fixture
def saved(tmp_path):
    """A run folder with checkpoints at steps 1, 2, 3 (keep_last=3) and what wrote them."""
    cfg = tiny_cfg(tmp_path)
    ses = tiny_session(cfg)
    from rlfuse.train.sft import make_optimizer
    opt = make_optimizer(ses.model, cfg)
    for step in (1, 2, 3):
        ck.save_checkpoint(tmp_path, step, ses.model, opt, {"data": {"position": step}}, keep_last=3)
    return tmp_path, ses.model, opt


def test_rotation_removes_the_completion_marker_before_the_files(saved, monkeypatch):
    run, model, opt = saved
    seen, real_rmtree = [], ck.shutil.rmtree

    def rmtree_fails(path, *a, **k):  # a rotation cut short (kill, I/O error) after the marker went
        if not Path(path).name.startswith("step_"):
            return real_rmtree(path, *a, **k)
        seen.append((path.name, (path / "COMPLETE").exists()))
        raise OSError("interrupted")

    monkeypatch.setattr(ck.shutil, "rmtree", rmtree_fails)
    ck.save_checkpoint(run, 4, model, opt, {"data": {"position": 4}}, keep_last=2)
    assert seen[-2:] == [("step_000001", False), ("step_000002", False)]
    # the half-removed folders no longer count as checkpoints
    assert [p.name for p in ck.list_checkpoints(run)] == ["step_000003", "step_000004"]


def test_resume_skips_a_damaged_newest_checkpoint_and_says_so(saved, caplog):
    run, model, opt = saved
    weights = run / "checkpoints/step_000003/model/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a torn write
    assert "model.safetensors" in rs.verify_checkpoint(weights.parents[1])
    assert rs.resolve_resume("auto", run).name == "step_000002"
    assert "checkpoint step_000003 is damaged (model/model.safetensors" in caplog.text
    assert "resuming from the previous intact checkpoint step_000002" in caplog.text
    state = rs.load_checkpoint(rs.resolve_resume("auto", run), model, opt)
    assert state["step"] == 2
    (run / "checkpoints/step_000002/optimizer.pt").write_bytes(b"garbage")
    (run / "checkpoints/step_000001/state.pt").unlink()
    with pytest.raises(ck.CheckpointError, match=r"no intact checkpoint to resume from \(step_000003: .*; "
                                                 r"step_000002: optimizer.pt: 7 bytes, \d+ when saved; "
                                                 r"step_000001: state.pt: missing\)"):
        rs.resolve_resume("auto", run)
    with pytest.raises(ck.CheckpointError, match=r"step_000002 is damaged \(optimizer.pt"):
        rs.resolve_resume(str(run / "checkpoints/step_000002"), run)


def test_leftover_temporary_folders_are_cleaned_at_start(saved, caplog):
    run, _, _ = saved
    (run / "checkpoints/.step_000004.tmp123/model").mkdir(parents=True)
    (run / ".final.tmpabc").mkdir()
    # a save cut between its two renames: the previous copy is put back, not deleted
    (run / "checkpoints/step_000003").rename(run / "checkpoints/.step_000003.old")
    assert rs.resolve_resume("never", run) is None
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002", "step_000003"]
    assert not (run / ".final.tmpabc").exists()
    assert "a temporary folder left by an interrupted save" in caplog.text


def test_nothing_to_resume_is_said_plainly(tmp_path, caplog):
    assert rs.resolve_resume("auto", tmp_path) is None
    assert "nothing to resume (no complete checkpoint in" in caplog.text


def test_non_finite_weights_are_never_written(saved):
    run, model, opt = saved
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(ck.NonFiniteError, match=r"step_000004: refusing to write non-finite weights \(NaN/inf in "
                                                r"1 tensors, e\.g\. "):
        ck.save_checkpoint(run, 4, model, opt, {}, keep_last=2)
    with pytest.raises(ck.NonFiniteError, match=r"final: refusing to write non-finite weights"):
        ck.save_final(run, model)
    assert [p.name for p in ck.list_checkpoints(run)] == ["step_000001", "step_000002", "step_000003"]
    assert not (run / "final").exists()


def test_checkpoint_folders_get_normal_permissions(saved):
    import os
    run, _, _ = saved
    mode = (run / "checkpoints/step_000003").stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o777 & ~umask


def test_cuda_rng_states_restore_onto_fewer_devices(monkeypatch):
    """A checkpoint of a 2-GPU torchrun rank holds two CUDA RNG states; resuming it in one
    process that sees one GPU restores device 0's and leaves the other (it raised
    IndexError in torch.cuda.set_rng_state_all on 2 x H100)."""
    import torch

    from rlfuse.run import checkpoint as ck

    st = ck.rng_state()
    st["cuda"] = [torch.tensor([1], dtype=torch.uint8), torch.tensor([2], dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: restored.append((i, int(s[0]))))
    ck.set_rng_state(st)
    assert restored == [(0, 1)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    restored.clear()
    ck.set_rng_state(st)
    assert restored == [(0, 1), (1, 2)]
