"""The real commands data-parallel on CPU (gloo, 2 processes, tiny fp32 model, the real
engine) against one process.

One spawned 2-rank job (`_job`) runs, through `run_grpo` / `run_sft` with a DistContext:
  * GRPO, 4 steps (KL reference, mu = 2, 2 mini-batches: rank 1 holds none of mini-batch
    0's groups and pads; sharded checkpoints at steps 2 and 4, final export on rank 0);
  * the same GRPO run stopped after step 2 and resumed (`checkpoint.resume=auto`);
  * SFT, 4 steps (8 examples split 4 / 4, unequal micro-batch counts per rank);
  * GRPO resumed from a one-process run's step-2 checkpoint (resharding 1 -> 2).
Then this process (no process group) runs the same recipes in one process and checks:
  * every logged metric of the 2-rank runs equals the one-process run's within TOL (the
    engine's sampling keys hash (seed, prompt, k), so each rank samples exactly what one
    process samples for those prompts; differences are fp32 sum orders);
  * the resumed 2-rank run is bitwise the uninterrupted one (same N);
  * the 2-rank step-2 checkpoint resumes in one process (MasterAdamW), and the
    one-process step-2 checkpoint on 2 ranks, each within TOL of the run that wrote it;
  * `rlfuse generate` and `rlfuse eval` read the sharded checkpoint; the rank-0 HF export
    holds the same weights and `transformers` loads it.
Under torchrun: `python -m rlfuse grpo` with 2 processes ends with rank 0's summary only;
a reward that raises on rank 1 (in the first evaluation) stops every rank with rank 1's
message.
Run: python -m pytest -q tests/test_distributed_run.py -s   (-s prints the measured differences)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from spawn_ranks import gloo_rank, run_ranks, torch_threads
from train_setup import tiny_cfg

from rlfuse.cli import main
from rlfuse.model import load_model
from rlfuse.run.distributed import context as D
from rlfuse.run.metrics import read_metrics
from rlfuse.run.resume import load_model_folder
from rlfuse.train.grpo import run_grpo
from rlfuse.train.sft import run_sft

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
# engine.fuse_projections off: sharded ranks fuse only the engine's gathered weights (their
# training forwards run the separate projections), so with fusion on a one-process run (fused
# training forwards) would also differ by the fused GEMMs' fast-numerics rounding
GRPO = ("grpo.kl_coef=0.05", "grpo.mu=2", "grpo.mini_batches=2", "checkpoint.every=2", "checkpoint.save_final=true",
        "engine.fuse_projections=false")
SFT = ("sft.micro_batch_tokens=24",)
# 2 ranks vs one process, fp32: the rollouts are the same samples; the gradient is summed
# in another order (each rank packs its own micro-batches, then the reduce-scatter adds the
# ranks) and the losses, mismatch and entropy statistics are per-rank partial sums added
# across ranks. Measured (print with -s), max |difference| / max(1, |value|) over every
# logged metric: GRPO 4.8e-7, SFT 1.1e-6 (grad norm); final weights after 4 steps: GRPO
# 2.1e-7, SFT 4.0e-6 (Adam turns a gradient difference dg into lr dg / (|g| + eps), large
# where |g| is itself at the rounding level: docs/distributed.md). Bounds: metrics 1e-5,
# weights 1e-3 x lr, as tests/test_distributed.py.
TOL = 1e-5
WEIGHT_TOL = 1e-3 * 1e-2  # tiny_cfg's optim.lr
# optim/update_ratio: measured by the one-process optimizer only (FSDP2's sharded one has
# no whole-tensor norms without another all-reduce; not logged there yet)
NOT_COMPARED = ("time/", "tokens_per_s", "memory/", "optim/update_ratio")


def _grpo(run_dir, *over):
    return tiny_cfg(run_dir, *GRPO, *over)


def _sft(run_dir, *over):
    return tiny_cfg(run_dir, *SFT, *over)


def _job(rank: int, port: int, out: str) -> None:
    ctx = gloo_rank(rank, WORLD, port)
    out = Path(out)
    run_grpo(_grpo(out / "grpo2"), dist=ctx)
    run_grpo(_grpo(out / "stop2"), dist=ctx, stop_after=2)
    run_grpo(_grpo(out / "stop2", "checkpoint.resume=auto"), dist=ctx)
    run_sft(_sft(out / "sft2"), dist=ctx)
    run_grpo(_grpo(out / "reshard2", "checkpoint.resume=auto"), dist=ctx)  # a one-process checkpoint
    D.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_runs")
    with torch_threads(1):
        run_grpo(_grpo(out / "grpo1"))
        run_sft(_sft(out / "sft1"))
        _resume_from(out / "grpo1", out / "reshard2")  # 1 -> 2, resumed in _job
        run_ranks(_job, WORLD, out, "")
        _resume_from(out / "grpo2", out / "reshard1")  # 2 -> 1
        run_grpo(_grpo(out / "reshard1", "checkpoint.resume=auto"))
    return out


def _resume_from(run: Path, new: Path) -> None:
    """A run folder holding `run`'s step-2 checkpoint and its metrics (resumed from there)."""
    shutil.copytree(run / "checkpoints" / "step_000002", new / "checkpoints" / "step_000002")
    shutil.copy(run / "metrics.jsonl", new / "metrics.jsonl")


