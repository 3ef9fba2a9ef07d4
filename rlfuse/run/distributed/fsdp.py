"""FSDP2 sharding of the policy: `shard_model` (fp32 master shards, bf16 all-gathers),
the sharded AdamW and gradient clipping, per-rank memory accounting, and
`gathered_weights`, the block in which the engine reads the gathered weights (no second
copy); `configure_fsdp` / `sync_on_last`: the distributed.* settings (reshard, prefetch,
gradient sync). The rounding and loss contracts are in rlfuse/run/distributed/context.py.
Test: python -m pytest -q tests/test_distributed.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rlfuse.model import CausalLM, Packed
from rlfuse.model.fuse_sharded import fuse_sharded
from rlfuse.run.distributed.context import DistContext, reduce_metrics

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- sharding
def _fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _apply_reshard_policy(model: torch.nn.Module) -> None:
    # layers free their gathered weights after forward (re-gathered for backward) unless
    # distributed.reshard_after_forward is false; the root (embedding, final norm, LM head)
    # keeps them: the trainer reads `model.lm_head_weight` after forward for the log-probs,
    # and that must be the gathered tensor, not the shard
    settings = getattr(model, "fsdp_settings", None)
    after = settings is None or settings.reshard_after_forward
    for m in _fsdp_modules(model):
        m.set_reshard_after_forward(after and m is not model, recurse=False)


TRADES = {
    "memory": dict(reshard_after_forward=True, reshard_after_backward=True, prefetch=0, grad_sync="every",
                   optimizer_foreach=False),
    "communication": dict(reshard_after_forward=False, reshard_after_backward=False, prefetch=2, grad_sync="last",
                          optimizer_foreach=True),
}
"""The values distributed.trade gives the settings left unset (the communication row is the
set measured fastest on 4 H200s: benchmarks/bench_multi_gpu.py scale, docs/distributed.md)."""
AUTO_SHARE = 0.10
"""distributed.trade auto: the communication trade's extra bytes (gathered weights + unsharded
fp32 gradients) may take this share of the GPU's memory; the engine's KV pool and the
activations are sized from the rest (engine.gpu_memory_fraction)."""


def resolve_settings(settings, n_params: int, compute_bytes: int, device_bytes: int | None):
    """`settings` (DistributedConfig) with every unset (None) field filled from its trade;
    auto picks communication when (compute_bytes + 4) * n_params <= AUTO_SHARE * device_bytes
    (device_bytes None, a CPU: memory). Returns (resolved settings, one line saying why)."""
    trade, why = settings.trade, "as set"
    if trade == "auto":
        extra = (compute_bytes + 4) * n_params
        if device_bytes is None:
            trade, why = "memory", "auto on CPU"
        else:
            fits = extra <= AUTO_SHARE * device_bytes
            trade = "communication" if fits else "memory"
            why = (f"auto: the gathered model and its fp32 gradients ({extra / 2**30:.1f} GiB, "
                   f"{compute_bytes + 4} bytes x {n_params / 1e9:.2f} B parameters) {'fit in' if fits else 'exceed'} "
                   f"{AUTO_SHARE:.0%} of the GPU's {device_bytes / 2**30:.1f} GiB")
    unset = {k: v for k, v in TRADES[trade].items() if getattr(settings, k) is None}
    return dataclasses.replace(settings, trade=trade, **unset), why


def configure_fsdp(model: CausalLM, settings, compute_dtype: torch.dtype, *, fuse: bool = False) -> None:
    """Apply the FSDP2 settings `settings` (rlfuse.run.config.DistributedConfig: its trade,
    reshard_after_forward, reshard_after_backward, prefetch, grad_sync, optimizer_foreach) to
    sharded `model` (gathering in `compute_dtype`), and keep them, resolved
    (`resolve_settings`), on it as `model.fsdp_settings` (`gathered_weights` restores the
    reshard policy from them; `sync_on_last` reads grad_sync, ShardedAdamW optimizer_foreach).
    Whatever the settings, the values the layers compute with are the same all-gathered
    weights: only when the gathers and frees happen changes (grad_sync apart: see `sync_on_last`).
    `fuse` (engine.fuse_projections, resolved): the training forwards run each q/k/v, gate/up
    and linear-attention input group as one GEMM over its gathered parts (`fuse_sharded`)."""
    device = next(model.parameters()).device
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    n_params = sum(p.numel() for p in model.parameters())  # DTensor: the global count
    settings, why = resolve_settings(settings, n_params, compute_dtype.itemsize, total)
    model.fsdp_settings = settings
    _apply_reshard_policy(model)
    for m in _fsdp_modules(model):
        m.set_reshard_after_backward(settings.reshard_after_backward, recurse=False)
    k = settings.prefetch
    trunk = getattr(model, "model", None)  # CausalLM and PPO's ScalarHeadModel: the decoder stack
    layers = [m for m in getattr(trunk, "layers", []) if isinstance(m, FSDPModule)]  # forward order
    if k and layers:
        # the root runs first in forward (embedding) and first in backward (LM head, norm)
        model.set_modules_to_forward_prefetch(layers[:k])
        model.set_modules_to_backward_prefetch(layers[::-1][:k])
        for i, m in enumerate(layers):
            if nxt := layers[i + 1:i + 1 + k]:
                m.set_modules_to_forward_prefetch(nxt)
            if prev := layers[max(0, i - k):i][::-1]:  # nearest first, as backward reaches them
                m.set_modules_to_backward_prefetch(prev)
    log.info("FSDP2 trade %s (%s): reshard_after_forward %s, reshard_after_backward %s, prefetch %d, grad_sync %s, "
             "optimizer_foreach %s", settings.trade, why, settings.reshard_after_forward,
             settings.reshard_after_backward, k, settings.grad_sync, settings.optimizer_foreach)
    if fuse:
        fuse_sharded(model)


def sync_on_last(model: torch.nn.Module, micro_batches):
    """Iterate `micro_batches` (the caller runs one backward per item). With
    `distributed.grad_sync: last` on a sharded model, FSDP2 reduce-scatters only in the last
    item's backward: earlier backwards accumulate this rank's unsharded fp32 gradients
    (4 bytes per parameter). Every rank must iterate the same number of items (the trainers
    pad to equal micro-batch counts). The sum is then (rank's micro-batches) across ranks
    instead of (ranks) across micro-batches: equal within fp32 rounding, not bitwise.
    Otherwise (the default, one process, a replicated model) the items pass through untouched."""
    settings = getattr(model, "fsdp_settings", None)
    if settings is None or settings.grad_sync == "every" or not isinstance(model, FSDPModule):
        yield from micro_batches
        return
    items = list(micro_batches)
    try:
        for i, item in enumerate(items):
            model.set_requires_gradient_sync(i == len(items) - 1)
            yield item
    finally:
        model.set_requires_gradient_sync(True)


def shard_model(model: CausalLM, ctx: DistContext) -> CausalLM:
    """FSDP2-shard `model` in place across ctx.mesh and return it. The parameters become
    fp32 DTensor shards (the master weights, upcast exactly from the model's dtype, as
    MasterAdamW does); forward computes in the model's dtype (bf16: gathered weights are
    round(fp32 master)), gradients are reduced in fp32 and SUMMED across ranks (see the
    loss contract in the module doc). One FSDP group per decoder layer, one for a vision
    tower, plus the root (a ScalarHeadModel too: PPO's critic, its `score` head in the root)."""
    compute = next(model.parameters()).dtype
    if any(p.dtype != compute for p in model.parameters()):
        raise ValueError("shard_model: all parameters must share one dtype (the compute dtype)")
    model.float()
    wrap_fsdp(model, ctx, compute)
    return finish_sharding(model, ctx, compute)


def wrap_fsdp(model: CausalLM, ctx: DistContext, compute: torch.dtype) -> None:
    """The FSDP2 groups of `shard_model` on an fp32 model (real or on the meta device:
    rlfuse.run.distributed.build initializes the shards after this)."""
    # cast_forward_inputs off: a layer's inputs include the fp32 RoPE frequencies, which
    # must not be rounded to bf16 (the activations already come out of bf16 weights)
    policy = MixedPrecisionPolicy(param_dtype=None if compute == torch.float32 else compute,
                                  reduce_dtype=torch.float32, cast_forward_inputs=False)
    for layer in model.model.layers:
        fully_shard(layer, mesh=ctx.mesh, mp_policy=policy)
    if getattr(model, "visual", None) is not None:
        # its own group: the trainer encodes images through `model.encode_images` before the
        # root's forward, so the tower's weights must gather on the tower's own call
        fully_shard(model.visual, mesh=ctx.mesh, mp_policy=policy)
    fully_shard(model, mesh=ctx.mesh, mp_policy=policy)
    _apply_reshard_policy(model)


def finish_sharding(model: CausalLM, ctx: DistContext, compute: torch.dtype) -> CausalLM:
    """After `wrap_fsdp` and with the shards holding their values: fix the FSDP root,
    free what that gathered, and sum the gradients across ranks."""
    # FSDP2 makes the first module to run forward the root; the engine calls
    # `model.forward` (not the root's hooks) and may run first, so run one token through
    # the root now (collective: every rank calls shard_model)
    with torch.no_grad():
        one = torch.zeros(1, dtype=torch.long, device=ctx.device)
        model(one, one, Packed.from_lengths([1], ctx.device))
    model.reshard()  # the root keeps its gathered weights after forward; the optimizer must see the shards
    for m in _fsdp_modules(model):
        # sum, not mean: each rank's loss already carries its share of the global normalizer
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    log.info("FSDP2: %d groups over %d ranks, fp32 masters, %s compute", len(_fsdp_modules(model)),
             ctx.world_size, str(compute).replace("torch.", ""))
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(ts) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in ts if t is not None)


