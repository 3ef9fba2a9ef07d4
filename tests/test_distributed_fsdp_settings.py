"""The distributed.* FSDP2 settings and the step profiler (logging.profile_step) on 2 gloo
ranks (CPU), through `run_grpo` on a tiny 3-layer fp32 model with gradient checkpointing,
2 steps, ~4 micro-batches per rank and optimizer step.

One spawned 2-rank job runs the default settings and the alternatives, every run profiling
the train phase of step 2 on both ranks; then this process checks:
  * reshard_after_forward false, reshard_after_backward false, prefetch 2 and
    optimizer_foreach together (distributed.trade communication with grad_sync every; each
    alone: -m slow, a second job): final weights bitwise
    equal to the default's (the same gathered values, only the gathers move; the foreach
    AdamW does the single-tensor path's elementwise math), with fewer all-gathers in the
    profile where fewer are expected;
  * grad_sync last: fewer reduce-scatters, final weights within fp32 rounding of the
    default's (each rank's micro-batches summed first, then the ranks: another order);
  * the profile: a trace and a summary per rank, collectives classified (gloo's are host ops);
  * distributed.trade: how auto resolves, and (a second job) SFT, DPO, PPO and MoE GRPO under
    the communication trade against the memory trade.
Run: python -m pytest -q tests/test_distributed_fsdp_settings.py -s   (each knob alone: add -m slow)
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from spawn_ranks import free_port, gloo_rank, spawn_ranks
from test_distributed_kinds import _dpo_cfg
from test_distributed_moe_train import _grpo as _moe_grpo
from test_distributed_ppo import _cfg as _ppo_cfg
from test_distributed_run import _sft
from train_setup import TINY_MODEL, tiny_cfg

from rlfuse.run.config import DistributedConfig, replace
from rlfuse.run.distributed import context as D
from rlfuse.run.distributed.fsdp import AUTO_SHARE, TRADES, resolve_settings
from rlfuse.run.metrics import read_metrics
from rlfuse.train.dpo import run_dpo
from rlfuse.train.grpo import run_grpo
from rlfuse.train.ppo import run_ppo
from rlfuse.train.sft import run_sft

WORLD = 2
MODEL = {"random_init": dict(TINY_MODEL, num_hidden_layers=3), "gradient_checkpointing": True}
BASE = ("grpo.steps=2", "grpo.micro_batch_tokens=24", "data.eval_size=2", "logging.profile_step=2",
        "reward_timeout_s=0")
# the share of even token ids: nearly every group has reward variance at every step (the tiny
# random model never solves arithmetic), so both optimizer steps move every weight
REWARD = ("def even(prompts, completions, completion_ids, **kw):\n"
          "    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]\n")
VARIANTS = {
    "default": (),
    "keep_fwd": ("distributed.reshard_after_forward=false",),
    "keep_bwd": ("distributed.reshard_after_backward=false",),
    "prefetch": ("distributed.prefetch=2",),
    "foreach": ("distributed.optimizer_foreach=true",),
    # the communication trade (reshards off, prefetch 2, foreach AdamW) with its grad_sync
    # overridden back: the four bitwise settings together, through the trade's resolution
    "all": ("distributed.trade=communication", "distributed.grad_sync=every"),
    "sync_last": ("distributed.grad_sync=last",),
}
# grad_sync last vs every: fp32 gradient sums in another order. The sharp check is step 1's
# gradient norm (same weights, only the sum order differs): measured (print with -s) 8.5e-8
# relative, bound 1e-6 (a micro-batch lost or counted twice moves it by far more). The weights
# then drift apart through Adam, whose first steps move each element by ~lr m / sqrt(v) ~ +-lr,
# whatever its gradient's size: an element whose gradient is at the rounding level can flip
# sign. Measured max |final weight diff| after 2 steps 1.2e-2 lr (a handful of elements);
# bound 5e-2 lr.
WEIGHT_TOL = 5e-2 * 1e-2  # tiny_cfg's optim.lr
NORM_TOL = 1e-6


FAST = ("default", "all", "sync_last")  # the default suite; each knob alone: -m slow
EACH = ("keep_fwd", "keep_bwd", "prefetch", "foreach")


def _job(rank: int, port: int, out: str, names: tuple[str, ...]) -> None:
    ctx = gloo_rank(rank, WORLD, port)
    rewards = [{"name": f"{out}/reward.py:even"}]
    for name in names:
        run_grpo(tiny_cfg(Path(out) / name, *BASE, *VARIANTS[name], model=MODEL, rewards=rewards), dist=ctx)
    D.shutdown()


def _spawn(out: Path, names: tuple[str, ...]) -> Path:
    (out / "reward.py").write_text(REWARD)
    t0 = time.perf_counter()
    spawn_ranks(_job, WORLD, free_port(), str(out), names)
    print(f"\n{WORLD}-rank runs {', '.join(names)}: {time.perf_counter() - t0:.1f} s")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("fsdp_settings"), FAST)


@pytest.fixture(scope="module")
def runs_each(tmp_path_factory, runs):
    out = _spawn(tmp_path_factory.mktemp("fsdp_each"), EACH)
    (out / "default").symlink_to(runs / "default")  # the same run: fixed seeds, one config
    return out


def _weights(run: Path) -> dict[str, torch.Tensor]:
    w = {}
    for f in sorted((run / "final").glob("*.safetensors")):
        w.update(load_file(str(f)))
    return w


def _rows(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("stage") == "grpo"]


def _updates(run: Path) -> int:
    """Optimizer steps the run took (GRPO skips those of a step without reward variance)."""
    return sum(1 for r in _rows(run) if not r.get("skipped_update"))


def _profile(run: Path, rank: int) -> dict:
    return json.loads((run / "profile" / f"step2_rank{rank}.json").read_text())


def _bitwise_same(runs: Path, name: str) -> None:
    assert _updates(runs / "default") == 2  # else equal weights would prove little
    a, b = _weights(runs / name), _weights(runs / "default")
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), (name, k, (a[k] - b[k]).abs().max())


def _gathers_less(runs: Path, name: str) -> None:
    for rank in range(WORLD):
        mine, base = _profile(runs / name, rank)["counts"], _profile(runs / "default", rank)["counts"]
        print(f"{name} rank {rank}: all-gathers {mine['all_gather']} (default {base['all_gather']})")
        assert 0 < mine["all_gather"] < base["all_gather"], (mine, base)
        assert mine["reduce_scatter"] == base["reduce_scatter"]


def test_the_bitwise_settings_together_train_the_same_with_fewer_gathers(runs):
    _bitwise_same(runs, "all")
    _gathers_less(runs, "all")


@pytest.mark.slow
@pytest.mark.parametrize("name", EACH)
def test_each_bitwise_setting_alone_trains_the_same(runs_each, name):
    _bitwise_same(runs_each, name)
    if name not in ("prefetch", "foreach"):  # prefetch issues the same all-gathers earlier
        _gathers_less(runs_each, name)


def test_grad_sync_last_reduce_scatters_once_per_optimizer_step(runs):
    for rank in range(WORLD):
        mine, base = _profile(runs / "sync_last", rank)["counts"], _profile(runs / "default", rank)["counts"]
        print(f"sync_last rank {rank}: reduce-scatters {mine['reduce_scatter']} (default {base['reduce_scatter']})")
        assert 0 < mine["reduce_scatter"] < base["reduce_scatter"], (mine, base)
    norms = [{r["step"]: r["grad_norm"] for r in _rows(runs / name)} for name in ("sync_last", "default")]
    rel = abs(norms[0][1] - norms[1][1]) / norms[1][1]
    print(f"grad_sync last vs every: step-1 gradient norm {norms[0][1]} vs {norms[1][1]} (rel {rel:.1e})")
    assert rel <= NORM_TOL
    a, b = _weights(runs / "sync_last"), _weights(runs / "default")
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    print(f"grad_sync last vs every: max |final weight diff| {worst:.2e}")
    assert worst <= WEIGHT_TOL


def test_profile_writes_a_trace_and_a_summary_per_rank(runs):
    for rank in range(WORLD):
        s = _profile(runs / "default", rank)
        assert (s["step"], s["phase"], s["rank"], s["device"]) == (2, "train", rank, "cpu")
        assert s["wall_s"] > 0 and 0 < s["busy_s"] <= s["wall_s"] * 1.05
        assert s["all_gather_s"] > 0 and s["reduce_scatter_s"] > 0 and s["n_collectives"] > 0
        assert abs(s["compute_s"] + s["comm_s"] - s["busy_s"]) < 1e-9  # host ops: gloo blocks the thread
        assert s["top_host_ops"] and all(op["self_s"] >= 0 for op in s["top_host_ops"])
        with gzip.open(runs / "default" / "profile" / f"step2_rank{rank}.trace.json.gz") as f:
            assert json.load(f)["traceEvents"]
    rows = {r["step"]: r for r in _rows(runs / "default")}
    assert sorted(rows) == [1, 2] and rows[2]["time/train"] > 0  # the profiled step is logged as any other
    assert not (runs / "default" / "profile" / "step1_rank0.json").exists()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_foreach_adamw_is_the_single_tensor_path_bitwise(device):
    """distributed.optimizer_foreach: torch's multi-tensor AdamW against its single-tensor path
    (the default, elementwise MasterAdamW's math) on plain fp32 tensors, 5 steps, odd sizes."""
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=g).to(device) for n in (1000, 37, 4099, 1)]

    def run(foreach: bool):
        ps = [p.clone().requires_grad_() for p in init]
        opt = torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=foreach, fused=False)
        gg = torch.Generator().manual_seed(1)
        for _ in range(5):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gg).to(device) * 1e-3
            opt.step()
        return [p.detach() for p in ps]
    for a, b in zip(run(True), run(False)):
        if device == "cpu":
            assert torch.equal(a, b), (a - b).abs().max()
        else:  # CUDA's foreach kernels round apart: measured 1.2e-7 (one ulp at |w| ~ 1) on an H200
            assert (a - b).abs().max() <= 2 * torch.finfo(torch.float32).eps * b.abs().max(), (a - b).abs().max()