def _rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in read_metrics(run_dir)]


def _max_diff(a: list[dict], b: list[dict]) -> tuple[float, str]:
    assert [(r["step"], r["stage"], sorted(r)) for r in a] == [(r["step"], r["stage"], sorted(r)) for r in b]
    worst, where = 0.0, ""
    for x, y in zip(a, b):
        for k, v in x.items():
            if k in ("step", "stage") or v is None:
                assert y[k] is None if v is None else True, (k, v, y[k])
                continue
            d = abs(v - y[k]) / max(1.0, abs(y[k]))  # relative for large values (grad norms), else absolute
            if d > worst:
                worst, where = d, f"{x['stage']} step {x['step']} {k}"
    return worst, where


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_two_ranks_match_one_process(runs, kind):
    two, one = _rows(runs / f"{kind}2"), _rows(runs / f"{kind}1")
    assert len([r for r in two if r["stage"] == kind]) == 4
    d, where = _max_diff(two, one)
    print(f"{kind}: 2 ranks vs 1 process, max |metric diff| {d:.2e} ({where})")
    assert d <= TOL, where
    if kind == "grpo":  # the run trained: the losses are not all zero, and padding ran (rank 1 in mini-batch 0)
        assert any(abs(r["kl"]) > 0 for r in two if r["stage"] == "grpo")
    w2 = load_model(runs / f"{kind}2" / "final", dtype="float32")
    w1 = load_model(runs / f"{kind}1" / "final", dtype="float32")
    dw = max(float((a - b).abs().max()) for a, b in zip(w2.state_dict().values(), w1.state_dict().values()))
    print(f"{kind}: final weights max |diff| {dw:.2e}")
    assert dw <= WEIGHT_TOL


def test_resume_at_the_same_n_is_exact(runs):
    assert _rows(runs / "stop2") == _rows(runs / "grpo2")
    for a, b in zip(load_model(runs / "stop2" / "final").parameters(), load_model(runs / "grpo2" / "final").parameters()):
        assert torch.equal(a, b)


def test_checkpoints_resume_at_another_number_of_ranks(runs):
    """2 -> 1: the sharded checkpoint into MasterAdamW; 1 -> 2: the one-process checkpoint
    into the shards. Each continues within TOL of the run that wrote it."""
    for new, old, what in (("reshard1", "grpo2", "2 -> 1"), ("reshard2", "grpo1", "1 -> 2")):
        d, where = _max_diff(_rows(runs / new), _rows(runs / old))
        print(f"resume {what}: max |metric diff| {d:.2e} ({where})")
        assert d <= TOL, where
    state = torch.load(runs / "grpo2" / "checkpoints" / "step_000002" / "state.pt", weights_only=False)
    assert state["world_size"] == WORLD and len(state["rng_per_rank"]) == WORLD


