"""Fast model building for data-parallel runs: built on the meta device, FSDP2-sharded,
and only each rank's shard drawn (random, `model.init: keyed`) or read (an HF folder).

    model = build_sharded_random(model_config, ctx, dtype=torch.bfloat16, seed=0)
    model = load_sharded_folder("Qwen3-8B/", ctx, dtype=torch.bfloat16)

`load_sharded_folder` reads each tensor's rows of this rank only (safetensors slices), so
no rank holds the whole model; the masters equal `shard_model(load_model(folder))`'s.

The ordinary random init (`CausalLM.init_weights`, `model.init: stream`) draws every weight
from one generator in parameter order: a rank cannot draw its rows without drawing all
the rows before them, so every rank built the whole model (the 8B build took 130 s on 4
ranks, issue 39). The keyed init addresses every block of ROWS_PER_DRAW rows of a
parameter by (seed, parameter name, block index) and draws it from its own generator:

    W[name][rows of block b] ~ normal(0, std)  from  Generator(device).manual_seed(key(seed, name, b))
    norm weights = 1, biases = 0  (as init_weights)

so any split of the rows gives the same values: the N-rank model equals the 1-rank build
and the one-process `init_keyed` build bitwise (on one device type: CPU and CUDA
generators differ). Steps of `build_sharded_random`:
  1. CausalLM on the meta device (no memory), upcast to fp32 (the masters), `wrap_fsdp`;
  2. `to_empty`: each rank allocates its local shards only;
  3. each shard's rows (FSDP2's dim-0 chunks: ceil(rows / N) a rank) drawn keyed in fp32,
     rounded to the run dtype and back (the masters start as the run-dtype values, as
     `shard_model` and MasterAdamW do);
  4. `finish_sharding` (FSDP root, gradient sums), as `shard_model`.
A rank draws at most two blocks beyond its rows per parameter.
Test: python -m pytest -q tests/test_distributed_build.py
"""

from __future__ import annotations

import hashlib
import logging
import math

import torch
from torch.distributed.tensor import DTensor

from rlfuse.model import CausalLM, ModelConfig, load_rows_from_files
from rlfuse.run.distributed.context import DistContext
from rlfuse.run.distributed.fsdp import finish_sharding, wrap_fsdp

log = logging.getLogger(__name__)

ROWS_PER_DRAW = 64  # rows drawn by one generator: a shard boundary wastes at most one block a side
INIT_STD = 0.02  # CausalLM.init_weights' default


def _key(seed: int, name: str, block: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest(), "little") >> 1


@torch.no_grad()
def keyed_fill_(out: torch.Tensor, name: str, rows: int, row0: int, *, seed: int, std: float = INIT_STD) -> None:
    """Fill `out`, rows [row0, row0 + len(out)) of the (rows, ...) parameter `name`, with
    its keyed init (module doc); `out` may be any float dtype (values drawn in fp32)."""
    if name.endswith("norm.weight"):
        out.fill_(1.0)
        return
    if name.endswith(".bias"):
        out.zero_()
        return
    n = out.shape[0] if out.dim() else 1
    if n == 0:
        return
    if out.dim() == 0:
        raise ValueError(f"keyed init: parameter {name} is a scalar (expected rows)")
    for b in range(row0 // ROWS_PER_DRAW, (row0 + n - 1) // ROWS_PER_DRAW + 1):
        lo, hi = b * ROWS_PER_DRAW, min((b + 1) * ROWS_PER_DRAW, rows)
        g = torch.Generator(device=out.device).manual_seed(_key(seed, name, b))
        block = torch.empty((hi - lo, *out.shape[1:]), dtype=torch.float32, device=out.device)
        block.normal_(0.0, std, generator=g)
        a, z = max(lo, row0), min(hi, row0 + n)
        out[a - row0:z - row0].copy_(block[a - lo:z - lo])


@torch.no_grad()
def init_keyed(model: CausalLM, seed: int, std: float = INIT_STD) -> None:
    """The keyed init of a plain (unsharded) model, in place, in its dtype."""
    for name, p in model.named_parameters():
        keyed_fill_(p.data, name, p.shape[0] if p.dim() else 1, 0, seed=seed, std=std)


def _row0(p: DTensor, ctx: DistContext) -> int:
    """First global row of this rank's dim-0 shard (FSDP2 chunks as torch.chunk does)."""
    rows = p.shape[0]
    per = math.ceil(rows / ctx.world_size)
    row0 = min(ctx.rank * per, rows)
    assert p.to_local().shape[0] == max(0, min(per, rows - row0)), (p.shape, p.to_local().shape)  # FSDP2's layout
    return row0


def _shard_of(ctx: DistContext):
    return lambda p: (p.to_local(), _row0(p, ctx))


def load_sharded_folder(folder, ctx: DistContext, *, dtype: torch.dtype, text_only: bool = False) -> CausalLM:
    """An HF folder's model, FSDP2-sharded across ctx, each rank reading only its rows of
    every tensor (safetensors slices), rounded to `dtype` (the run dtype) and held as fp32
    masters: the masters of `shard_model(load_model(folder, dtype=dtype))`, without any
    rank holding the whole model. Collective. text_only: a multimodal folder's text tower alone."""
    cfg = ModelConfig.from_hf(folder, text_only=text_only)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to(dtype)
    model.float()
    wrap_fsdp(model, ctx, dtype)
    model.to_empty(device=ctx.device)
    load_rows_from_files(model, folder, _shard_of(ctx), via=dtype)
    log.info("loaded %s (%d layers) from %s shard by shard: rank %d read its rows only", cfg.model_type,
             cfg.num_hidden_layers, folder, ctx.rank)
    return finish_sharding(model, ctx, dtype)


def build_sharded_random(cfg: ModelConfig, ctx: DistContext, *, dtype: torch.dtype, seed: int,
                         std: float = INIT_STD) -> CausalLM:
    """A random CausalLM, FSDP2-sharded across ctx (as `shard_model` leaves it), with only this
    rank's shards materialized and initialized (module doc). Collective."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to(dtype)  # the compute dtype, read by wrap_fsdp; then the fp32 masters
    model.float()
    wrap_fsdp(model, ctx, dtype)
    model.to_empty(device=ctx.device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            row0 = _row0(p, ctx) if isinstance(p, DTensor) else 0
            vals = torch.empty(local.shape, dtype=torch.float32, device=local.device)
            keyed_fill_(vals, name, p.shape[0], row0, seed=seed, std=std)
            local.copy_(vals.to(dtype).float())  # masters start as the run-dtype values
    n = sum(p.numel() for p in model.parameters())
    log.info("random %s model built on the meta device, %d layers, %.2fM params: rank %d drew its shards only "
             "(model.init keyed)", cfg.model_type, cfg.num_hidden_layers, n / 1e6, ctx.rank)
    return finish_sharding(model, ctx, dtype)