def test_trade_fills_only_the_unset_settings():
    """distributed.trade: auto weighs the communication trade's extra bytes against the GPU's
    memory (memory on CPU); a setting given keeps its value whatever the trade."""
    n, gpu = 600_000_000, 140 * 2**30  # a 0.6B model in bf16 (6 bytes a parameter extra) on an H200
    picked = resolve_settings(DistributedConfig(), n, 2, gpu)[0]
    assert picked.trade == "communication" and {k: getattr(picked, k) for k in TRADES["communication"]} == \
        TRADES["communication"]
    big = int(AUTO_SHARE * gpu / 6) + 1  # one parameter over the share
    assert resolve_settings(DistributedConfig(), big, 2, gpu)[0].trade == "memory"
    assert resolve_settings(DistributedConfig(), big - 1, 2, gpu)[0].trade == "communication"
    assert resolve_settings(DistributedConfig(), n, 4, gpu)[0].trade == "communication"  # fp32: 8 bytes
    cpu, why = resolve_settings(DistributedConfig(), n, 2, None)
    assert cpu.trade == "memory" and "CPU" in why and cpu.grad_sync == "every" and cpu.prefetch == 0
    mixed = resolve_settings(DistributedConfig(trade="communication", grad_sync="every", prefetch=1), n, 2, None)[0]
    assert (mixed.grad_sync, mixed.prefetch, mixed.reshard_after_forward, mixed.optimizer_foreach) == \
        ("every", 1, False, True)
    assert resolve_settings(DistributedConfig(trade="memory"), n, 2, gpu)[0].reshard_after_forward is True


