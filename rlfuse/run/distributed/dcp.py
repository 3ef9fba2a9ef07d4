"""Checkpoint I/O of a sharded run through torch.distributed.checkpoint (DCP): every
rank writes and reads its own shard (`save_sharded`, `load_sharded`, resharding to any
number of ranks), and `save_hf_export` gathers the full weights on rank 0 into an HF
folder that `transformers` loads.
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

from rlfuse.model.transformer import CausalLM
from rlfuse.model.weights import build_causal_lm, save_model
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
                shell = build_causal_lm(model.config)
            shell.load_state_dict(full, assign=True)  # adopts the gathered tensors: no copy
            out = save_model(shell, folder, tokenizer_dir=tokenizer_dir, dtype=dtype)
    return out


