"""Fused projections in the training forward of an FSDP2-sharded model: each group's parts
joined at call time.

    fuse_sharded(model)   # after fully_shard; rlfuse.run.distributed.configure_fsdp(fuse=True) calls it

A one-process model fuses by moving its parameters into one buffer (`rlfuse.model.fuse`);
an FSDP2-sharded one cannot (FSDP owns each parameter's storage, and re-allocates it at
every gather). Its engine fuses the gathered weights while it decodes (`fuse_gathered`);
its training forward, one FSDP gather per layer, ran q/k/v, gate/up and a hybrid's
linear-attention input projections separately: three and two GEMMs forward, twice that
backward, each a launch (the 4-H200 train phase is host-bound: docs/benchmarks.md).

`JoinedLinear` is a group with FusedLinear's interface whose `__call__` joins the parts it
finds on the modules (`rlfuse.kernels.linear.gemm.linear_fused_parts`): one GEMM forward,
one dx and one dW GEMM backward, gradients to each part's own tensor (FSDP's unsharded
parameter, which it reduce-scatters as before). The joined weight is a transient copy, made
in forward and again in backward, never kept between them: the parts are what is saved
(FSDP keeps them gathered for backward or gathers them again), so training holds no second
copy of the projection weights.

`live(owner)`: the owner's projections are still these modules and every part's weight and
bias is a plain tensor (not a DTensor) of one device and dtype, i.e. FSDP has gathered
them: its pre-forward hook sets the unsharded tensors on the modules, its reshard sets the
DTensor shards back. Outside a forward (sharded) the group is not live, and that is no
fault: it never goes stale, since sharded and gathered states alternate all run long.

Numerics: the same math as `linear_fused` over a buffer holding the same rows, so in exact
numerics the forward's bits equal a one-process fused model's (and the separate
projections'); the gradients are those of the one-process fused model (dx: one GEMM over
the fused N).
Test: python -m pytest -q tests/test_fuse.py -k joined tests/test_distributed_fuse.py
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rlfuse.kernels.linear.gemm import linear_fused_parts
from rlfuse.model.fuse import group_params, groups_of

log = logging.getLogger(__name__)


class JoinedLinear:
    """Plain `Linear` projections of one input (no LoRA: LoRA models are replicated, not
    sharded) run as one GEMM over their current weights joined at call time.
    `sizes`: each projection's output features, in order (split the output with them)."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]):
        self.names = names
        self.mods = tuple(getattr(owner, n) for n in names)
        self.sizes = [m.out_features for m in self.mods]
        self.has_bias = self.mods[0].bias is not None

    def live(self, owner: nn.Module) -> bool:
        """Whether this forward runs the group joined: same modules, parts gathered (plain
        tensors of one device and dtype). Host-side checks only."""
        if any(getattr(owner, n) is not m for n, m in zip(self.names, self.mods)):
            return False
        ts = [t for m in self.mods for t in (m.weight, m.bias) if t is not None]
        return not any(isinstance(t, DTensor) for t in ts) and len({(t.device, t.dtype) for t in ts}) == 1

    def __call__(self, x):
        """x (..., K) -> (..., sum N_i): the projections' outputs side by side."""
        biases = tuple(m.bias for m in self.mods) if self.has_bias else None
        return linear_fused_parts(x, tuple(m.weight for m in self.mods), biases)


def _joinable(module: nn.Module, names: tuple[str, ...]) -> bool:
    """`rlfuse.model.fuse.group_params`' rules, for parameters that are FSDP's DTensor shards."""
    ps = group_params(module, names)
    return ps is not None and all(isinstance(p, DTensor) for p in ps)


def fuse_sharded(model: nn.Module) -> int:
    """Put a `JoinedLinear` on every fusable group of FSDP2-sharded `model` (module
    docstring). Returns the number of groups it set by this call; logs it once."""
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        log.info("fuse_sharded: the model is not FSDP-sharded; nothing joined")
        return 0
    joined, already, skipped = 0, 0, []
    for name, module in model.named_modules():
        for attr, names in groups_of(module):
            if isinstance(getattr(module, attr), JoinedLinear):
                already += 1
            elif _joinable(module, names):
                setattr(module, attr, JoinedLinear(module, names))
                joined += 1
            else:
                skipped.append(f"{name}.{'/'.join(names)}")
    log.info("fused projections in sharded training forwards: %d groups joined at each FSDP gather (one GEMM "
             "each)%s%s", joined, f", {already} already" if already else "",
             f"; not joined (not plain Linear, or mixed device, dtype, input size or bias): {', '.join(skipped[:3])}"
             f"{' ...' if len(skipped) > 3 else ''}" if skipped else "")
    return joined
