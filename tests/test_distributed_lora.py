"""LoRA data-parallel on CPU (gloo, 2 processes) against one process: the base and the
adapters replicated on every rank, the adapters' fp32 gradients summed across ranks before
each optimizer step (rlfuse.run.distributed.replicated).

One spawned 2-rank job (`_job`) runs, with a DistContext:
  * GRPO with LoRA, 4 steps (the KL reference is the base: adapters off; checkpoints at
    steps 2 and 4, written by rank 0 in the one-process layout; final adapter folder);
  * the same GRPO run stopped after step 2 and resumed (`checkpoint.resume=auto`);
  * SFT with LoRA, 4 steps (8 examples split 4 / 4, unequal micro-batch counts per rank);
  * DPO with LoRA, 2 steps (the reference precomputed from the base);
  * PPO with LoRA, 2 steps (the policy's adapters replicated, the critic sharded, KL to the base);
  * GRPO with LoRA in stream mode (`grpo.overlap: stream`), 4 steps: each rank streams its
    groups, the token-mean and dynamic-sampling normalizers are summed over ranks.
After each run every rank writes its adapters, so the test sees each rank's replica.
This process then runs the same recipes in one process and checks: every logged metric
within TOL of the one-process run's and the final adapters within WEIGHT_TOL
(tests/test_distributed_run.py explains both bounds); the two ranks' adapters bitwise
equal after every run; the resumed run bitwise the uninterrupted one; the 2-rank step-2
checkpoint resumed in one process continues within TOL.
Run: python -m pytest -q tests/test_distributed_lora.py -s   (-s prints the differences)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from spawn_ranks import gloo_rank, run_ranks, torch_threads
from test_distributed_run import NOT_COMPARED, TOL, WEIGHT_TOL, _max_diff
from train_setup import tiny_cfg

from rlfuse.model.lora import lora_parameters
from rlfuse.rollout import LengthsSampler
from rlfuse.run.distributed import context as D
from rlfuse.run.metrics import read_metrics
from rlfuse.train.dpo import run_dpo
from rlfuse.train.grpo import run_grpo
from rlfuse.train.ppo import run_ppo
from rlfuse.train.session import open_session
from rlfuse.train.sft import run_sft

WORLD = 2
LORA = ("model.lora={rank: 4, alpha: 8}", "checkpoint.save_final=true", "engine.fuse_projections=false")
RUNS = {  # name -> (trainer, overrides, sections)
    "grpo": (run_grpo, ("grpo.kl_coef=0.05", "checkpoint.every=2"), {}),
    "sft": (run_sft, ("sft.micro_batch_tokens=24",), {}),
    "dpo": (run_dpo, ("dpo.steps=2", "dpo.batch_size=6", "dpo.micro_batch_tokens=40"),
            {"data": {"train": "builtin:arithmetic_pref", "train_size": 40, "eval_size": 4},
             "rewards": [{"name": "arithmetic"}]}),
    # the LoRA policy replicated, the critic (a full trunk) FSDP2-sharded
    "ppo": (run_ppo, ("ppo.steps=2", "ppo.prompts_per_step=4", "ppo.samples_per_prompt=2", "ppo.max_new_tokens=3",
                      "ppo.kl_coef=0.1", "ppo.critic_lr=1e-2"), {}),
    # grpo.overlap stream: each rank streams its groups (token-mean loss and dynamic sampling:
    # the rescale needs the global token and kept counts; exact numerics checked every step)
    "stream": (lambda cfg, dist=None, **kw: run_grpo(cfg, session=_stream_session(cfg, dist), **kw),
               ("grpo.overlap=stream", "grpo.loss_type=dapo", "grpo.dynamic_sampling=true",
                          "grpo.max_new_tokens=6", "engine.numerics=exact", "grpo.check_every=1",
                          "model.kernel_backend=auto"), {}),
}
STEPS = {"grpo": 4, "sft": 4, "dpo": 2, "ppo": 2, "stream": 4}
STAGE = {"stream": "grpo"}


def _stream_length(i: int, k: int) -> int:
    """Completion k of the i-th prompt of a generate call: every even prompt's first completion
    is long, so its group finishes after the next one (out of order) on 1 process and on each
    of 2 ranks alike (rank r's prompt i is the global prompt 2 r + i). Lengths 2 and 4 around
    the length penalty's 3: every group has reward variance (dynamic sampling keeps it)."""
    return 6 if i % 2 == 0 and k == 0 else 2 + 2 * (k % 2)


def _stream_session(cfg, dist):
    ses = open_session(cfg, dist=dist)
    ses._sampler = LengthsSampler(ses.sampler.llm, ses.tokenizer, _stream_length)
    return ses


def _cfg(run_dir: Path, kind: str, *over: str):
    _, extra, sections = RUNS[kind]
    return tiny_cfg(run_dir, *LORA, *extra, *over, **sections)


def _run(out: Path, name: str, kind: str, *over: str, ctx=None, **kw) -> None:
    res = RUNS[kind][0](_cfg(out / name, kind, *over), dist=ctx, **kw)
    rank = 0 if ctx is None else ctx.rank
    torch.save({n: p.detach().clone() for n, p in lora_parameters(res["model"])}, out / f"{name}_lora{rank}.pt")


def _job(rank: int, port: int, out: str) -> None:
    ctx = gloo_rank(rank, WORLD, port)
    out = Path(out)
    for kind in RUNS:
        _run(out, f"{kind}2", kind, ctx=ctx)
    _run(out, "stop2", "grpo", ctx=ctx, stop_after=2)
    _run(out, "stop2", "grpo", "checkpoint.resume=auto", ctx=ctx)
    D.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_lora")
    with torch_threads(1):
        for kind in RUNS:
            _run(out, f"{kind}1", kind)
        run_ranks(_job, WORLD, out, "LoRA")
        # 2 -> 1: the 2-rank step-2 checkpoint (rank 0's one-process layout) resumed in one process
        shutil.copytree(out / "grpo2" / "checkpoints" / "step_000002", out / "resume1" / "checkpoints" / "step_000002")
        shutil.copy(out / "grpo2" / "metrics.jsonl", out / "resume1" / "metrics.jsonl")
        _run(out, "resume1", "grpo", "checkpoint.resume=auto")
    return out


def _rows(run_dir: Path) -> list[dict]:
    # critic/update_ratio: the sharded critic's optimizer does not measure it; stream/*: times and the
    # gradient slots each rank's own finishing order needed (per rank by nature, max over ranks)
    skip = (*NOT_COMPARED, "critic/update_ratio", "stream/")
    return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in read_metrics(run_dir)]


