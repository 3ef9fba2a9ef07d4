"""Run kinds data-parallel on CPU (gloo, 2 processes) against one process: the Python API
with rows in memory and `trainer.generate`, and multi-turn GRPO episodes (an environment,
exact numerics).

One spawned 2-rank job (`_job`) runs:
  * `GRPOTrainer(folder, train_dataset=ROWS, dist=ctx)`: rank 0 writes the rows, every rank
    reads them and takes its share of each step; `generate` before training (greedy, and
    seeded sampling with n = 2, an odd number of prompts: the parts are uneven), then 2
    steps and the final export;
  * `run_grpo` with `rollout.env` (3 turns an episode, observations appended as ids),
    engine.numerics exact, the mismatch checked every step, fused projections on (under
    FSDP the engine fuses the gathered weights, the trainer runs them separate); each rank
    runs the episodes of its own prompts, seeded by their global index.
This process then runs both in one process and checks: the generated texts are equal; the
logged metrics within TOL; the final weights within WEIGHT_TOL (tests/test_distributed_run.py
explains both bounds); the mismatch is 0 at every step (the logged value is the max over
ranks, so 0 on every rank).
Run: python -m pytest -q tests/test_distributed_kinds.py -s
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from serve_helpers import write_model_folder
from spawn_ranks import free_port, gloo_rank, spawn_ranks
from test_distributed_run import NOT_COMPARED, TOL, WEIGHT_TOL, _max_diff
from train_setup import tiny_cfg

from rlfuse import GRPOTrainer
from rlfuse.model import load_model
from rlfuse.model.lora import lora_parameters
from rlfuse.run.distributed import context as D
from rlfuse.run.distributed.replicated import check_replicas
from rlfuse.run.metrics import read_metrics
from rlfuse.train.dpo import run_dpo
from rlfuse.train.grpo import run_grpo

WORLD = 2
ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
API_CFG = {"model": {"dtype": "float32", "device": "cpu", "kernel_backend": "torch"},
           "engine": {"max_num_seqs": 16, "max_model_len": 64, "fuse_projections": False},
           "data": {"max_prompt_len": 16}, "optim": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"},
           "logging": {"tensorboard": False, "progress": False}, "checkpoint": {"save_final": True}}
API_ARGS = {"steps": 2, "prompts_per_step": 4, "group_size": 2, "max_new_tokens": 3}
GEN_PROMPTS = ["1+2=", "3+0=", "2+2="]
ENV = '''
from rlfuse.rollout import Step


class Echo:
    """Three turns; each observation is a number; reward 1 if the last turn has an even length."""
    def reset(self, row, *, seed):
        self.n = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn):
        self.n += 1
        self.last = len(turn.token_ids)
        return Step(messages=[{"role": "tool", "content": str(self.n * 7)}], done=self.n >= 3)

    def reward(self):
        return float(self.last % 2 == 0)
'''


def longer(prompts, completions, **columns):
    """Reward by length: variance within every group (a module function: each rank imports it)."""
    return [float(len(c)) for c in completions]


def _api(folder: Path, run_dir: Path, dist=None) -> dict:
    t = GRPOTrainer(str(folder), reward_funcs=["arithmetic", longer], reward_weights=[1.0, 0.1], train_dataset=ROWS,
                    config=API_CFG, run_dir=run_dir, args=API_ARGS, dist=dist)
    out = {"greedy": t.generate(GEN_PROMPTS, max_tokens=4),
           "sampled": t.generate(GEN_PROMPTS, max_tokens=4, temperature=1.0, n=2, seed=7)}
    t.train()
    return out


def _episodes_cfg(tmp: Path, run_dir: Path):
    return tiny_cfg(run_dir, f"rollout.env={tmp / 'echo_env.py'}:Echo", "rollout.max_turn_tokens=4",
                    "rollout.max_total_tokens=40", "engine.numerics=exact", "grpo.check_every=1", "grpo.steps=2",
                    "grpo.group_size=2", "model.kernel_backend=auto", "grpo.eval_every=0", "data.eval_size=4",
                    "engine.fuse_projections=true", "checkpoint.save_final=true")


def _job(rank: int, port: int, out: str, folder: str) -> None:
    ctx = gloo_rank(rank, WORLD, port)
    out = Path(out)
    texts = _api(Path(folder), out / "api2", ctx)
    (out / f"texts2_rank{rank}.json").write_text(json.dumps(texts))
    run_grpo(_episodes_cfg(out, out / "episodes2"), dist=ctx)
    D.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_kinds")
    folder = write_model_folder(out / "base")
    (out / "echo_env.py").write_text(ENV)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (out / "texts1.json").write_text(json.dumps(_api(folder, out / "api1")))
        run_grpo(_episodes_cfg(out, out / "episodes1"))
        t0 = time.perf_counter()
        spawn_ranks(_job, WORLD, free_port(), str(out), str(folder))
        print(f"\n2-rank runs: {time.perf_counter() - t0:.1f} s")
    finally:
        torch.set_num_threads(n)
    return out


# by design not the one-process numbers: a time ratio (each rank's engine waits for its own
# environments) and the prefix-cache hit fraction (each rank's engine caches only its own
# episodes' prefixes, so fewer are shared than in one engine); and the trained-token fraction, a
# ratio of token sums that the ranks' mean approximates (rollout/trained_tokens_per_episode, a
# per-episode mean, is compared); and rollout/env_workers, the environment threads of each
# rank's engine (auto: one per episode of that engine's rollout)
TIMED = (*NOT_COMPARED, "rollout/engine_idle_frac", "rollout/continuation_cached_frac", "rollout/trained_frac",
         "rollout/env_workers")


def _rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMED)} for r in read_metrics(run_dir)]


def _weights_diff(a: Path, b: Path) -> float:
    wa, wb = load_model(a / "final", dtype="float32"), load_model(b / "final", dtype="float32")
    return max(float((x - y).abs().max()) for x, y in zip(wa.state_dict().values(), wb.state_dict().values()))


def save_adapters(ctx, model, out: Path, run: str) -> None:
    """A LoRA run's final adapters into out / {run}_rank{R}.pt; on ranks, first `check_replicas`
    (a ValueError on every rank when the replicas are not bitwise equal)."""
    if ctx is not None:
        check_replicas(ctx, model, "lora replicas")
    rank = 0 if ctx is None else ctx.rank
    torch.save({k: p.detach().clone() for k, p in lora_parameters(model)}, out / f"{run}_rank{rank}.pt")


def adapters_on_ranks(runs: Path, name: str, world: int) -> tuple[dict, list[dict], float]:
    """(one process's adapters, each rank's, max |rank 0's - one process's|) of the runs
    {name}1 and {name}2 (`save_adapters`); the ranks' replicas are asserted bitwise equal."""
    a1 = torch.load(runs / f"{name}1_rank0.pt")
    a2 = [torch.load(runs / f"{name}2_rank{r}.pt") for r in range(world)]
    assert all(torch.equal(a[k], a2[0][k]) for a in a2[1:] for k in a1)  # the replicas bitwise equal
    return a1, a2, max(float((a2[0][k] - a1[k]).abs().max()) for k in a1)