def test_sharded_checkpoint_reads_in_generate_eval_and_transformers(runs, capsys):
    step4 = runs / "grpo2" / "checkpoints" / "step_000004"
    assert (step4 / "dcp" / ".metadata").exists() and not (step4 / "model").exists()
    final = runs / "grpo2" / "final"
    for a, b in zip(load_model_folder(step4).parameters(), load_model(final).parameters()):
        assert torch.equal(a, b)  # fp32 run: the export is the masters
    args = ["--prompt", "3+4=", "--prompt", "9-2=", "--max-tokens", "3", "--device", "cpu", "--json"]
    assert main(["generate", str(step4), *args]) == 0
    from_ckpt = capsys.readouterr().out
    assert main(["generate", str(final), *args]) == 0
    assert capsys.readouterr().out == from_ckpt
    cfg_path = runs / "grpo2" / "config.yaml"
    assert main(["eval", str(cfg_path), "--checkpoint", str(step4), "--run-dir", str(runs / "eval"), "--limit", "4"]) == 0
    assert json.loads((runs / "eval" / "eval.json").read_text())["num_problems"] == 4.0
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    ours = dict(load_model(final).named_parameters())
    assert torch.equal(hf.model.embed_tokens.weight, ours["model.embed_tokens.weight"])


# ---------------------------------------------------------------------- torchrun
RECIPE = """seed: 0
model: {random_init: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2,
        num_key_value_heads: 1, head_dim: 16, max_position_embeddings: 64},
        tokenizer: char, dtype: float32, device: cpu, kernel_backend: torch}
data: {train: "builtin:arithmetic", task: {digits: 1, ops: "+-"}, train_size: 40, eval_size: 6, max_prompt_len: 16}
rewards: [{name: arithmetic}, {name: %s}]
grpo: {steps: 2, prompts_per_step: 4, group_size: 2, max_new_tokens: 3}
logging: {tensorboard: false, progress: false}
"""
REWARD = '''import os


def picky(prompts, completions, **columns):
    if os.environ.get("RANK") == "1":  # this rank's samples are bad (the test's failure)
        raise ValueError("picky: cannot score this rank's completions")
    return [0.0 for _ in completions]


def fine(prompts, completions, **columns):
    return [float(len(c)) for c in completions]
'''


def _torchrun(tmp_path: Path, reward: str, timeout: float):
    (tmp_path / "reward.py").write_text(REWARD)
    (tmp_path / "recipe.yaml").write_text(RECIPE % f"{tmp_path / 'reward.py'}:{reward}")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           "--monitor_interval=0.2", "-m", "rlfuse", "grpo", str(tmp_path / "recipe.yaml"),
           "--run-dir", str(tmp_path / "run"), "--dist-timeout", "30"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return out, time.perf_counter() - t0


def test_torchrun_grpo_command(tmp_path):
    out, dt = _torchrun(tmp_path, "fine", timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("grpo done") == 1, out.stdout  # rank 0 only
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows if r["stage"] == "grpo"] == [1, 2]
    assert all(r["memory/optimizer_mib"] > 0 for r in rows if r["stage"] == "grpo")
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
    print(f"torchrun 2-process grpo: {dt:.1f} s")


def test_torchrun_raising_rank_stops_every_rank_with_its_message(tmp_path):
    out, dt = _torchrun(tmp_path, "picky", timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    errors = [x for x in text.splitlines() if x.startswith("rlfuse: error: ")]
    assert len(errors) == WORLD, text[-3000:]  # both ranks stop, each with rank 1's message
    assert all(": rank 1 raised " in x and "picky: cannot score this rank's completions" in x
               for x in errors), errors
    assert dt < 60, f"the job took {dt:.1f} s to stop"
    print(f"failing torchrun stopped after {dt:.1f} s")