def _lora(runs: Path, name: str, rank: int = 0) -> dict:
    return torch.load(runs / f"{name}_lora{rank}.pt")


@pytest.mark.slow  # one 2-rank job (5 runs) and five one-process runs: ~25 s on 2 cores
@pytest.mark.parametrize("kind", list(RUNS))
def test_lora_two_ranks_match_one_process(runs, kind):
    two, one = _rows(runs / f"{kind}2"), _rows(runs / f"{kind}1")
    assert len([r for r in two if r["stage"] == STAGE.get(kind, kind)]) == STEPS[kind]
    d, where = _max_diff(two, one)
    a1, a2 = _lora(runs, f"{kind}1"), _lora(runs, f"{kind}2")
    dw = max(float((a2[n] - a1[n]).abs().max()) for n in a1)
    print(f"LoRA {kind}: 2 ranks vs 1 process, max |metric diff| {d:.2e} ({where}); adapters max |diff| {dw:.2e}")
    assert d <= TOL, where
    assert dw <= WEIGHT_TOL
    assert any(float(t.abs().max()) > 0 for n, t in a2.items() if n.endswith("lora_B"))  # the adapters trained
    other = _lora(runs, f"{kind}2", rank=1)
    assert all(torch.equal(a2[n], other[n]) for n in a2)  # the replicas stayed bitwise equal
    if kind == "stream":
        steps = [r for r in read_metrics(runs / "stream2") if r["stage"] == "grpo"]
        assert max(r["stream/grad_slots_max"] for r in steps) > 0  # groups finished out of order
        assert all(r["mismatch/max_abs"] == 0.0 and r["mismatch/full_max_abs"] == 0.0 for r in steps)
    if kind == "grpo":
        assert any(abs(r["kl"]) > 0 for r in two if r["stage"] == "grpo")  # the base reference was used
        last = runs / "grpo2" / "checkpoints" / "step_000004"
        assert (last / "adapter" / "adapter_model.safetensors").is_file() and not (last / "dcp").exists()
        state = torch.load(last / "state.pt", weights_only=False)
        assert state["world_size"] == WORLD and len(state["rng_per_rank"]) == WORLD
        assert (runs / "grpo2" / "final" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_lora_resume_same_n_is_exact_and_two_to_one_within_tol(runs):
    assert _rows(runs / "stop2") == _rows(runs / "grpo2")
    a, b = _lora(runs, "stop2"), _lora(runs, "grpo2")
    assert all(torch.equal(a[n], b[n]) for n in a)
    d, where = _max_diff(_rows(runs / "resume1"), _rows(runs / "grpo2"))
    print(f"LoRA resume 2 -> 1: max |metric diff| {d:.2e} ({where})")
    assert d <= TOL, where
