"""The non-finite step guard under data parallelism (gloo, 2 processes, CPU): the skip
decision is global.

Each rank holds only its share of the loss; the gradient norm is global. Here rank 1's
loss is made NaN while every gradient stays finite (the SFT step's loss handed to the
guard is poisoned after the backward). Both ranks must skip that optimizer step: the
fp32 master shards of both ranks, the full weights and the optimizer state stay bitwise
as they were, and the skip is counted in the step's metrics on both. A rank that decided
alone would skip while rank 0 stepped its shards: the weights would move by half.
The next, clean step steps on both ranks.
Run: python -m pytest -q tests/test_distributed_guard.py
"""

from __future__ import annotations

import json
import os

import torch
from spawn_ranks import free_port, spawn_ranks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from train_setup import tiny_cfg

from rlfuse.data.prompts import PromptStream, build_sft_examples
from rlfuse.run.distributed import context as D
from rlfuse.train.loop import make_optimizer
from rlfuse.train.session import open_session
from rlfuse.train.sft import SFTStep

WORLD = 2


def _full(model) -> dict[str, torch.Tensor]:
    """The full fp32 weights (a collective: every rank calls it)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.clone() for k, v in full.items()}


def _shards(model) -> dict[str, torch.Tensor]:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _job(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    env = {"WORLD_SIZE": str(WORLD), "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    ctx = D.init_distributed(D.launch_env(env), device_type="cpu", timeout_s=60)
    try:
        cfg = tiny_cfg(os.path.join(out_dir, "run"), "optim.max_nonfinite_steps=3")
        ses = open_session(cfg, need_target=True, dist=ctx)
        examples = build_sft_examples(ses.train_rows, ses.tokenizer, cfg.data, cfg.sft.max_seq_len)[:8]
        trainer = SFTStep(cfg, ses.model, make_optimizer(ses.model, cfg), PromptStream(examples), dist=ctx)
        guard_step = trainer.guard.step

        def nan_loss_on_rank_1(optimizer, lr=None, *, loss, grad_norm, where=""):
            if ctx.rank == 1:
                loss = loss + float("nan")
            return guard_step(optimizer, lr, loss=loss, grad_norm=grad_norm, where=where)

        full0, shards0 = _full(ses.model), _shards(ses.model)
        trainer.guard.step = nan_loss_on_rank_1
        m = trainer.train_step(examples, 0)
        full1, shards1 = _full(ses.model), _shards(ses.model)
        assert torch.isfinite(torch.tensor(m["grad_norm"])) and m["grad_norm"] > 0, m  # finite gradients
        assert m["optim/skipped_steps"] == 1.0, m
        assert (trainer.guard.consecutive, trainer.guard.total_skipped) == (1, 1)
        assert _same(shards0, shards1), f"rank {rank}: its weight shards changed in a skipped step"
        assert _same(full0, full1), f"rank {rank}: the full weights changed in a skipped step"
        assert not trainer.optimizer.opt.state, "the optimizer state was touched by a skipped step"

        trainer.guard.step = guard_step  # a clean step: every rank steps
        m2 = trainer.train_step(examples, 1)
        full2 = _full(ses.model)
        assert m2["optim/skipped_steps"] == 0.0 and trainer.guard.consecutive == 0
        assert not _same(full1, full2), "the clean step did not step"
        steps = {float(s["step"]) for s in trainer.optimizer.opt.state.values()}
        # the same on every rank: the full weights and the optimizer's step count
        every = [None] * WORLD
        torch.distributed.all_gather_object(every, ({k: v for k, v in full2.items()}, sorted(steps)))
        assert all(_same(every[0][0], e[0]) and e[1] == [1.0] for e in every), "ranks differ after the clean step"
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"skipped": m["optim/skipped_steps"], "skipped_after": m2["optim/skipped_steps"],
                       "total_skipped": trainer.guard.total_skipped}, f)
    finally:
        D.shutdown()


def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    spawn_ranks(_job, WORLD, free_port(), str(tmp_path))
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert got == [{"skipped": 1.0, "skipped_after": 0.0, "total_skipped": 1}] * WORLD


def _signal_job(rank: int, port: int, out_dir: str) -> None:
    """Rank 1 alone gets SIGTERM during step 0; both ranks must stop after step 1, with one
    (sharded) checkpoint of it."""
    import signal

    from rlfuse.run import Interrupted, stop_on_signals
    from rlfuse.train import run_sft

    torch.set_num_threads(1)
    env = {"WORLD_SIZE": str(WORLD), "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    ctx = D.init_distributed(D.launch_env(env), device_type="cpu", timeout_s=60)
    step = SFTStep.step

    def step_then_signal(self, s):
        m = step(self, s)
        if s == 0 and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return m
    SFTStep.step = step_then_signal
    got = None
    try:
        with stop_on_signals():
            run_sft(tiny_cfg(os.path.join(out_dir, "run")), dist=ctx)
    except Interrupted as e:
        got = {"signum": e.signum, "step": e.step, "checkpoint": e.checkpoint}
    finally:
        SFTStep.step = step
        D.shutdown()
    with open(os.path.join(out_dir, f"signal{rank}.json"), "w") as f:
        json.dump(got, f)


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    import signal

    spawn_ranks(_signal_job, WORLD, free_port(), str(tmp_path))
    got = [json.loads((tmp_path / f"signal{r}.json").read_text()) for r in range(WORLD)]
    ckpt = str(tmp_path / "run" / "checkpoints" / "step_000001")
    assert got == [{"signum": int(signal.SIGTERM), "step": 1, "checkpoint": ckpt}] * WORLD
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "COMPLETE").is_file()
