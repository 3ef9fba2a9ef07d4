"""Full fine-tuning of a Qwen3-MoE under FSDP2 (gloo, 2 CPU processes) against one process:
issue 36's "MoE trained with full fine-tuning under FSDP2, exact mismatch 0 on every rank",
at a tiny shape.

The model: 2 MoE layers of 5 experts, top-2. Five experts on 2 ranks shard unevenly (FSDP2
cuts dim 0 of the stacked (E, 2I, D) / (E, D, I) expert tensors and of the (E, D) router
into 3 + 2 rows), so the grouped-GEMM kernels see whole tensors only if the layer's
all-gather restores every expert.

One spawned 2-rank job (`_job`) runs:
  * the sharding itself: every expert tensor and the router is a dim-0 DTensor shard of
    this rank's rows (3 or 2 experts), and the sharded model's logits equal the whole
    model's bitwise (fp32: the gathered weights are the weights); the keyed build
    (`model.init: keyed`, each rank draws its own experts) equals the one-process
    `init_keyed` model bitwise;
  * `run_grpo`, engine.numerics exact, the log-prob mismatch and moe/routing_mismatch
    checked every step, 3 steps, a DCP checkpoint at step 2, the final HF export;
  * the same run stopped after step 2 and resumed from its DCP checkpoint;
  * `run_sft`, 3 steps.
This process runs GRPO and SFT in one process, and GRPO resumed in one process from the
2-rank step-2 checkpoint (resharding 2 -> 1), and checks: every logged metric within TOL
of the one-process run (but the router losses, below), the final weights within
WEIGHT_TOL (tests/test_distributed_run.py explains both bounds), the mismatch and the
routing mismatch 0 at every step (the logged values are the max over ranks), the resumed
run bitwise the uninterrupted one, the 2 -> 1 resume within TOL of the 2-rank run, and the
DCP checkpoint holds all E experts of every layer.

Not compared: moe/aux_loss and moe/z_loss are share-weighted means over micro-batches
(rlfuse.model.layers.moe.RouterLoss): the load-balancing loss is a product of batch means
and the z-loss is averaged over each forward's rows but weighted by trained tokens, so a
different split of the batch (each rank packs its own micro-batches) gives other values
by design (measured: 5e-3 apart). Their coefficients are 0 here (the default), so they
do not enter the gradient; with a nonzero router_aux_loss_coef the 2-rank gradient is
the split's, not the one-process one.
Run: python -m pytest -q -m slow tests/test_distributed_moe_train.py -s   (-s prints the differences)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from spawn_ranks import free_port, gloo_rank, run_ranks, spawn_ranks, torch_threads
from test_distributed_kinds import _weights_diff
from test_distributed_run import NOT_COMPARED, TOL, WEIGHT_TOL, _max_diff, _resume_from
from train_setup import TINY_MODEL, tiny_cfg

from rlfuse.kernels import use_backend
from rlfuse.model import CausalLM, ModelConfig, Packed, load_model
from rlfuse.run.distributed import context as D
from rlfuse.run.distributed.build import build_sharded_random, init_keyed
from rlfuse.run.distributed.fsdp import full_copy, shard_model
from rlfuse.run.metrics import read_metrics
from rlfuse.run.resume import load_model_folder
from rlfuse.train.grpo import run_grpo
from rlfuse.train.sft import run_sft

WORLD = 2
E = 5  # uneven over 2 ranks: 3 + 2 experts
MOE_MODEL = {**TINY_MODEL, "model_type": "qwen3_moe", "num_hidden_layers": 2,
             "moe": {"num_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True}}
EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight")
# engine.fuse_projections off as in tests/test_distributed_run.py (a sharded rank fuses only the engine's weights)
GRPO = ("engine.numerics=exact", "grpo.check_every=1", "grpo.steps=3", "checkpoint.every=2",
        "checkpoint.save_final=true", "engine.fuse_projections=false")
ROUTER_LOSSES = ("moe/aux_loss", "moe/z_loss")  # split-dependent by design (module doc)


def _grpo(run_dir: Path, *over):
    return tiny_cfg(run_dir, *GRPO, *over, model={"random_init": MOE_MODEL})


def _sft(run_dir: Path):
    return tiny_cfg(run_dir, "sft.steps=3", "sft.micro_batch_tokens=24", "checkpoint.save_final=true",
                    model={"random_init": MOE_MODEL})


def _plain(seed: int = 0) -> CausalLM:
    m = CausalLM(ModelConfig(**{**MOE_MODEL, "vocab_size": 40}))
    m.init_weights(std=0.3, generator=torch.Generator().manual_seed(seed))
    return m


def _logits(model: CausalLM) -> torch.Tensor:
    ids = torch.randint(0, 40, (13,), generator=torch.Generator().manual_seed(3))
    with use_backend("torch"), torch.no_grad():
        return model(ids, torch.arange(13), Packed.from_lengths([6, 7]))


def _check_sharding(ctx, out: Path) -> dict:
    """This rank's expert shards, and the sharded forward against the whole model's; the
    keyed build's full weights go to keyed_rank{r}.pt."""
    whole = _plain()
    want = _logits(whole)
    sharded = shard_model(_plain(), ctx)
    rows = {}
    for name, p in sharded.named_parameters():
        if name.endswith(EXPERT_PARAMS):
            assert p.placements[0].is_shard(0), (name, p.placements)
            rows[name] = p.to_local().shape[0]
            assert p.to_local().shape[1:] == p.shape[1:]
    got = _logits(sharded)
    keyed = full_copy(build_sharded_random(ModelConfig(**{**MOE_MODEL, "vocab_size": 40}), ctx,
                                           dtype=torch.float32, seed=5), torch.float32)
    torch.save(keyed.state_dict(), out / f"keyed_rank{ctx.rank}.pt")
    return {"rows": rows, "logits_equal": torch.equal(got, want)}


