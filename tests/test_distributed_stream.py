"""`grpo.overlap: stream` on an FSDP2-sharded model (full fine-tune) on CPU (gloo, 2 processes).

Each rank streams its block of the prompts and trains its groups as they finish with
gradient sync off (FSDP2 accumulates its unsharded gradients locally); one zero-weight
pass with sync on reduce-scatters them after the rollout (rlfuse/train/grpo_stream.py).
The groups add in their finishing order, so the contract is "sync mode to fp32 rounding":

  * stream on 2 ranks vs sync on 2 ranks and vs stream in one process, dapo and grpo loss
    types, dynamic sampling on (a group of every 4 has no reward variance and is dropped),
    exact numerics checked every step: every logged metric within TOL, final weights within
    WEIGHT_TOL (tests/test_distributed_run.py's bounds), the rollout (rewards, lengths,
    kept groups) equal, the trainer-vs-rollout mismatch 0 on every rank;
  * other distributed.* FSDP2 settings give the default's result bitwise; fused projections
    (the engine's gathered weights fused, CUDA's default) stay within the bounds;
  * Qwen3-MoE (experts sharded) stream vs sync on 2 ranks, and image rows with the vision
    tower trained (its own FSDP2 group) on 2 ranks vs one process: the same bounds,
    mismatch and routing mismatch 0;
  * the threaded runner (`StreamStep.threaded = True`: FSDP2's hooks on the worker thread
    beside the engine's) gives the interleaved runner's weights bitwise;
  * a rank that raises mid-rollout stops both ranks with its message (no hang in the
    reduce-scatter the other rank reaches);
  * `reduce_local_gradients` adds exactly nothing: its reduce-scatter equals FSDP2's own
    accumulate-then-sync, bitwise.
Run: python -m pytest -q -m slow tests/test_distributed_stream.py -s   (-s prints the differences)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spawn_ranks import free_port, gloo_rank, run_ranks, spawn_ranks, torch_threads
from test_distributed_moe_train import MOE_MODEL, ROUTER_LOSSES
from test_distributed_run import NOT_COMPARED, TOL, WEIGHT_TOL, _max_diff
from test_vision_train import _cfg as _vision_cfg
from test_vision_train import _parity
from train_setup import tiny_cfg

from rlfuse.data.prompts import PromptStream, build_prompts
from rlfuse.model import Packed
from rlfuse.rollout import LengthsSampler
from rlfuse.run.config import replace
from rlfuse.run.distributed import (
    GatheredSampler,
    RankFailed,
    full_copy,
    is_sharded,
    local_gradients,
    reduce_local_gradients,
)
from rlfuse.run.distributed import context as D
from rlfuse.run.metrics import read_metrics
from rlfuse.train.grpo import GRPOStep, run_grpo
from rlfuse.train.loop import make_optimizer
from rlfuse.train.session import open_session

WORLD = 2
STEPS = 3
# fused projections off: see tests/test_distributed_run.py (sharded training forwards are unfused)
BASE = ("grpo.prompts_per_step=8", "grpo.dynamic_sampling=true", "grpo.max_new_tokens=6", f"grpo.steps={STEPS}",
        "engine.numerics=exact", "grpo.check_every=1", "model.kernel_backend=auto", "engine.fuse_projections=false")
LOSSES = {"dapo": (), "grpo": ("grpo.kl_coef=0.05",)}  # grpo: with a KL reference (sharded: a full copy)
# the distributed.* FSDP2 settings change when gathers and frees happen, not the values: bitwise
SETTINGS = ("distributed.grad_sync=last", "distributed.reshard_after_forward=false",
            "distributed.reshard_after_backward=false", "distributed.prefetch=1")
ROLLOUT = ("reward/mean", "reward/std", "completion_len/mean", "completion_len/max", "groups/kept",
           "groups/zero_variance_frac", "truncated_frac")


def _length(i: int, k: int) -> int:
    """Completion k of the i-th prompt of a generate call (rank r's prompt i is the global
    prompt 4 r + i: the same lengths on 1 process and on each of 2 ranks): prompt 0 of
    every 4 has one long completion, so its group finishes after the next ones; prompt 2's
    are all 2 (equal rewards: dynamic sampling drops the group); the others 2 and 4, around
    the length penalty's 3."""
    if i % 4 == 2:
        return 2
    return 6 if i % 4 == 0 and k == 0 else 2 + 2 * (k % 2)