def memory_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 compute_dtype: torch.dtype) -> dict[str, int]:
    """This rank's bytes of parameter shards, gradient shards and optimizer state (local
    pieces of DTensors), plus `gathered`: what `gathered_weights` holds (every parameter
    in `compute_dtype`, the model's dtype before `shard_model`)."""
    params = list(model.parameters())
    states = [] if optimizer is None else [v for st in optimizer.state.values() for v in st.values()
                                           if isinstance(v, torch.Tensor)]
    return {"params": _nbytes(params), "grads": _nbytes(p.grad for p in params), "optimizer": _nbytes(states),
            "gathered": sum(p.numel() for p in params) * compute_dtype.itemsize}


def log_memory(ctx: DistContext, model, optimizer=None, *, compute_dtype: torch.dtype) -> dict[str, float]:
    """memory_bytes in MiB as metrics (`memory/params_mib`, ...), max over ranks; rank 0 logs them."""
    return log_bytes(ctx, memory_bytes(model, optimizer, compute_dtype=compute_dtype))


def log_bytes(ctx: DistContext, nbytes: dict[str, int]) -> dict[str, float]:
    """This rank's bytes by kind -> `memory/<kind>_mib` metrics, max over ranks (collective);
    rank 0 logs them."""
    mib = reduce_metrics(ctx, {f"memory/{k}_mib": v / 2**20 for k, v in nbytes.items()}, default="max")
    if ctx.is_main:
        log.info("per-rank memory (max over %d ranks, MiB): %s", ctx.world_size,
                 ", ".join(f"{k.split('/')[1].removesuffix('_mib')} {v:.1f}" for k, v in mib.items()))
    return mib