@pytest.mark.slow  # the module's 2-rank job and one-process runs: ~40 s on 2 cores
def test_generate_on_ranks_matches_one_process(runs):
    one = json.loads((runs / "texts1.json").read_text())
    for r in range(WORLD):  # every rank gets every text
        assert json.loads((runs / f"texts2_rank{r}.json").read_text()) == one
    assert len(one["greedy"]) == 3 and len(one["sampled"]) == 6


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["api", "episodes"])
def test_two_ranks_match_one_process(runs, kind):
    two, one = _rows(runs / f"{kind}2"), _rows(runs / f"{kind}1")
    assert len([r for r in two if r["stage"] == "grpo"]) == 2
    d, where = _max_diff(two, one)
    dw = _weights_diff(runs / f"{kind}2", runs / f"{kind}1")
    print(f"{kind}: 2 ranks vs 1 process, max |metric diff| {d:.2e} ({where}); final weights max |diff| {dw:.2e}")
    assert d <= TOL, where
    assert dw <= WEIGHT_TOL
    if kind == "api":  # every rank read rank 0's rows
        assert [json.loads(x) for x in (runs / "api2" / "data" / "train.jsonl").open()] == ROWS
    else:
        for r in (r for r in two if r["stage"] == "grpo"):
            assert r["rollout/turns_mean"] == 3.0 and r["rollout/obs_tokens_per_episode"] > 0
            assert r["mismatch/max_abs"] == 0.0 and r["mismatch/full_max_abs"] == 0.0


# ---------------------------------------------------------------------- DPO
def _dpo_cfg(run_dir: Path, reference: str):
    # batch 6 over 2 ranks (3 pairs each), packed by 40 tokens: ranks whose counts differ pad
    return tiny_cfg(run_dir, "dpo.steps=2", "dpo.batch_size=6", "dpo.micro_batch_tokens=40",
                    f"dpo.reference={reference}", "checkpoint.save_final=true", "engine.fuse_projections=false",
                    data={"train": "builtin:arithmetic_pref", "train_size": 40, "eval_size": 4},
                    rewards=[{"name": "arithmetic"}])


def _dpo_job(rank: int, port: int, out: str) -> None:
    ctx = gloo_rank(rank, WORLD, port)
    for ref in ("precompute", "live"):
        run_dpo(_dpo_cfg(Path(out) / f"dpo_{ref}2", ref), dist=ctx)
    D.shutdown()


@pytest.mark.slow  # one 2-rank job and two one-process runs: ~30 s on 2 cores
def test_dpo_two_ranks_match_one_process(tmp_path):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for ref in ("precompute", "live"):
            run_dpo(_dpo_cfg(tmp_path / f"dpo_{ref}1", ref))
        spawn_ranks(_dpo_job, WORLD, free_port(), str(tmp_path))
    finally:
        torch.set_num_threads(n)
    for ref in ("precompute", "live"):
        two, one = _rows(tmp_path / f"dpo_{ref}2"), _rows(tmp_path / f"dpo_{ref}1")
        assert len([r for r in two if r["stage"] == "dpo"]) == 2
        assert any(abs(r["rewards/margin"]) > 0 for r in two if r["stage"] == "dpo")  # it trained
        d, where = _max_diff(two, one)
        dw = _weights_diff(tmp_path / f"dpo_{ref}2", tmp_path / f"dpo_{ref}1")
        print(f"dpo ({ref}): 2 ranks vs 1 process, max |metric diff| {d:.2e} ({where}); weights {dw:.2e}")
        assert d <= TOL, where
        assert dw <= WEIGHT_TOL
