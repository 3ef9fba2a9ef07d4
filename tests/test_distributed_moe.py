"""moe/* metrics under data parallelism (gloo, 2 CPU processes): each rank routes its own
tokens through the same tiny Qwen3-MoE, and the metrics every rank reports are the whole
batch's, as one process computes them on both ranks' batches:
  * moe/load_max, moe/load_min: the busiest / idlest expert over the mean of the per-expert
    loads summed over the ranks (not a mean of the ranks' ratios);
  * moe/aux_loss, moe/z_loss: the mean of the ranks' (equal shares of the batch);
  * moe/routing_mismatch: the worst rank's fraction; a rank that compared nothing joins the
    collective and counts as none; no rank compared: no metric.
Run: python -m pytest -q -m slow tests/test_distributed_moe.py
"""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from spawn_ranks import free_port, spawn_ranks

from rlfuse.kernels import use_backend
from rlfuse.model import CausalLM, ModelConfig, Packed
from rlfuse.model.layers.moe import RouterLoss
from rlfuse.run.distributed import context as D
from rlfuse.run.distributed import mean_across_ranks, reduce_routing_mismatch

WORLD = 2
CFG = dict(model_type="qwen3_moe", vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
           moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True))


def _model() -> CausalLM:
    m = CausalLM(ModelConfig(**CFG))
    m.init_weights(std=0.3, generator=torch.Generator().manual_seed(0))
    return m


def _ids(rank: int) -> torch.Tensor:
    """Rank-specific tokens: the ranks' loads differ, so a mean of ratios would differ from the ratio of sums."""
    n = 9 if rank == 0 else 14
    return torch.randint(0, CFG["vocab_size"], (n,), generator=torch.Generator().manual_seed(10 + rank))


def _step(model: CausalLM, router: RouterLoss, ids: torch.Tensor) -> None:
    with use_backend("torch"):
        model(ids, torch.arange(len(ids)), Packed.from_lengths([len(ids)]))
    router.term(1.0)


def _job(rank: int, port: int, out: str):
    torch.set_num_threads(1)
    env = {"WORLD_SIZE": str(WORLD), "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    ctx = D.init_distributed(D.launch_env(env), device_type="cpu", timeout_s=60)
    try:
        model = _model()
        router = RouterLoss.for_model(model, aux_coef=0.01, z_coef=0.001)
        _step(model, router, _ids(rank))
        m = router.metrics(partial(mean_across_ranks, ctx))
        res = {k: float(v) for k, v in m.items()}
        res["mismatch_worst"] = reduce_routing_mismatch(ctx, 0.25 if rank == 0 else 0.5, 8)
        res["mismatch_one_rank"] = reduce_routing_mismatch(ctx, 0.125 if rank == 1 else 0.0, 8 if rank == 1 else 0)
        res["mismatch_none"] = reduce_routing_mismatch(ctx, 0.0, 0)
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(res, f)
    finally:
        D.shutdown()


@pytest.mark.slow  # two spawned processes: ~10 s of start-up on the 2-core CI machine
def test_moe_metrics_over_two_ranks_are_the_whole_batchs(tmp_path):
    spawn_ranks(_job, WORLD, free_port(), str(tmp_path))
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert got[0] == got[1]  # every rank reports the same numbers
    model = _model()
    loads, aux, z = [], [], []
    for r in range(WORLD):  # one process: each rank's batch alone, then the whole batch's metrics
        router = RouterLoss.for_model(model, aux_coef=0.01, z_coef=0.001)
        _step(model, router, _ids(r))
        loads.append(torch.stack([router._load[i] for i in range(len(router.blocks))]))  # (L, E)
        m = router.metrics()
        aux.append(m["moe/aux_loss"])
        z.append(m["moe/z_loss"])
        ratios = loads[-1] / loads[-1].mean(1, keepdim=True)
        assert float(m["moe/load_max"]) == pytest.approx(float(ratios.max()))
    total = loads[0] + loads[1]
    ratio = total / total.mean(1, keepdim=True)
    assert got[0]["moe/load_max"] == pytest.approx(float(ratio.max()), rel=1e-6)
    assert got[0]["moe/load_min"] == pytest.approx(float(ratio.min()), rel=1e-6)
    mean_of_ratios = float(torch.stack([(x / x.mean(1, keepdim=True)).max() for x in loads]).mean())
    assert got[0]["moe/load_max"] != pytest.approx(mean_of_ratios)  # the batches differ enough to tell
    assert got[0]["moe/aux_loss"] == pytest.approx(float(sum(aux)) / WORLD, rel=1e-6)
    assert got[0]["moe/z_loss"] == pytest.approx(float(sum(z)) / WORLD, rel=1e-6)
    assert got[0]["mismatch_worst"] == 0.5
    assert got[0]["mismatch_one_rank"] == 0.125
    assert got[0]["mismatch_none"] is None