# ---------------------------------------------------------------------- optimizer
def sharded_adamw(model: torch.nn.Module, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                  weight_decay: float = 0.0, foreach: bool = False) -> torch.optim.AdamW:
    """torch's AdamW on the fp32 shards: moments are DTensors with the params' sharding.
    The single-tensor path (foreach=False): elementwise the same op order as MasterAdamW,
    so equal gradients give bitwise equal updates. foreach=True (distributed.optimizer_foreach):
    the multi-tensor path, a few ops over all shards instead of ~12 DTensor ops per parameter
    (host time); the same elementwise math (bitwise equal on CPU, within one fp32 rounding on
    CUDA: tests/test_distributed_fsdp_settings.py). Set the step's lr with `set_lr`."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                             foreach=foreach, fused=False)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """Global L2 gradient norm over all ranks' shards (a plain replicated tensor); scales
    the gradients by min(1, max_norm / (norm + 1e-6)) when max_norm > 0, like
    rlfuse.run.optim.clip_grad_norm_ in one process."""
    return clip_sharded_grads_([p.grad for p in params if p.grad is not None], max_norm)


def clip_sharded_grads_(grads, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ on the gradient DTensors themselves (`ShardedAdamW.grads()`;
    rlfuse.run.optim.clip_grad_norm_ sends DTensor gradients here)."""
    grads = [g for g in grads if g is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=False)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()  # all-reduce of the per-rank partial sums of squares
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef)
    return norm


