"""PPO data-parallel on CPU (gloo, 2 processes, tiny fp32 model, the real engine) against
one process: policy and critic FSDP2-sharded, the rollout split by prompts, every sample's
values and KL all-gathered so GAE, whitening, reward normalization and the adaptive KL
coefficient are global, the critic's weights and optimizer state in the checkpoint's
trainer state (gathered on rank 0, the one-process form).

One spawned 2-rank job (`_job`) runs, through `run_ppo` with a DistContext:
  * PPO, 4 steps (KL to a reference copy with an adaptive coefficient, reward
    normalization, whitening, mu = 2, 2 mini-batches: rank 1 holds none of mini-batch 0's
    samples and pads; checkpoints at steps 2 and 4, final export on rank 0);
  * the same run stopped after step 2 and resumed (`checkpoint.resume=auto`);
  * PPO resumed from a one-process run's step-2 checkpoint (1 -> 2: the critic's
    one-process state sharded);
  * multi-turn PPO (an environment, 3 turns an episode), 2 steps: each rank runs the
    episodes of its own prompts, seeded by their global index.
This process then runs the same recipe in one process, resumes the 2-rank step-2
checkpoint in one process (2 -> 1), and checks: every logged metric within TOL of the
one-process run's and the final weights within WEIGHT_TOL (tests/test_distributed_run.py
explains both bounds); the resumed 2-rank run bitwise the uninterrupted one; both
resharded resumes within TOL; the mismatch logged as 0 (exact numerics) on every rank.
Run: python -m pytest -q -m slow tests/test_distributed_ppo.py -s   (-s prints the differences)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spawn_ranks import gloo_rank, run_ranks, torch_threads
from test_distributed_kinds import ENV, TIMED
from test_distributed_run import NOT_COMPARED, TOL, WEIGHT_TOL, _max_diff
from train_setup import tiny_cfg

from rlfuse.model import load_model
from rlfuse.run.distributed import context as D
from rlfuse.run.metrics import read_metrics
from rlfuse.train.ppo import run_ppo

WORLD = 2
PPO = {"steps": 4, "prompts_per_step": 4, "samples_per_prompt": 2, "max_new_tokens": 3, "mu": 2,
       "mini_batches": 2, "critic_lr": 1e-2, "kl_coef": 0.1, "kl_target": 1.0, "reward_norm": True,
       "micro_batch_tokens": 24}
OVER = ("checkpoint.every=2", "checkpoint.save_final=true", "engine.fuse_projections=false",
        "engine.numerics=exact", "model.kernel_backend=auto")


def _cfg(run_dir: Path, *over: str):
    return tiny_cfg(run_dir, *OVER, *over, ppo=PPO)


def _job(rank: int, port: int, out: str) -> None:
    ctx = gloo_rank(rank, WORLD, port)
    out = Path(out)
    run_ppo(_cfg(out / "ppo2"), dist=ctx)
    run_ppo(_cfg(out / "stop2"), dist=ctx, stop_after=2)
    run_ppo(_cfg(out / "stop2", "checkpoint.resume=auto"), dist=ctx)
    run_ppo(_cfg(out / "reshard2", "checkpoint.resume=auto"), dist=ctx)  # a one-process checkpoint
    run_ppo(_episodes_cfg(out, out / "episodes2"), dist=ctx)
    D.shutdown()


def _episodes_cfg(tmp: Path, run_dir: Path):
    return tiny_cfg(run_dir, f"rollout.env={tmp / 'echo_env.py'}:Echo", "rollout.max_turn_tokens=4",
                    "rollout.max_total_tokens=40", "engine.numerics=exact", "model.kernel_backend=auto",
                    "rollout.env_workers=2",  # auto is one thread per episode: per rank by nature
                    "data.eval_size=4", "checkpoint.save_final=true", "engine.fuse_projections=false",
                    ppo={**PPO, "steps": 2, "mini_batches": 1})


def _resume_from(run: Path, new: Path) -> None:
    shutil.copytree(run / "checkpoints" / "step_000002", new / "checkpoints" / "step_000002")
    shutil.copy(run / "metrics.jsonl", new / "metrics.jsonl")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_ppo")
    with torch_threads(1):
        (out / "echo_env.py").write_text(ENV)
        run_ppo(_cfg(out / "ppo1"))
        run_ppo(_episodes_cfg(out, out / "episodes1"))
        _resume_from(out / "ppo1", out / "reshard2")  # 1 -> 2, resumed in _job
        run_ranks(_job, WORLD, out, "PPO")
        _resume_from(out / "ppo2", out / "reshard1")  # 2 -> 1
        run_ppo(_cfg(out / "reshard1", "checkpoint.resume=auto"))
    return out


def _rows(run_dir: Path) -> list[dict]:
    # critic/update_ratio: as optim/update_ratio, measured by the one-process optimizer only
    skip = (*NOT_COMPARED, "critic/update_ratio")
    return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in read_metrics(run_dir)]


@pytest.mark.slow  # one 2-rank job (4 runs) and two one-process runs
def test_ppo_two_ranks_match_one_process(runs):
    two, one = _rows(runs / "ppo2"), _rows(runs / "ppo1")
    steps = [r for r in two if r["stage"] == "ppo"]
    assert len(steps) == 4
    d, where = _max_diff(two, one)
    w2, w1 = load_model(runs / "ppo2" / "final", dtype="float32"), load_model(runs / "ppo1" / "final", dtype="float32")
    dw = max(float((a - b).abs().max()) for a, b in zip(w2.state_dict().values(), w1.state_dict().values()))
    print(f"PPO: 2 ranks vs 1 process, max |metric diff| {d:.2e} ({where}); final weights max |diff| {dw:.2e}")
    assert d <= TOL, where
    assert dw <= WEIGHT_TOL
    assert all(r["mismatch/max_abs"] == 0.0 for r in steps)  # exact numerics: 0 on every rank (max over ranks)
    assert any(abs(r["kl"]) > 0 for r in steps) and len({r["kl_coef"] for r in steps}) > 1  # KL and its adaptation
    assert any(r["critic/value_loss"] > 0 for r in steps)


@pytest.mark.slow
def test_multi_turn_ppo_two_ranks_match_one_process(runs):
    skip = (*TIMED, "critic/update_ratio")  # per engine by nature (test_distributed_kinds.py), as above
    two, one = ([{k: v for k, v in r.items() if not k.startswith(skip)} for r in read_metrics(runs / f"episodes{n}")]
                for n in (2, 1))
    steps = [r for r in two if r["stage"] == "ppo"]
    assert len(steps) == 2 and all(r["rollout/turns_mean"] == 3.0 for r in steps)
    d, where = _max_diff(two, one)
    print(f"multi-turn PPO: 2 ranks vs 1 process, max |metric diff| {d:.2e} ({where})")
    assert d <= TOL, where
    assert all(r["mismatch/max_abs"] == 0.0 for r in steps)


@pytest.mark.slow
def test_ppo_resume_same_n_exact_and_other_n_within_tol(runs):
    assert _rows(runs / "stop2") == _rows(runs / "ppo2")
    for a, b in zip(load_model(runs / "stop2" / "final").parameters(), load_model(runs / "ppo2" / "final").parameters()):
        assert torch.equal(a, b)
    for new, old, what in (("reshard1", "ppo2", "2 -> 1"), ("reshard2", "ppo1", "1 -> 2")):
        d, where = _max_diff(_rows(runs / new), _rows(runs / old))
        print(f"PPO resume {what}: max |metric diff| {d:.2e} ({where})")
        assert d <= TOL, where


RECIPE = """seed: 0
model: {random_init: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2,
        num_key_value_heads: 1, head_dim: 16, max_position_embeddings: 64},
        tokenizer: char, dtype: float32, device: cpu, kernel_backend: torch}