def _session(cfg, dist):
    ses = open_session(cfg, dist=dist)
    make = lambda: LengthsSampler(ses._engine_sampler().llm, ses.tokenizer, _length)  # noqa: E731
    # sharded: the engine is built at the first wake, inside the gathered block
    fuse = bool(cfg.engine.fuse_projections)  # as Session.base_sampler (BASE: off; the GPU test's fused run: on)
    ses._sampler = GatheredSampler(ses.model, make, fuse=fuse) if is_sharded(ses.model) else make()
    return ses


def _cfg(out: Path, name: str, overlap: str, loss: str, *over: str):
    sections = {"model": {"random_init": GPU_MODEL}} if "model.device=cuda" in over else {}
    return tiny_cfg(out / name, *BASE, f"grpo.overlap={overlap}", f"grpo.loss_type={loss}", *LOSSES[loss], *over,
                    **sections)


def _weights(model, name: str, out: Path, rank: int) -> None:
    full = full_copy(model, torch.float32) if is_sharded(model) else model  # collective when sharded
    if rank == 0:
        torch.save({n: p.detach().clone() for n, p in full.state_dict().items()}, out / f"{name}.pt")


def _run(out: Path, name: str, overlap: str, loss: str, *over: str, ctx=None) -> None:
    cfg = _cfg(out, name, overlap, loss, *over)
    res = run_grpo(cfg, session=_session(cfg, ctx), dist=ctx)
    _weights(res["model"], name, out, 0 if ctx is None else ctx.rank)


def _moe(out: Path, name: str, overlap: str, ctx=None) -> None:
    cfg = tiny_cfg(out / name, *BASE, f"grpo.overlap={overlap}", "grpo.loss_type=dapo", model={"random_init": MOE_MODEL})
    _weights(run_grpo(cfg, session=_session(cfg, ctx), dist=ctx)["model"], name, out, 0 if ctx is None else ctx.rank)


def _vision(out: Path, name: str, ctx=None) -> None:
    """tests/test_vision_train.py's tiny VLM on image rows, the tower trained (the engine's own lengths)."""
    cfg = replace(_vision_cfg(out / name), **{"data.eval_size": 4, "grpo.eval_every": 0, "model.train_vision": True,
                                              "grpo.overlap": "stream", "grpo.dynamic_sampling": True})
    ses = open_session(cfg, dist=ctx, reward_functions={"parity": _parity})
    _weights(run_grpo(cfg, session=ses)["model"], name, out, 0 if ctx is None else ctx.rank)


class _Raising(LengthsSampler):
    """Raises after its first finished group."""

    def groups(self, *args, **kw):
        it = super().groups(*args, **kw)
        yield next(it)
        raise RuntimeError("this rank's engine failed")


def _raises(out: Path, ctx, lora: bool = False) -> None:
    name = "raises_lora" if lora else "raises"
    cfg = _cfg(out, name, "stream", "dapo", *(("model.lora={rank: 4, alpha: 8}",) if lora else ()))
    ses = open_session(cfg, dist=ctx)
    kind = _Raising if ctx.rank == 1 else LengthsSampler
    make = lambda: kind(ses._engine_sampler().llm, ses.tokenizer, _length)  # noqa: E731
    ses._sampler = make() if lora else GatheredSampler(ses.model, make)  # LoRA: a replica, its own engine
    tr = GRPOStep(cfg, ses.model, ses.sampler, ses.rewards(), PromptStream(build_prompts(ses.train_rows, ses.tokenizer,
                  cfg.data), seed=0), make_optimizer(ses.model, cfg, ses.dist), dist=ses.dist)
    try:
        tr.step(0)
    except RankFailed as e:
        (out / f"{name}{ctx.rank}.txt").write_text(str(e))


def _threaded(out: Path, ctx, threaded: bool, *over: str) -> None:
    """STEPS stream steps (dapo) driven directly, on the worker thread or interleaved."""
    name = f"steps_{'threaded' if threaded else 'interleaved'}"
    cfg = _cfg(out, name, "stream", "dapo", *over)
    ses = _session(cfg, ctx)
    prompts = build_prompts(ses.train_rows, ses.tokenizer, cfg.data)
    tr = GRPOStep(cfg, ses.model, ses.sampler, ses.rewards(), PromptStream(prompts, seed=0),
                  make_optimizer(ses.model, cfg, ses.dist), dist=ses.dist)
    tr.streamer.threaded = threaded
    ms = [tr.step(s) for s in range(STEPS)]
    assert all(float(m["mismatch/max_abs"]) == 0.0 for m in ms)
    _weights(ses.model, name, out, ctx.rank)