# ---------------------------------------------------------------------- the trades on every trainer
def _trade_cfgs(out: Path, trade: str) -> dict:
    """SFT, DPO, PPO (policy and critic sharded) and MoE GRPO (experts sharded), each as its own
    2-rank test file configures it, under distributed.trade `trade`."""
    cfgs = {"sft": _sft(out / f"sft_{trade}"), "dpo": _dpo_cfg(out / f"dpo_{trade}", "precompute"),
            "ppo": _ppo_cfg(out / f"ppo_{trade}"), "moe_grpo": _moe_grpo(out / f"moe_grpo_{trade}")}
    return {k: replace(c, **{"distributed.trade": trade}) for k, c in cfgs.items()}


def _trades_job(rank: int, port: int, out: str) -> None:
    ctx = gloo_rank(rank, WORLD, port)
    runners = {"sft": run_sft, "dpo": run_dpo, "ppo": run_ppo, "moe_grpo": run_grpo}
    for trade in ("memory", "communication"):
        for kind, cfg in _trade_cfgs(Path(out), trade).items():
            runners[kind](cfg, dist=ctx)
    D.shutdown()


def test_the_communication_trade_trains_every_trainer_as_the_memory_trade(tmp_path):
    """On GPUs `trade: auto` gives small models the communication trade: SFT, DPO and PPO
    (which reduce every micro-batch whatever grad_sync says) train bitwise as under the
    memory trade; GRPO (grad_sync last) within fp32 rounding, here on the MoE model. One
    2-rank job of 8 runs, ~16 s on 2 cores. (DPO's reference precompute, a forward-only
    pass, left the weights gathered under reshard_after_forward false, and the run loop
    kept those soon-freed tensors: a segfault, until `reshard`.)"""
    spawn_ranks(_trades_job, WORLD, free_port(), str(tmp_path))
    for kind in ("sft", "dpo", "ppo", "moe_grpo"):
        a, b = _weights(tmp_path / f"{kind}_communication"), _weights(tmp_path / f"{kind}_memory")
        assert sorted(a) == sorted(b) and a, kind
        worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
        print(f"{kind}: communication vs memory trade, max |final weight diff| {worst:.2e}")
        if kind == "moe_grpo":
            assert worst <= WEIGHT_TOL
        else:
            assert worst == 0.0, kind
        ma = [r for r in read_metrics(tmp_path / f"{kind}_communication") if "loss" in r]
        mb = [r for r in read_metrics(tmp_path / f"{kind}_memory") if "loss" in r]
        assert len(ma) == len(mb) > 0 and (kind == "moe_grpo" or [r["loss"] for r in ma] == [r["loss"] for r in mb])