data: {train: "builtin:arithmetic", task: {digits: 1, ops: "+-"}, train_size: 40, eval_size: 6, max_prompt_len: 16}
rewards: [{name: arithmetic}, {name: length_penalty, kwargs: {max_len: 3}}]
ppo: {steps: 2, prompts_per_step: 4, samples_per_prompt: 2, max_new_tokens: 3, kl_coef: 0.1}
checkpoint: {every: 1}
logging: {tensorboard: false, progress: false}
"""


@pytest.mark.slow  # torchrun, 2 processes: ~20 s on 2 cores
def test_torchrun_ppo_command(tmp_path):
    """`rlfuse ppo` under torchrun (the CLI's PPOTrainer with the process group): rank 0's
    summary only, a sharded checkpoint per step, the final weights."""
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--monitor_interval=0.2", "-m", "rlfuse", "ppo", str(tmp_path / "recipe.yaml"),
           "--run-dir", str(tmp_path / "run"), "--dist-timeout", "60"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("ppo done") == 1, out.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["stage"] == "ppo"] == [1, 2]
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_000002" / "state.pt", weights_only=False)
    # the critic's optimizer state gathered on rank 0: 2 steps x mu 4 x 1 mini-batch optimizer steps
    assert state["world_size"] == WORLD and state["critic_optimizer"]["step"] == 8
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
