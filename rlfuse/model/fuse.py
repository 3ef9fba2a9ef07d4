"""Fused projections: q/k/v of each attention layer as one GEMM, gate/up of each MLP as one,
a hybrid's linear-attention input projections as one.

    fuse_projections(model)   # in place; `LLM(model, ...)` calls it (EngineConfig.fuse_projections)

A decode step is a few dozen rows against every weight matrix, so each projection's GEMM
is a weight read plus a launch and a tile grid of its own. q, k and v read the same input
(the attention's normed hidden state), as do gate and up (the MLP's) and a Gated DeltaNet's
input projections (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; Qwen3-Next:
in_proj_qkvz, in_proj_ba): one GEMM each, with N = (Hq + 2 Hkv) Dh, N = 2 I and
N = 2 Hk Dk + 2 Hv Dv + 2 Hv, reads the input once, launches once and fills more SMs (the
b and a projections alone, N = Hv, are a few columns: a launch and a weight pass each).

Storage. Per group one contiguous buffer (rows of q, then k, then v; gate, then up; qkv,
z, b, a or qkvz, ba; the biases likewise), and each projection's Parameter re-pointed at
its rows (`p.data = buffer[rows]`). The Parameter objects stay, so do their names (`q_proj.weight`: the
state dict and HF checkpoints are unchanged), the optimizer's references and its
in-place updates, which the fused GEMM then reads with no copy. Saving copies each view
out (safetensors refuses tensors that share storage; `rlfuse.model.weights`).

Rules.
  * Fusing moves the parameters' storage once: do it before anything records their
    pointers (CUDA graphs; the engine fuses in its constructor, before any capture).
    Fusing a fused model again changes nothing.
  * FSDP-sharded models: not by `fuse_projections` (FSDP owns the parameter storage), but
    on the gathered weights while the engine runs (`fuse_gathered`, called by
    rlfuse.run.distributed.GatheredSampler at each wake): each group's gathered tensors
    are moved into one buffer and their own storage (FSDP's all-gather output) freed, so
    the fused buffers replace the gathered weights instead of adding to them (peak: one
    group more); `unfuse_gathered` points the parameters back before FSDP frees them,
    and FSDP allocates and fills its storage again at the next gather. Training forwards
    (FSDP's per-layer gathers) join each group's gathered parts at call time
    (`rlfuse.model.fuse_sharded`, set by `fuse_sharded`): `fuse_gathered` replaces that
    group while the engine runs and `unfuse_gathered` puts it back.
  * LoRA (`rlfuse.model.lora`): a group whose projections all carry adapters of one rank
    and scale stays fused (the four linear-attention projections too: `lora_linear` takes
    up to 4 parts), its A's and B's in two more buffers (A (P r, K): q's rows, then k's,
    then v's; B (N, r) in the output's rows), and runs as ONE `lora_linear` over the
    parts: the shrink of every part is one GEMM, the expand sits in the base GEMM's
    epilogue (`rlfuse.kernels.linear.lora`). An adapter bank (serving several adapters)
    likewise. `attach_lora` on a fused model drops the groups it adapts; the engine
    (`fuse_projections`) fuses them again with their adapters. A forward with the group's
    adapters switched differently, or drawing dropout, runs the projections separately.
  * Not fused: a group partly adapted (e.g. lora.targets [q_proj, v_proj], or
    [in_proj_qkv] alone), adapters of different rank or scale, parameters on the meta device or of mixed device or dtype.
    Each skip is logged with its reason.
  * A group checks at every forward that its modules are still the layer's and each
    weight still lies at its rows (host-side pointer compares, no sync). After anything
    that moves or replaces them (`.to()`, `float()`, `attach_lora`, sharding) the layer
    runs its separate projections again, with a warning (once per process): slower, never
    wrong.

Numerics. Exact: an element's K order depends on K alone (`rlfuse.kernels.linear.gemm`), so
each slice of the fused output equals the separate projection bitwise and rollout
log-probs still equal the trainer's (which runs the same fused forward). Fast: cuBLAS
picks its algorithm from N too, so the bits may move within bf16 rounding.
Gradients (`rlfuse.kernels.linear.gemm.linear_fused`): each part gets its rows of dW and db;
dx is one GEMM over the fused N, equal to the separate sum up to rounding.
Test: python -m pytest -q tests/test_fuse.py tests/test_fuse_hybrid.py
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rlfuse.kernels.linear.gemm import linear_fused
from rlfuse.kernels.linear.lora import lora_linear
from rlfuse.model.causal_lm import CausalLM
from rlfuse.model.layers import MLP, Attention, FusedGatedDeltaNet, GatedDeltaNet, Linear
from rlfuse.model.lora import LoRALinear

log = logging.getLogger(__name__)

# (module type, attribute that holds the group, projections in buffer order); a module holds
# the groups of its type whose projections it has (`groups_of`): Qwen3-Next's
# FusedGatedDeltaNet is a GatedDeltaNet whose four projections gave way to two
GROUPS = ((Attention, "qkv_fused", ("q_proj", "k_proj", "v_proj")),
          (MLP, "gate_up_fused", ("gate_proj", "up_proj")),
          (GatedDeltaNet, "in_proj_fused", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
          (FusedGatedDeltaNet, "in_proj_fused", ("in_proj_qkvz", "in_proj_ba")))


def groups_of(module: nn.Module):
    """(attribute, projection names) of each GROUPS entry that `module` holds."""
    for kind, attr, names in GROUPS:
        if isinstance(module, kind) and all(isinstance(getattr(module, n, None), nn.Module) for n in names):
            yield attr, names


def _join(tensors, dim: int = 0):
    """One buffer holding `tensors` side by side along `dim`; each tensor's .data becomes its view."""
    with torch.no_grad():
        buf = torch.cat([t.detach() for t in tensors], dim)
        for t, v in zip(tensors, buf.split([t.shape[dim] for t in tensors], dim)):
            t.data = v
    return buf