class ShardedAdamW:
    """MasterAdamW's interface (`step(lr)`, `zero_grad()`, `grads()`) over `sharded_adamw`,
    so the trainers drive a sharded model unchanged. No gradient hooks: FSDP2 owns the
    fp32 gradient shards (MasterAdamW's hooks must never see FSDP parameters)."""

    def __init__(self, model: torch.nn.Module, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, compute_dtype: torch.dtype, foreach: bool | None = None):
        if foreach is None:  # the run's resolved distributed.optimizer_foreach (configure_fsdp)
            foreach = bool(getattr(getattr(model, "fsdp_settings", None), "optimizer_foreach", False))
        self.params = list(reshard(model).parameters())  # the shards, whatever a forward left gathered
        self.groups = _fsdp_modules(model)
        self.opt = sharded_adamw(model, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach)
        self.compute_dtype = compute_dtype
        """The dtype the gathered weights have (what `log_memory` counts for rollouts)."""

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def step(self, lr: float | None = None) -> None:
        if lr is not None:
            set_lr(self.opt, lr)
        # gathered weights left by a forward or backward (distributed.reshard_after_forward /
        # reshard_after_backward false) would go stale: free them, so the next forward gathers
        # the updated shards (a no-op for groups already resharded, the default)
        for m in self.groups:
            m.reshard()
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)


def is_sharded(model: torch.nn.Module) -> bool:
    """True for a model `shard_model` wrapped (FSDP2)."""
    return isinstance(model, FSDPModule)


