"""Random models built on the meta device with only each rank's shard drawn
(rlfuse.run.distributed.build, `model.init: keyed`), CPU + gloo.

  * `keyed_fill_` of any row range equals those rows of the whole parameter's draw (odd
    ranges across block boundaries, a range inside one block, an empty one);
  * 1 rank and 2 ranks build the same fp32 masters, bitwise, in bf16 and fp32 runs, and
    they equal `shard_model` of the one-process keyed build (`init_keyed`), so a
    data-parallel run starts from the one-process weights; each rank holds only its rows
    (parameter bytes ~ 1/N);
  * an HF folder read shard by shard (`load_sharded_folder`: safetensors slices) gives the
    masters of `shard_model(load_model(folder))`, bitwise, at 1 and 2 ranks, with the
    file's fp32 rows rounded to a bf16 run's dtype;
  * a data-parallel GRPO step (`open_session` with model.init keyed) equals one process.
Run: python -m pytest -q tests/test_distributed_build.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spawn_ranks import free_port, spawn_ranks
from train_setup import tiny_cfg

from rlfuse.model import CausalLM, ModelConfig, load_model, save_model
from rlfuse.run.distributed import context as D
from rlfuse.run.distributed.build import (
    ROWS_PER_DRAW,
    build_sharded_random,
    init_keyed,
    keyed_fill_,
    load_sharded_folder,
)
from rlfuse.run.distributed.fsdp import full_copy, memory_bytes, shard_model
from rlfuse.run.metrics import read_metrics
from rlfuse.train.grpo import run_grpo

# vocab 200 rows: 4 draw blocks, shard boundary at row 100 inside block 1; odd widths
CFG = ModelConfig(model_type="qwen3", vocab_size=200, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=12, max_position_embeddings=64,
                  tie_word_embeddings=False)


def test_any_row_range_is_those_rows_of_the_whole():
    rows = 3 * ROWS_PER_DRAW + 5
    whole = torch.empty(rows, 7)
    keyed_fill_(whole, "model.layers.0.mlp.up_proj.weight", rows, 0, seed=3)
    assert whole.std() > 0.01 and not torch.equal(whole[:ROWS_PER_DRAW], whole[ROWS_PER_DRAW:2 * ROWS_PER_DRAW])
    for a, z in ((0, rows), (1, ROWS_PER_DRAW + 3), (ROWS_PER_DRAW - 1, 2 * ROWS_PER_DRAW + 1), (5, 9), (rows, rows)):
        part = torch.full((z - a, 7), float("nan"))
        keyed_fill_(part, "model.layers.0.mlp.up_proj.weight", rows, a, seed=3)
        assert torch.equal(part, whole[a:z]), (a, z)
    other = torch.empty(rows, 7)
    keyed_fill_(other, "model.layers.1.mlp.up_proj.weight", rows, 0, seed=3)  # another name: other draws
    assert not torch.equal(other, whole)
    norm = torch.zeros(7)
    keyed_fill_(norm, "model.norm.weight", 7, 0, seed=3)
    assert torch.equal(norm, torch.ones(7))


def _job(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    env = {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    ctx = D.init_distributed(D.launch_env(env), device_type="cpu", timeout_s=60)
    for dtype in (torch.bfloat16, torch.float32):
        model = build_sharded_random(CFG, ctx, dtype=dtype, seed=5)
        masters = full_copy(model, torch.float32).state_dict()
        plain = CausalLM(CFG).to(dtype)
        init_keyed(plain, seed=5)
        ref = full_copy(shard_model(plain, ctx), torch.float32).state_dict()
        mine = memory_bytes(model, compute_dtype=dtype)["params"]
        if rank == 0:
            torch.save({"masters": masters, "ref": ref, "param_bytes": mine}, Path(out) / f"w{world}_{dtype}.pt")
    folder = Path(out) / "folder"  # fp32 tensors in the file; the run in bf16 (the rows are rounded)
    for dtype in (torch.bfloat16, torch.float32):
        model = load_sharded_folder(folder, ctx, dtype=dtype)
        masters = full_copy(model, torch.float32).state_dict()
        ref = full_copy(shard_model(load_model(folder, dtype=dtype), ctx), torch.float32).state_dict()
        if rank == 0:
            torch.save({"masters": masters, "ref": ref}, Path(out) / f"f{world}_{dtype}.pt")
    run_grpo(tiny_cfg(Path(out) / f"grpo{world}", "model.init=keyed", "grpo.steps=1", "grpo.eval_every=0",
                      "engine.fuse_projections=false"), dist=ctx if world > 1 else None)
    D.shutdown()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("meta_build")
    plain = CausalLM(CFG)
    plain.init_weights(generator=torch.Generator().manual_seed(1))
    save_model(plain, out / "folder")
    for world in (1, 2):
        spawn_ranks(_job, world, world, free_port(), str(out))
    return out


@pytest.mark.slow  # the fixture's 1-rank and 2-rank jobs: ~35 s on 2 cores
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_and_two_ranks_build_the_one_process_weights(built, dtype):
    one, two = (torch.load(built / f"w{w}_{dtype}.pt") for w in (1, 2))
    for res in (one, two):
        assert res["masters"].keys() == res["ref"].keys()
        for k, v in res["masters"].items():
            assert torch.equal(v, res["ref"][k]), k  # = shard_model(one-process keyed build)
            assert torch.equal(v, one["masters"][k]), k  # 2 ranks = 1 rank
            assert torch.equal(v, v.to(dtype).float()), k  # masters start as run-dtype values
    total = sum(v.numel() * 4 for v in one["masters"].values())
    assert one["param_bytes"] == total and abs(two["param_bytes"] - total / 2) <= 4 * CFG.hidden_size * 20


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_folder_read_shard_by_shard_equals_the_whole_load(built, dtype):
    for world in (1, 2):
        res = torch.load(built / f"f{world}_{dtype}.pt")
        assert res["masters"].keys() == res["ref"].keys()
        for k, v in res["masters"].items():
            assert torch.equal(v, res["ref"][k]), (world, k)
            assert torch.equal(v, v.to(dtype).float()), k  # rounded to the run dtype


@pytest.mark.slow
def test_keyed_build_trains_like_one_process(built):
    def rows(run):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s", "memory/", "optim/update"))}
                for r in read_metrics(built / run)]
    one, two = rows("grpo1"), rows("grpo2")
    assert [r["step"] for r in two if r["stage"] == "grpo"] == [1]
    for a, b in zip(one, two):
        for k, v in a.items():
            if isinstance(v, float):
                assert abs(v - b[k]) <= 1e-5 * max(1.0, abs(v)), k
