"""Checkpoint I/O of a sharded run through torch.distributed.checkpoint (DCP): every
rank writes and reads its own shard (`save_sharded`, `load_sharded`, resharding to any
number of ranks), `save_hf_export` gathers the full weights on rank 0 into an HF
folder that `transformers` loads, and `full_adamw_state` / `load_full_adamw_state` move a
sharded model's whole training state to and from the one-process form.
Test: python -m pytest -q tests/test_distributed.py
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from rlfuse.model import CausalLM
from rlfuse.model.weights import save_model
from rlfuse.run.distributed.context import DistContext, fail_together

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- checkpoints
def save_sharded(ctx: DistContext, folder: str | Path, model, optimizer) -> None:
    """Every rank writes its shards of the fp32 weights and the optimizer state into
    `folder` (torch.distributed.checkpoint: one file per rank plus rank 0's metadata).
    Returns after all ranks finished. The trainer state (step, data position) is rank 0's
    to write beside it."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
    dist.barrier()


def load_sharded(folder: str | Path, model, optimizer) -> None:
    """Load a save_sharded checkpoint written at any number of ranks into `model` and
    `optimizer` in place: FSDP-sharded at any N (DCP reshards), or a plain unsharded model
    with a torch optimizer when no process group exists (one process)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def save_hf_export(ctx: DistContext, model: CausalLM, folder: str | Path, *, dtype: torch.dtype | str,
                   tokenizer_dir: str | Path | None = None) -> Path | None:
    """Gather the full weights on rank 0 (CPU, one tensor at a time) and write an HF folder
    with rlfuse.model.save_model in `dtype` (the run's model dtype). Collective: every rank
    calls it; returns the folder on rank 0, None elsewhere."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = None
    with fail_together(ctx, "export"):  # a write error on rank 0 stops every rank with its message
        if ctx.is_main:
            with torch.device("meta"):
                shell = CausalLM(model.config)
            shell.load_state_dict(full, assign=True)  # adopts the gathered tensors: no copy
            out = save_model(shell, folder, tokenizer_dir=tokenizer_dir, dtype=dtype)
    return out




# ---------------------------------------------------------------------- whole training state
@torch.no_grad()
def full_adamw_state(model, optimizer: torch.optim.AdamW,
                     compute_dtype: torch.dtype) -> tuple[dict, dict] | tuple[None, None]:
    """A sharded `model` and its AdamW on the shards (ShardedAdamW.opt) as one process holds them: (state dict in
    `compute_dtype`, MasterAdamW.state_dict()), both on rank 0's CPU, (None, None)
    elsewhere. Collective (one all-gather per tensor, every rank calls it). For state that
    travels in the trainer state (PPO's critic), so it resumes at any number of ranks."""
    rank0 = torch.distributed.get_rank() == 0
    weights, masters, avg, avg_sq, step = {}, [], [], [], 0
    for name, p in model.named_parameters():
        full = p.full_tensor()
        st = optimizer.state.get(p, {})
        if st:
            step = int(st["step"])  # host sync: a checkpoint's step count
        moments = [st[k].full_tensor() if st else torch.zeros_like(full) for k in ("exp_avg", "exp_avg_sq")]
        if rank0:
            weights[name] = full.to(compute_dtype).cpu()
            masters.append(None if compute_dtype == torch.float32 else full.cpu())
            avg.append(moments[0].cpu())
            avg_sq.append(moments[1].cpu())
    if not rank0:
        return None, None
    group = optimizer.param_groups[0]
    return weights, {"step": step, "lr": group["lr"], "betas": list(group["betas"]), "eps": group["eps"],
                     "weight_decay": group["weight_decay"], "master": masters, "exp_avg": avg, "exp_avg_sq": avg_sq}


@torch.no_grad()
def load_full_adamw_state(model, optimizer: torch.optim.AdamW, weights: dict, sd: dict) -> None:
    """The inverse of `full_adamw_state` (or a one-process model's state dict and its
    MasterAdamW.state_dict()) into a sharded `model` and its AdamW (ShardedAdamW.opt): every
    rank keeps its shard of the fp32 masters (the saved masters, else the weights upcast)
    and moments. Collective; rank 0's tensors are the ones distributed."""
    step = torch.tensor(float(sd["step"]))
    for i, (name, p) in enumerate(model.named_parameters()):
        master = sd["master"][i] if sd["master"][i] is not None else weights[name]
        p.to_local().copy_(_shard_like(master, p).to_local())
        optimizer.state[p] = {"step": step.clone(), "exp_avg": _shard_like(sd["exp_avg"][i], p),
                                  "exp_avg_sq": _shard_like(sd["exp_avg_sq"][i], p)}


def _shard_like(full: torch.Tensor, p: DTensor) -> DTensor:
    """`full` (every rank holds it) in fp32, sharded as parameter `p`."""
    return distribute_tensor(full.float().to(p.device), p.device_mesh, p.placements)
