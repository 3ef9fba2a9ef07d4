"""PPO's critic: building it, its optimizer, and its training state in the checkpoint.

The critic (rlfuse.model.ScalarHeadModel) starts as a copy of the policy's trunk with a zero
head, or from ppo.critic_path. Data-parallel (a DistContext), it is FSDP2-sharded like the
policy (`shard_model`: fp32 master shards, gradients summed across ranks, torch's AdamW on
the shards); with a sharded policy its trunk is copied from the policy's full weights
(`full_copy`, gathered once at the start). Its weights and optimizer state travel in the
trainer state of the checkpoint (state.pt) in the one-process form (the state dict in the
run dtype and MasterAdamW.state_dict()); data-parallel they are gathered to rank 0 for the
write (`full_adamw_state`: 16 P bytes of rank 0's CPU memory, one tensor gathered at a
time) and every rank keeps its shard when loading, so a PPO checkpoint resumes at any
number of ranks, one process included.
Test: python -m pytest -q tests/test_ppo_trainer.py tests/test_distributed_ppo.py
"""

from __future__ import annotations

import logging

from rlfuse.model.scalar_head import ScalarHeadModel, load_scalar_head_model
from rlfuse.model.weights import parse_dtype
from rlfuse.run import MasterAdamW
from rlfuse.run.config import RunConfig
from rlfuse.run.distributed import (
    DistContext,
    ShardedAdamW,
    configure_fsdp,
    full_adamw_state,
    full_copy,
    is_sharded,
    load_full_adamw_state,
    shard_model,
)
from rlfuse.train.session import fuse_projections_on

log = logging.getLogger(__name__)


def build_critic(cfg: RunConfig, policy, dist: DistContext | None = None) -> ScalarHeadModel:
    """The value model: ppo.critic_path's checkpoint, or a copy of the policy's trunk (zero
    head); FSDP2-sharded when `dist` is given."""
    p = cfg.ppo
    dtype = parse_dtype(cfg.model.dtype)
    if p.critic_path:
        dev = policy.lm_head_weight.device if dist is None else dist.device
        critic = load_scalar_head_model(p.critic_path, device=dev, dtype=dtype, head="zero")
        if critic.num_labels != 1:
            raise ValueError(f"ppo.critic_path: {p.critic_path} has num_labels {critic.num_labels}; a critic "
                             f"needs a single output")
        if critic.config.vocab_size < policy.config.vocab_size:
            raise ValueError(f"ppo.critic_path: {p.critic_path} has vocab_size {critic.config.vocab_size}, fewer "
                             f"than the policy's {policy.config.vocab_size}; the critic reads the policy's tokens")
        log.info("critic: from %s", p.critic_path)
    else:
        # a sharded policy's trunk: its full weights in the run dtype (the masters are exact
        # upcasts of them before the first step), gathered once, dropped after the copy
        src = full_copy(policy, dtype) if is_sharded(policy) else policy
        critic = ScalarHeadModel.from_causal_lm(src)
        del src
        log.info("critic: a copy of the policy's trunk with a zero value head (ppo.critic_path empty)")
    critic.gradient_checkpointing = cfg.model.gradient_checkpointing
    critic.kernels = policy.kernels
    if dist is not None:
        critic = shard_model(critic, dist)
        # training forwards fused as the policy's (a one-process critic is never fused, no engine
        # runs it: in fast numerics the two differ by the fused GEMMs' rounding; exact forwards agree)
        configure_fsdp(critic, cfg.distributed, parse_dtype(cfg.model.dtype),
                       fuse=fuse_projections_on(cfg, dist.device))
    return critic


def make_critic_optimizer(critic: ScalarHeadModel, cfg: RunConfig) -> MasterAdamW:
    """MasterAdamW at ppo.critic_lr (ShardedAdamW for a sharded critic), the run's other optim settings."""
    o = cfg.optim
    kw = dict(lr=cfg.ppo.critic_lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if is_sharded(critic):
        return ShardedAdamW(critic, **kw, compute_dtype=parse_dtype(cfg.model.dtype))
    return MasterAdamW(critic.parameters(), **kw)


def critic_state(critic, optimizer) -> dict:
    """{"critic": state dict, "critic_optimizer": MasterAdamW state}: the one-process form
    (sharded: gathered on rank 0, collective; other ranks' dicts hold None, never written)."""
    if is_sharded(critic):
        weights, opt = full_adamw_state(critic, optimizer.opt, optimizer.compute_dtype)
        return {"critic": weights, "critic_optimizer": opt}
    return {"critic": critic.state_dict(), "critic_optimizer": optimizer.state_dict()}


def load_critic_state(critic, optimizer, state: dict) -> None:
    """`critic_state`'s dicts (written by one process or any number of ranks) into the critic."""
    if is_sharded(critic):
        load_full_adamw_state(critic, optimizer.opt, state["critic"], state["critic_optimizer"])
    else:
        critic.load_state_dict(state["critic"])
        optimizer.load_state_dict(state["critic_optimizer"])