def _reduce_adds_nothing(out: Path, ctx) -> None:
    """Three local passes, then (a) `reduce_local_gradients` or (b) the third pass run with
    sync on (FSDP2's own accumulate-then-reduce-scatter): the same gradient shards bitwise."""
    cfg = tiny_cfg(out / "reduce", "engine.fuse_projections=false")
    ses = open_session(cfg, dist=ctx)
    model = ses.model
    ids = [torch.arange(3 + ctx.rank + k, dtype=torch.long) % 20 + 1 for k in range(3)]  # other data per rank

    def pass_(x):
        h = model(x, torch.arange(len(x)), Packed.from_lengths([len(x)], x.device))
        model.token_logprobs(h[:-1], x[1:], 1.0).sum().backward()

    shards = []
    for last_synced in (False, True):
        ses.sampler.wake()  # every group gathered, as while the engine decodes
        with local_gradients(model):
            for k, x in enumerate(ids):
                if last_synced and k == len(ids) - 1:
                    model.set_requires_gradient_sync(True)
                pass_(x)
            if not last_synced:
                reduce_local_gradients(model)
        ses.sampler.sleep()
        shards.append([p.grad.to_local().clone() for p in model.parameters()])
        for p in model.parameters():
            p.grad = None
    torch.save(shards, out / f"reduce_shards{ctx.rank}.pt")


def _reduce_job(rank: int, port: int, out: str) -> None:
    ctx = gloo_rank(rank, WORLD, port)
    _reduce_adds_nothing(Path(out), ctx)
    D.shutdown()


def _job(rank: int, port: int, out: str) -> None:
    ctx = gloo_rank(rank, WORLD, port)
    out = Path(out)
    for loss in LOSSES:
        for overlap in ("stream", "sync"):
            _run(out, f"{overlap}_{loss}2", overlap, loss, ctx=ctx)
    _run(out, "settings_dapo2", "stream", "dapo", *SETTINGS, ctx=ctx)
    _run(out, "fused_dapo2", "stream", "dapo", "engine.fuse_projections=true", ctx=ctx)
    for threaded in (False, True):
        _threaded(out, ctx, threaded)
    for overlap in ("stream", "sync"):
        _moe(out, f"moe_{overlap}2", overlap, ctx)
    _vision(out, "vision_stream2", ctx)
    _raises(out, ctx)  # last: the failed step leaves its engine awake
    _raises(out, ctx, lora=True)
    D.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_stream")
    with torch_threads(1):
        for loss in LOSSES:
            _run(out, f"stream_{loss}1", "stream", loss)
        _vision(out, "vision_stream1")
        run_ranks(_job, WORLD, out, "FSDP stream")
    return out


def _rows(run_dir: Path) -> list[dict]:
    """The training steps' metrics. stream/*: times and slots, per rank by nature. The eval
    rows are left out: LengthsSampler's lengths follow a prompt's place in its rank's part."""
    return [{k: v for k, v in r.items() if not k.startswith((*NOT_COMPARED, "stream/"))} for r in read_metrics(run_dir)
            if r["stage"] == "grpo"]


def _dw(out: Path, a: str, b: str) -> float:
    x, y = torch.load(out / f"{a}.pt"), torch.load(out / f"{b}.pt")
    return max(float((x[n] - y[n]).abs().max()) for n in x)


@pytest.mark.slow  # one 2-rank job (4 runs and 2 driven ones) and 2 one-process runs: ~20 s on 2 cores
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("against", ["sync on 2 ranks", "stream in one process"])
def test_fsdp_stream_matches_sync_and_one_process(runs, loss, against):
    name = f"sync_{loss}2" if against.startswith("sync") else f"stream_{loss}1"
    two, other = _rows(runs / f"stream_{loss}2"), _rows(runs / name)
    assert len(two) == STEPS
    d, where = _max_diff(two, other)
    dw = _dw(runs, f"stream_{loss}2", name)
    print(f"FSDP stream {loss} 2 ranks vs {against}: max |metric diff| {d:.2e} ({where}); weights {dw:.2e}")
    assert d <= TOL, where
    assert dw <= WEIGHT_TOL
    for a, b in zip(two, other):
        assert {k: a[k] for k in ROLLOUT} == {k: b[k] for k in ROLLOUT}  # the same rollout
    assert all(r["mismatch/max_abs"] == 0.0 and r["mismatch/full_max_abs"] == 0.0 for r in two)  # max over ranks
    assert any(r["groups/kept"] < 8 for r in two)  # dynamic sampling dropped a group
    assert all(r["grad_norm"] > 0 and "skipped_update" not in r for r in two)  # every step trained
    if loss == "grpo":
        assert all(abs(r["kl"]) > 0 for r in two[1:])  # the reference was used (0 before the first update)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["moe", "vision"])