def _job(rank: int, port: int, out: str) -> None:
    ctx = gloo_rank(rank, WORLD, port)
    out = Path(out)
    (out / f"shard_rank{rank}.json").write_text(json.dumps(_check_sharding(ctx, out)))
    run_grpo(_grpo(out / "grpo2"), dist=ctx)
    run_grpo(_grpo(out / "stop2"), dist=ctx, stop_after=2)
    run_grpo(_grpo(out / "stop2", "checkpoint.resume=auto"), dist=ctx)
    run_sft(_sft(out / "sft2"), dist=ctx)
    D.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_fsdp")
    with torch_threads(1):
        run_grpo(_grpo(out / "grpo1"))
        run_sft(_sft(out / "sft1"))
        run_ranks(_job, WORLD, out, "MoE")
        _resume_from(out / "grpo2", out / "reshard1")  # 2 -> 1: the sharded experts into one process
        run_grpo(_grpo(out / "reshard1", "checkpoint.resume=auto"))
    return out


def _rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith((*NOT_COMPARED, *ROUTER_LOSSES))}
            for r in read_metrics(run_dir)]


@pytest.mark.slow  # the module's 2-rank job and one-process runs: ~20 s on the shared 2-core machine
def test_experts_are_sharded_and_gathered_whole(runs):
    got = [json.loads((runs / f"shard_rank{r}.json").read_text()) for r in range(WORLD)]
    for name in got[0]["rows"]:
        assert [g["rows"][name] for g in got] == [3, 2], name  # FSDP2's dim-0 chunks of 5 experts
    assert len(got[0]["rows"]) == 2 * len(EXPERT_PARAMS)  # both layers' experts and routers
    assert all(g["logits_equal"] for g in got)
    one = CausalLM(ModelConfig(**{**MOE_MODEL, "vocab_size": 40}))
    init_keyed(one, seed=5)
    for r in range(WORLD):  # each rank drew its own experts; together they are the one-process init
        keyed = torch.load(runs / f"keyed_rank{r}.pt")
        assert keyed.keys() == one.state_dict().keys()
        assert all(torch.equal(v, keyed[k]) for k, v in one.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_two_ranks_match_one_process(runs, kind):
    two, one = _rows(runs / f"{kind}2"), _rows(runs / f"{kind}1")
    steps = [r for r in two if r["stage"] == kind]
    assert len(steps) == 3
    d, where = _max_diff(two, one)
    dw = _weights_diff(runs / f"{kind}2", runs / f"{kind}1")
    print(f"MoE {kind}: 2 ranks vs 1 process, max |metric diff| {d:.2e} ({where}); final weights {dw:.2e}")
    assert d <= TOL, where
    assert dw <= WEIGHT_TOL
    assert all(r["moe/load_max"] > 1.0 for r in steps)  # routed, and the loads are logged
    if kind == "grpo":
        for r in steps:  # max over ranks: 0 on every rank
            assert r["mismatch/max_abs"] == 0.0 and r["mismatch/full_max_abs"] == 0.0
            assert r["moe/routing_mismatch"] == 0.0


@pytest.mark.slow
def test_moe_checkpoint_resumes_bitwise_and_holds_the_experts(runs):
    assert _rows(runs / "stop2") == _rows(runs / "grpo2")
    for a, b in zip(load_model(runs / "stop2" / "final").parameters(), load_model(runs / "grpo2" / "final").parameters()):
        assert torch.equal(a, b)
    step2 = runs / "grpo2" / "checkpoints" / "step_000002"
    assert (step2 / "dcp" / ".metadata").exists()
    ckpt = dict(load_model_folder(step2, dtype=torch.float32).named_parameters())
    resumed = dict(load_model_folder(runs / "stop2" / "checkpoints" / "step_000002", dtype=torch.float32)
                   .named_parameters())
    experts = [n for n in ckpt if n.endswith(EXPERT_PARAMS)]
    assert len(experts) == 2 * len(EXPERT_PARAMS) and ckpt[experts[0]].shape[0] == E
    for n in experts:
        assert torch.equal(ckpt[n], resumed[n])
    final = dict(load_model(runs / "grpo2" / "final", dtype=torch.float32).named_parameters())
    assert any(not torch.equal(ckpt[n], final[n]) for n in experts)  # step 3 trained the experts
    d, where = _max_diff(_rows(runs / "reshard1"), _rows(runs / "grpo2"))  # 2 -> 1 continues the 2-rank run
    print(f"MoE resume 2 -> 1: max |metric diff| {d:.2e} ({where})")
    assert d <= TOL, where


# ---------------------------------------------------------------------- 2 GPUs (NCCL)
# bf16, the Triton kernels, exact numerics: what the CPU test cannot run. Bigger than the CPU
# model so every GEMM has at least one full tile; still 5 experts (3 + 2 on two ranks).
GPU_MODEL = {**MOE_MODEL, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "moe": {**MOE_MODEL["moe"], "moe_intermediate_size": 32}}


def _gpu_grpo(run_dir: Path):
    return tiny_cfg(run_dir, *GRPO, "model.device=cuda", "model.dtype=bfloat16", "model.kernel_backend=auto",
                    model={"random_init": GPU_MODEL})


def _gpu_job(rank: int, port: int, out: str) -> None:
    env = {"WORLD_SIZE": str(WORLD), "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    ctx = D.init_distributed(D.launch_env(env), device_type="cuda", timeout_s=300)
    D.quiet_non_main(ctx)
    run_grpo(_gpu_grpo(Path(out) / "gpu2"), dist=ctx)
    D.shutdown()


@pytest.mark.gpu
def test_moe_fsdp_on_two_gpus_bf16_exact(tmp_path):
    """1 GPU vs 2 GPUs (FSDP2, NCCL), bf16 GRPO in exact numerics: the log-prob mismatch and
    moe/routing_mismatch 0 at every step on every rank (logged: the max over ranks); step 1
    samples the same completions (exact numerics: a sequence's tokens do not depend on its
    batch) from the same weights, so its rewards are equal."""
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA GPUs")
    run_grpo(_gpu_grpo(tmp_path / "gpu1"))
    spawn_ranks(_gpu_job, WORLD, free_port(), str(tmp_path))
    one, two = ([r for r in read_metrics(tmp_path / f"gpu{n}") if r["stage"] == "grpo"] for n in (1, 2))
    assert len(one) == len(two) == 3
    for r in one + two:
        assert r["mismatch/max_abs"] == 0.0 and r["mismatch/full_max_abs"] == 0.0, r
        assert r["moe/routing_mismatch"] == 0.0, r
    for k in ("reward/mean", "completion_len/mean"):
        assert two[0][k] == one[0][k], k
    print(f"MoE 2 GPUs vs 1, step 1: loss {two[0]['loss']} vs {one[0]['loss']}, grad norm {two[0]['grad_norm']} vs "
          f"{one[0]['grad_norm']}")
