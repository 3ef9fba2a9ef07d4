"""The shared run loop with a stand-in trainer (no training): which steps are logged,
sampled, evaluated and checkpointed; stop_when ends the run with the final save;
stop_after + resume hands the trainer its saved state and continues at the right step."""

import json

import torch
from train_setup import tiny_cfg, tiny_session

from rlfuse.run import checkpoint as ck
from rlfuse.train.loop import Evaluation, Schedule, make_optimizer, run_loop


class CountingTrainer:
    stage = "fake"

    def __init__(self, ses, schedule):
        self.model, self.optimizer, self.schedule = ses.model, make_optimizer(ses.model, ses.cfg), schedule
        self.calls, self.position, self.loaded = [], 0, None

    def step(self, step):
        self.calls.append(step)
        self.position += 1
        return {"loss": float(step), "time/step": 0.0}

    def state_dict(self):
        return {"data": {"position": self.position}}

    def load_state_dict(self, state):
        self.loaded = state
        self.position = state["data"]["position"]

    def samples(self):
        return [{"completion": f"after {self.position}"}] * 9


def _rows(run_dir, stage):
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(x)["stage"] == stage]


def _setup(run_dir, *over):
    cfg = tiny_cfg(run_dir, *over)
    ses = tiny_session(cfg)
    ev = Evaluation(prompts=ses.eval_prompts()[:2], rewards=ses.rewards(), max_new_tokens=2)
    return ses, ev


def test_cadences(tmp_path):
    ses, ev = _setup(tmp_path, "logging.log_every=2", "checkpoint.every=2", "checkpoint.save_final=true",
                     "checkpoint.keep_last=9", "logging.num_samples=3")
    tr = CountingTrainer(ses, Schedule(steps=5, eval_every=2, eval_at_start=True, sample_every=2))
    res = run_loop(tr, ses, evaluation=ev)
    assert tr.calls == [0, 1, 2, 3, 4] and res["steps"] == 5
    assert _rows(tmp_path, "fake") == [2, 4, 5] and [r["step"] for r in res["history"]] == [2, 4, 5]
    assert _rows(tmp_path, "eval") == [0, 2, 4, 5] and [e["step"] for e in res["evals"]] == [0, 2, 4, 5]
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2] * 3 + [4] * 3
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_000002", "step_000004", "step_000005"]
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_stop_when_ends_the_run_with_the_final_save(tmp_path):
    ses, ev = _setup(tmp_path, "checkpoint.save_final=true")
    tr = CountingTrainer(ses, Schedule(steps=10))
    res = run_loop(tr, ses, evaluation=ev, stop_when=lambda done: done == 3)
    assert tr.calls == [0, 1, 2] and res["steps"] == 3
    assert [e["step"] for e in res["evals"]] == [3]  # no eval at the start unless asked
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_000003"]
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_stop_after_then_resume_continues_with_the_trainers_state(tmp_path):
    ses, _ = _setup(tmp_path, "checkpoint.every=2")
    tr = CountingTrainer(ses, Schedule(steps=4))
    res = run_loop(tr, ses, stop_after=2)
    assert tr.calls == [0, 1] and res["steps"] == 2 and not (tmp_path / "final").exists()
    ses, _ = _setup(tmp_path, "checkpoint.every=2", "checkpoint.resume=auto")
    tr = CountingTrainer(ses, Schedule(steps=4))
    res = run_loop(tr, ses)
    assert tr.loaded["step"] == 2 and tr.loaded["data"] == {"position": 2}
    assert tr.calls == [2, 3] and tr.position == 4
    assert _rows(tmp_path, "fake") == [1, 2, 3, 4]  # rows up to the checkpoint kept, then continued
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_logged_rows_carry_the_update_ratio(tmp_path):
    """A trainer whose steps step the optimizer: each logged row has optim/update_ratio, the
    step's relative weight update (a step without an optimizer step has none)."""
    ses, _ = _setup(tmp_path)
    tr = CountingTrainer(ses, Schedule(steps=3))
    real_step = tr.step

    def step(s):
        if s != 1:  # step 1 takes no optimizer step
            for p in tr.model.parameters():
                p.grad = torch.ones_like(p)
            tr.optimizer.step(1e-3)
            tr.optimizer.zero_grad()
        return real_step(s)
    tr.step = step
    rows = run_loop(tr, ses)["history"]
    assert [("optim/update_ratio" in r) for r in rows] == [True, False, True]
    assert all(0 < float(r["optim/update_ratio"]) < 1 for r in rows if "optim/update_ratio" in r)