def test_fsdp_stream_moe_and_vision(runs, kind):
    two, name = (f"{kind}_stream2", "moe_sync2" if kind == "moe" else "vision_stream1")
    drop = lambda rows: [{k: v for k, v in r.items() if k not in ROUTER_LOSSES} for r in rows]  # noqa: E731
    a, b = drop(_rows(runs / two)), drop(_rows(runs / name))  # router losses: split-dependent by design
    d, where = _max_diff(a, b)
    dw = _dw(runs, two, name)
    print(f"FSDP stream {kind} 2 ranks vs {name}: max |metric diff| {d:.2e} ({where}); weights {dw:.2e}")
    assert d <= TOL, where
    assert dw <= WEIGHT_TOL
    assert all(r["mismatch/max_abs"] == 0.0 and r.get("moe/routing_mismatch", 0.0) == 0.0 for r in a)
    assert all(r["grad_norm"] > 0 for r in a)
    if kind == "vision":
        assert all(r["vision/encodes"] > 0 for r in a)


@pytest.mark.slow
def test_fsdp_stream_under_other_fsdp2_settings_is_bitwise_the_same(runs):
    assert _rows(runs / "settings_dapo2") == _rows(runs / "stream_dapo2")
    assert _dw(runs, "settings_dapo2", "stream_dapo2") == 0.0


@pytest.mark.slow
def test_fsdp_stream_with_fused_projections(runs):
    """The engine's gathered weights fused (CUDA's default): the stream's training passes run
    inside that block, so they take the fused GEMMs; same bounds against the unfused run."""
    fused, plain = _rows(runs / "fused_dapo2"), _rows(runs / "stream_dapo2")
    d, where = _max_diff(fused, plain)
    assert d <= TOL, where
    assert _dw(runs, "fused_dapo2", "stream_dapo2") <= WEIGHT_TOL
    assert all(r["mismatch/max_abs"] == 0.0 and r["mismatch/full_max_abs"] == 0.0 for r in fused)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["raises", "raises_lora"])  # sharded, and the LoRA replicas
def test_stream_a_raising_rank_stops_every_rank(runs, name):
    for rank in range(WORLD):
        msg = (runs / f"{name}{rank}.txt").read_text()
        assert msg == "stream rollout: rank 1 raised RuntimeError: this rank's engine failed", msg


@pytest.mark.slow
def test_fsdp_stream_threaded_equals_interleaved(runs):
    assert _dw(runs, "steps_threaded", "steps_interleaved") == 0.0
    assert _dw(runs, "steps_threaded", "stream_dapo1") <= WEIGHT_TOL


def test_reduce_local_gradients_adds_nothing(tmp_path):
    with torch_threads(1):
        run_ranks(_reduce_job, WORLD, tmp_path, "reduce_local_gradients")
    for rank in range(WORLD):
        reduced, synced = torch.load(tmp_path / f"reduce_shards{rank}.pt")
        assert all(torch.equal(a, b) for a, b in zip(reduced, synced))
        assert all(float(g.abs().max()) > 0 for g in reduced)  # every shard got a gradient


def _bf16_job(rank: int, port: int, out: str) -> None:
    ctx = gloo_rank(rank, WORLD, port)
    for overlap in ("stream", "sync"):
        _run(Path(out), f"{overlap}_bf16", overlap, "grpo", "model.dtype=bfloat16", *SAME_SCALE, ctx=ctx)
    D.shutdown()


@pytest.mark.slow  # ~25 s on 2 cores
def test_fsdp_stream_in_bf16_matches_sync_where_the_scale_is_known(tmp_path):
    """The GPU test's comparison on 2 gloo ranks in bf16: with grpo's known normalizer and one
    sequence per micro-batch, step 1's loss and gradient norm equal sync's to fp32 rounding."""
    with torch_threads(1):
        spawn_ranks(_bf16_job, WORLD, free_port(), str(tmp_path))
    stream, sync = _rows(tmp_path / "stream_bf16"), _rows(tmp_path / "sync_bf16")
    assert {k: stream[0][k] for k in ROLLOUT} == {k: sync[0][k] for k in ROLLOUT}
    assert sync[0]["grad_norm"] > 0
    for k in ("loss", "grad_norm"):
        assert abs(stream[0][k] - sync[0][k]) <= 1e-5 * max(1.0, abs(sync[0][k])), (k, stream[0][k], sync[0][k])