def full_copy(model: CausalLM, dtype: torch.dtype) -> CausalLM:
    """A plain, frozen CausalLM holding the full weights of sharded `model` in `dtype` on
    this rank's device (collective: every rank calls it). The masters are exact upcasts
    of the run's dtype until the first step, so a copy taken before training holds the
    starting weights exactly. Costs 2 P bytes per rank in bf16 (the KL reference model)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    device = next(iter(full.values())).device
    with torch.device("meta"):
        ref = CausalLM(model.config).to(dtype)
    ref = ref.to_empty(device=device)
    ref.load_state_dict({k: v.to(dtype) for k, v in full.items()})
    ref.kernels = model.kernels
    return ref.requires_grad_(False).eval()


def reshard(model: torch.nn.Module) -> torch.nn.Module:
    """Free the gathered weights every FSDP2 group of `model` holds, so `model.parameters()`
    are the sharded DTensors again. A forward-only pass (no backward follows: a reference
    or evaluation pass) leaves them gathered under reshard_after_forward false, and the
    gathered tensors are freed at the next reshard: code that keeps the parameter objects
    (the optimizer, the weight-norm watch) must take them after this."""
    for m in _fsdp_modules(model):
        m.reshard()
    return model


# ---------------------------------------------------------------------- the engine's weights
@contextlib.contextmanager
def gathered_weights(model: CausalLM):
    """Inside the block every parameter of `model` is the gathered compute-dtype tensor
    (FSDP2 unshard) and forward calls keep it gathered: the engine (`LLM(model, ...)`, built
    and used inside) runs on these tensors. On exit they are freed (reshard).

    Pointer stability: the gathered Parameter objects are created once and reused, but
    their storage is freed on exit and allocated again at the next entry, so data
    pointers may move. The engine must therefore `sleep()` before the block ends (it drops
    its CUDA graphs and KV pool) and `wake()` inside the next block (graphs are recaptured
    on first use, the prefix cache is dropped). Build the engine inside a block so it reads
    the compute dtype and plans its KV pool with the gathered weights resident."""
    groups = _fsdp_modules(model)
    handles = [m.unshard(async_op=True) for m in groups]
    for h in handles:
        h.wait()
    for m in groups:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        _apply_reshard_policy(model)
        for m in groups:
            m.reshard()


# ---------------------------------------------------------------------- local accumulation (stream mode)
@contextlib.contextmanager
def local_gradients(model: torch.nn.Module):
    """Inside `gathered_weights`: training passes on sharded `model` that are not collectives.
    Gradient sync and reshard-after-backward are off, so a forward finds every group gathered
    (no all-gather), a backward leaves it gathered (the engine still reads those tensors) and
    FSDP2 accumulates this rank's UNSHARDED gradients locally instead of reduce-scattering
    them: 4 bytes per parameter per rank (fp32, the reduce dtype), beside the shards. Each
    rank may then run any number of passes, at any time (grpo.overlap stream: its groups as
    they finish). `reduce_local_gradients` must run on every rank before the block ends;
    on exit reshard-after-backward is set back to distributed.reshard_after_backward and
    gradient sync back on. `distributed.grad_sync: last` is held at `every` inside (its
    `sync_on_last` would turn the sync on at a group's last micro-batch)."""
    settings = getattr(model, "fsdp_settings", None)
    groups = _fsdp_modules(model)
    if settings is not None and settings.grad_sync != "every":
        model.fsdp_settings = dataclasses.replace(settings, grad_sync="every")
    model.set_requires_gradient_sync(False)
    for m in groups:
        m.set_reshard_after_backward(False, recurse=False)
    try:
        yield model
    finally:
        model.set_requires_gradient_sync(True)
        for m in groups:
            m.set_reshard_after_backward(True if settings is None else settings.reshard_after_backward, recurse=False)
        if settings is not None:
            model.fsdp_settings = settings


def reduce_local_gradients(model: CausalLM, zero_pass=None) -> None:
    """Inside `local_gradients`, on every rank (a collective): reduce-scatter the unsharded
    gradients accumulated so far into the sharded `.grad`s the optimizer steps on.

    FSDP2 (public API) reduce-scatters only in a backward with gradient sync on, so this is
    one: sync on, then `zero_pass()`, a forward/backward whose loss has weight 0 (default:
    one token, `loss * 0`; GRPO stream mode passes its own zero-weight micro-batch, which
    also runs a vision tower or MoE router the way a training pass does). It adds nothing:
    every trainable parameter without a gradient first gets a zero one (the ranks must
    reduce-scatter the same parameters: a rank that trained no group, an LM head or a vision
    tower the zero pass does not reach), the backward adds +-0 to each, and x + 0 == x (up
    to the sign of a zero). Groups the backward does not reach reduce at its end too
    (FSDP2's root post-backward callback finishes every group). Sync is off again on return."""
    with torch.no_grad():
        for p in model.parameters():  # the gathered (unsharded) parameters
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    model.set_requires_gradient_sync(True)
    try:
        (zero_pass or (lambda: _one_token_pass(model)))()
    finally:
        model.set_requires_gradient_sync(False)


def _one_token_pass(model: CausalLM) -> None:
    device = model.lm_head_weight.device
    one = torch.zeros(1, dtype=torch.long, device=device)
    h = model(one, one, Packed.from_lengths([1], device))
    (h.sum() * 0.0).backward()