class FusedLinear:
    """Projections of one input as one GEMM over a buffer their parameters are views of.
    `sizes`: each projection's output features, in order (split the output with them).
    LoRA-adapted projections (all of the group, one rank and scale) keep their adapters in
    two more buffers, A (P r, K) and B (N, r), and run as one `lora_linear` over the parts."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]):
        self.names = names
        self.mods = tuple(getattr(owner, n) for n in names)
        self.sizes = [m.out_features for m in self.mods]
        self.adapted = type(self.mods[0]) is LoRALinear
        N, has_bias = sum(self.sizes), self.mods[0].bias is not None
        if not self.adapted:
            self.weight = _join([m.weight for m in self.mods])  # (sum N_i, K)
            self.bias = _join([m.bias for m in self.mods]) if has_bias else None
        else:
            # one buffer: W's rows, then A's (P r, K), so a fast forward's shrink is part of
            # the base GEMM (`lora_linear(joined=...)`); the bias beside P r zeros
            wa = _join([m.weight for m in self.mods] + [m.lora_A for m in self.mods])
            self.weight, self.lora_a = wa[:N], wa[N:]
            ba = None
            if has_bias:
                zeros = self.mods[0].bias.new_zeros(wa.shape[0] - N)
                ba = _join([m.bias for m in self.mods] + [zeros])
            self.bias = None if ba is None else ba[:N]
            self.joined = (wa, ba)
            self.lora_b = _join([m.lora_B for m in self.mods])  # (sum N_i, r)
            self.scale, self._bank = self.mods[0].scale, None
            if self.mods[0].bank is not None:
                self._bank_buffers()  # now, eagerly: never first inside a CUDA graph capture
        # where each tensor must stay: the buffer never moves, so neither may the parts
        self._ptrs = [t.data_ptr() for t in self._tensors()]
        self.stale = False

    def _tensors(self):
        names = ("weight", "bias") + (LoRALinear.adapter_params if self.adapted else ())
        return [t for m in self.mods for t in (getattr(m, n) for n in names) if t is not None]

    def live(self, owner: nn.Module) -> bool:
        """Whether this forward runs the group fused: the owner's projections are still these
        modules and their tensors still lie in the buffers (else the group goes stale for
        good, with a warning, once per process), and, adapted, their adapters are all on or
        all off and draw no dropout (else the projections run separately this time)."""
        if self.stale:
            return False
        ok = all(getattr(owner, n) is m for n, m in zip(self.names, self.mods)) and all(
            t.data_ptr() == p for t, p in zip(self._tensors(), self._ptrs))
        if not ok:
            self.stale = True
            _warn_stale(self, owner)
            return False
        if self.adapted:
            on = {m.enabled for m in self.mods}
            drop = any(m.dropout > 0 and m.training for m in self.mods) and torch.is_grad_enabled()
            banks = {m.bank is None for m in self.mods}
            return len(on) == 1 and len(banks) == 1 and not (drop and True in on)
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., sum N_i): the projections' outputs side by side."""
        parts = (tuple(m.weight for m in self.mods), None if self.bias is None else tuple(m.bias for m in self.mods))
        if not self.adapted or not self.mods[0].enabled:
            return linear_fused(x, self.weight, self.bias, *parts)
        if self.mods[0].bank is not None:
            A, B, scale = self._bank_buffers()
            rows = self.mods[0].bank.rows(x.numel() // x.shape[-1])
            return lora_linear(x, self.weight, self.bias, A, B, scale, sizes=self.sizes, adapter=rows)
        # a training forward: the parts joined by torch.cat, so autograd hands each part its
        # gradient (same values, same bits); a no-grad one reads the buffers
        grad = torch.is_grad_enabled()
        join = lambda buf, ts: torch.cat(ts) if grad and any(t.requires_grad for t in ts) else buf  # noqa: E731
        w = join(self.weight, parts[0])
        b = None if self.bias is None else join(self.bias, parts[1])
        a = join(self.lora_a, [m.lora_A for m in self.mods])
        bb = join(self.lora_b, [m.lora_B for m in self.mods])
        return lora_linear(x, w, b, a, bb, self.scale, sizes=self.sizes, joined=self.joined)

    def _bank_buffers(self):
        """The members' banks side by side, (n, P r, K), (n, N, r), scale: built once per bank."""
        banks = tuple(m.bank for m in self.mods)
        if self._bank is None or self._bank[0] != tuple(map(id, banks)):
            A = torch.cat([bk.A for bk in banks], 1)
            B = torch.cat([bk.B for bk in banks], 1)
            self._bank = (tuple(map(id, banks)), A, B, banks[0].scale)
        return self._bank[1:]


_stale_warned = [False]


def _warn_stale(group: FusedLinear, owner: nn.Module) -> None:
    """The first stale group of the process warns; later ones (every layer's) only debug-log."""
    how = log.debug if _stale_warned[0] else log.warning
    _stale_warned[0] = True
    how("fused %s of %s no longer covers its parameters (moved, replaced or wrapped after fusing): running them "
        "as separate GEMMs (said once; `fuse_projections(model)` fuses them again)", "/".join(group.names),
        type(owner).__name__)


def _skip_reason(model: nn.Module) -> str | None:
    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
        return "the model is FSDP-sharded (FSDP owns the parameter storage)"
    params = list(model.parameters())
    if any(isinstance(p, DTensor) for p in params):
        return "the parameters are DTensors"
    if any(p.device.type == "meta" for p in params):
        return "the parameters are on the meta device"
    return None


def is_fused(model: nn.Module) -> bool:
    """Whether any projection group of `model` runs fused now."""
    return any(getattr(m, attr) is not None and getattr(m, attr).live(m)
               for m in model.modules() for attr, _ in groups_of(m))


def fuse_projections(model: CausalLM) -> int:
    """Fuse q/k/v, gate/up and the linear-attention input projections of every decoder
    layer of `model` in place (module docstring).
    Returns the number of groups fused by this call; logs what was fused or skipped, and why."""
    reason = _skip_reason(model)
    if reason is not None:
        if is_fused(model):  # FSDP's gathered weights, fused by fuse_gathered
            log.info("fused projections: on the FSDP-gathered weights (fused at each gather)")
        else:
            log.info("projections not fused: %s", reason)
        return 0
    fused, already, adapted, n_lora = 0, 0, [], 0
    for layer_name, module in model.named_modules():
        for attr, names in groups_of(module):
            group = getattr(module, attr)
            if group is not None and group.live(module):
                already += 1
                continue
            mods = [getattr(module, n) for n in names]
            lora = all(type(m) is LoRALinear for m in mods)
            if not lora and any(type(m) is not Linear for m in mods):
                adapted.append(f"{layer_name}.{'/'.join(names)} (some adapted, some not)")
                continue
            if lora and (len({(m.lora_A.shape[0], m.scale, m.dropout) for m in mods}) != 1
                         or len({m.bank is None for m in mods}) != 1):
                adapted.append(f"{layer_name}.{'/'.join(names)} (adapters of different rank, scale or dropout)")
                continue
            n_lora += lora
            ps = [p for m in mods for p in m.parameters()]
            if len({(p.device, p.dtype) for p in ps}) != 1 or len({m.in_features for m in mods}) != 1 \
                    or len({m.bias is None for m in mods}) != 1:
                adapted.append(f"{layer_name}.{'/'.join(names)} (mixed device, dtype, input size or bias)")
                continue
            setattr(module, attr, FusedLinear(module, names))
            fused += 1
    grouped = {id(m) for module in model.modules() for attr, _ in groups_of(module)
               if getattr(module, attr) is not None for m in getattr(module, attr).mods}
    for m in model.modules():  # o_proj, down_proj: the shrink joins the base GEMM all the same
        if type(m) is LoRALinear and id(m) not in grouped and m.bank is None and not m.is_joined():
            m.join_()  # once: a second engine on the model must not move what the first one's graphs read
    if adapted:
        log.info("projections not fused in %d groups (each keeps its own GEMM): %s%s", len(adapted),
                 ", ".join(adapted[:3]), " ..." if len(adapted) > 3 else "")
    if fused:
        log.info("fused projections: %d groups (q/k/v, gate/up and linear attention's in_proj, one GEMM each; "
                 "%d with their LoRA adapters in the same op)%s", fused, n_lora, f"; {already} already fused" if already else "")
    return fused


def group_params(module: nn.Module, names: tuple[str, ...]) -> list | None:
    """The parameters of `module`'s projections `names` if they can run as one GEMM: plain
    `Linear`s of one device and dtype, one input size, all with or all without bias; else None."""
    mods = [getattr(module, n) for n in names]
    if any(type(m) is not Linear for m in mods):
        return None
    ps = [p for m in mods for p in m.parameters()]
    ok = (len({(p.device, p.dtype) for p in ps}) == 1 and len({m.in_features for m in mods}) == 1
          and len({m.bias is None for m in mods}) == 1)
    return ps if ok else None


def _fusable(module: nn.Module, names: tuple[str, ...]) -> bool:
    ps = group_params(module, names)
    return ps is not None and not any(isinstance(p, DTensor) for p in ps)


def fuse_gathered(model: CausalLM) -> list:
    """Fuse every group of an FSDP-sharded `model` whose parameters are gathered now
    (inside `gathered_weights`), moving the gathered tensors into the fused buffers and
    freeing their own storage (module docstring). Returns what `unfuse_gathered` needs;
    groups that are not plain Linear are skipped (logged by the engine's fuse call)."""
    restore = []
    for module in model.modules():
        for attr, names in groups_of(module):
            if not _fusable(module, names):
                continue
            params = [t for n in names for t in (getattr(module, n).weight, getattr(module, n).bias) if t is not None]
            prev = getattr(module, attr)  # a training forward's JoinedLinear (rlfuse.model.fuse_sharded), or None
            own = [p.data for p in params]  # views of FSDP's all-gather outputs
            setattr(module, attr, FusedLinear(module, names))  # copies into the buffer, re-points .data
            for t in own:
                t.untyped_storage().resize_(0)  # the buffer replaces them; FSDP re-allocates at the next gather
            restore.append((module, attr, prev, list(zip(params, own))))
    return restore


def unfuse_gathered(restore: list) -> None:
    """Undo `fuse_gathered` before FSDP reshards: the parameters point at FSDP's (freed)
    storage again, the fused buffers go and each group attribute gets back what it held."""
    for module, attr, prev, pairs in restore:
        for p, own in pairs:
            p.data = own
        setattr(module, attr, prev)
