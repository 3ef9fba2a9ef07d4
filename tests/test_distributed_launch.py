"""torchrun launches (CPU, gloo): this file is also the worker script.

  * 4 processes: `launch_env(os.environ)` + `init_distributed` under torchrun's agent
    store, one sharded optimizer step of the tiny model, gathered weights bitwise equal on
    all ranks, rank-0-only output;
  * 2 processes, rank 1 raises between its forward and backward while rank 0 is inside
    the backward's collectives: the job ends within FAIL_TIMEOUT_S, non-zero, and torchrun
    reports rank 1's error message (the entry point is wrapped in torch's `record`, as the
    CLI's will be).
Run: python -m pytest -q tests/test_distributed_launch.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from spawn_ranks import free_port

ROOT = Path(__file__).resolve().parents[1]
FAIL_TIMEOUT_S = 60  # the whole failing job, start-up included; the group timeout below is 30 s
MESSAGE = "bad batch on rank 1: token id out of range"


def _torchrun(nproc: int, mode: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--monitor_interval=0.2", __file__, mode]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return out, time.perf_counter() - t0


def test_four_process_launch_trains_a_step():
    out, dt = _torchrun(4, "ok", timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    assert lines == ["RESULT world=4 identical=True"], out.stdout[-3000:]  # printed by rank 0 only
    print(f"4-process torchrun: {dt:.1f} s")


def test_raising_rank_stops_the_job_with_its_message():
    out, dt = _torchrun(2, "fail", timeout=FAIL_TIMEOUT_S + 30)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    assert dt < FAIL_TIMEOUT_S, f"the job took {dt:.1f} s to stop"
    assert MESSAGE in text and "rank      : 1" in text, text[-3000:]  # torchrun's root-cause summary
    print(f"failing 2-process torchrun stopped after {dt:.1f} s")


def test_a_rank_raising_outside_the_shared_phases_prints_one_line_naming_it():
    """as_rank (the CLI's torchrun entry): an error the command does not catch (not a
    ValueError) prints one `rlfuse: error: rank R raised ...` line, then propagates (torch's
    `record` and torchrun report it with its traceback; the process exits non-zero)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    code = ("from rlfuse.cli.common import as_rank\n"
            "def body():\n    raise RuntimeError('shape mismatch in layer 3')\n"
            "as_rank(body)()")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    lines = [x for x in out.stderr.splitlines() if x.startswith("rlfuse: error: ")]
    assert lines == ["rlfuse: error: rank 1 raised RuntimeError: shape mismatch in layer 3"], out.stderr[-2000:]


RECIPE = """seed: 0
model: {random_init: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2,
        num_key_value_heads: 1, head_dim: 16, max_position_embeddings: 64},
        tokenizer: char, dtype: float32, device: cpu, kernel_backend: torch}
data: {train: "builtin:arithmetic", task: {digits: 1, ops: "+-"}, train_size: 40, eval_size: 4, max_prompt_len: 16}
rewards: [{name: arithmetic}, {name: length_penalty, kwargs: {max_len: 3}}]
grpo: {steps: 2, prompts_per_step: 4, group_size: 2, max_new_tokens: 3}
logging: {tensorboard: false, progress: false}
"""


def _grpo_cmd(recipe: Path, run_dir: Path, *launch: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch, "--monitor_interval=0.2", "-m", "rlfuse", "grpo",
            str(recipe), "--run-dir", str(run_dir), "--dist-timeout", "60"]


def _numbers(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").open()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s", "memory/"))} for r in rows]


@pytest.mark.slow  # two torchrun jobs of 2 processes: ~35 s on 2 cores
def test_two_nodes_equal_one_node(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    one = subprocess.run(_grpo_cmd(recipe, tmp_path / "one", "--standalone", "--nproc_per_node=2"), env=env,
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-3000:]
    t1 = time.perf_counter()
    # what each node runs (docs/distributed.md, "Several nodes"); the agents agree on node ranks
    launch = ("--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
              "--rdzv-id=two_nodes")
    nodes = [subprocess.Popen(_grpo_cmd(recipe, tmp_path / "two", *launch), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in nodes]
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    assert sum(out.count("grpo done") for out, _ in outs) == 1  # global rank 0 only
    print(f"1 node x 2: {t1 - t0:.1f} s; 2 nodes x 1: {time.perf_counter() - t1:.1f} s")
    assert _numbers(tmp_path / "two") == _numbers(tmp_path / "one")
    assert len([r for r in _numbers(tmp_path / "two") if r["stage"] == "grpo"]) == 2
    a = (tmp_path / "two" / "final" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "one" / "final" / "model.safetensors").read_bytes()


# ---------------------------------------------------------------------- the worker
def _worker(mode: str) -> None:
    from test_distributed import _accumulate, _batch, _micro_batches, _model, _same_on_all_ranks, _totals

    from rlfuse.kernels import use_backend
    from rlfuse.model import Packed
    from rlfuse.run.distributed import context as D
    from rlfuse.run.distributed import fsdp as FS

    ctx = D.init_distributed(D.launch_env(os.environ), device_type="cpu", timeout_s=30)
    try:
        with use_backend("torch"):
            model = FS.shard_model(_model(torch.bfloat16), ctx)
            opt = FS.sharded_adamw(model, lr=1e-2)
            seqs = D.local_slice(_batch(0), ctx, what="global batch")
            mbs = _micro_batches(seqs, 1)
            totals = tuple(D.global_sums(ctx, _totals(seqs)))
            n_micro = D.max_across_ranks(ctx, len(mbs))
            if mode == "fail" and ctx.rank == 1:
                ids = seqs[0][0]
                model(torch.tensor(ids), torch.arange(len(ids)), Packed.from_lengths([len(ids)]))
                raise ValueError(MESSAGE)  # rank 0 goes on into the backward's collectives
            _accumulate(model, seqs, "sft", totals, mbs, n_micro)
            FS.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with FS.gathered_weights(model):
                same = _same_on_all_ranks({n: p.detach().clone() for n, p in model.named_parameters()})
            if ctx.is_main:
                print(f"RESULT world={ctx.world_size} identical={same}", flush=True)
    finally:
        if mode == "ok":
            D.shutdown()


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    torch.set_num_threads(1)
    record(_worker)(sys.argv[1])