# ---------------------------------------------------------------------- 2 GPUs (NCCL)
# big enough for every GEMM to hold a full Triton tile (tests/test_grpo_gpu.py's shape)
GPU_MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=128)
# stream equals sync to fp32 rounding in bf16 only where the backward runs at sync's scale:
# grpo's sequence-count normalizer is known before the rollout, and one sequence per
# micro-batch cuts sync's micro-batches at group boundaries as stream's are. dapo's token-level
# mean (and dynamic sampling's kept count) is known only at the end: stream backpropagates
# unnormalized sums and rescales, so its bf16 weight gradients round apart from sync's at
# bf16, not fp32 (seen: 7e-4 of step 1's gradient norm on 2 H200s, 5.7e-4 on 2 gloo ranks)
SAME_SCALE = ("grpo.kl_coef=0", "grpo.dynamic_sampling=false", "grpo.micro_batch_tokens=1")
GPU = ("model.device=cuda", "model.dtype=bfloat16", "engine.gpu_memory_fraction=0.3", "engine.max_num_seqs=64")


def _gpu_job(rank: int, port: int, out: str) -> None:
    env = {"WORLD_SIZE": str(WORLD), "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    ctx = D.init_distributed(D.launch_env(env), device_type="cuda", timeout_s=300)
    D.quiet_non_main(ctx)
    out = Path(out)
    for overlap in ("stream", "sync"):
        _run(out, f"{overlap}_grpo2", overlap, "grpo", *GPU, *SAME_SCALE, ctx=ctx)
    # CUDA's default: the engine's gathered weights fused, so the stream's training passes take the fused GEMMs
    _run(out, "fused_grpo2", "stream", "grpo", *GPU, *SAME_SCALE, "engine.fuse_projections=true", ctx=ctx)
    for threaded in (False, True):  # the default on CUDA (interleaved) and the forced worker thread
        _threaded(out, ctx, threaded, *GPU)
    D.shutdown()


@pytest.mark.gpu
def test_fsdp_stream_on_two_gpus_bf16_exact(tmp_path):
    """2 GPUs (FSDP2, NCCL), bf16 exact numerics: stream vs sync and the worker thread (its side
    stream, engine steps serialized against its jobs) vs the interleaved runner. Mismatch 0 on
    every step and rank; step 1 samples from the same weights, so its rollout is sync's and
    (grpo's known normalizer, one sequence per micro-batch) its loss and gradient norm agree
    to fp32 rounding (later steps' bf16 weights may round apart and sample otherwise); the
    threaded run (dapo) is the interleaved one bitwise. With fused projections (CUDA's
    default) mismatch 0 and step 1's rollout too; its loss and gradient norm are printed
    (dx of the fused GEMMs rounds apart from the separate ones)."""
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA GPUs")
    spawn_ranks(_gpu_job, WORLD, free_port(), str(tmp_path))
    stream, sync = _rows(tmp_path / "stream_grpo2"), _rows(tmp_path / "sync_grpo2")
    assert len(stream) == len(sync) == STEPS
    assert all(r["mismatch/max_abs"] == 0.0 and r["mismatch/full_max_abs"] == 0.0 for r in stream + sync)
    assert {k: stream[0][k] for k in ROLLOUT} == {k: sync[0][k] for k in ROLLOUT}
    for k in ("loss", "grad_norm"):
        print(f"FSDP stream vs sync on 2 GPUs, step 1 {k}: {stream[0][k]} vs {sync[0][k]}")
        assert abs(stream[0][k] - sync[0][k]) <= 1e-5 * max(1.0, abs(sync[0][k])), k
    print(f"weights after {STEPS} steps: stream vs sync max |diff| {_dw(tmp_path, 'stream_grpo2', 'sync_grpo2'):.2e}")
    assert _dw(tmp_path, "steps_threaded", "steps_interleaved") == 0.0
    fused = _rows(tmp_path / "fused_grpo2")
    assert all(r["mismatch/max_abs"] == 0.0 and r["mismatch/full_max_abs"] == 0.0 for r in fused)
    assert {k: fused[0][k] for k in ROLLOUT} == {k: sync[0][k] for k in ROLLOUT}
    print(f"fused stream vs sync, step 1: loss {fused[0]['loss']} vs {sync[0]['loss']}, grad norm "
          f"{fused[0]['grad_norm']} vs {sync[0]['grad_norm']}")
