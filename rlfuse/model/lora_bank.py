"""Several LoRA adapters in one model, each row of a batch running its own (punica / S-LoRA).

    slots = load_adapter_bank(model, {"math": "adapters/math", "code": "adapters/code"})
    with adapter_rows(model, ids_T):        # direct forwards: each row's slot, -1 the base
        h = model(ids, pos, attn)
The engine sets the rows itself from each request's `SamplingParams.adapter` (a slot index);
`rlfuse serve --lora name=PATH ...` maps a request's `model` to a slot.

Rules. The adapters share rank and targets: each adapted projection stacks their A and B
into (n, r, K) and (n, N, r) (`ProjectionBank`), alpha may differ (one scale per slot).
The base weights exist once; a bank adds n (r K + N r) per projection. Fused projections
stay fused, the bank's parts side by side (`rlfuse.model.fuse`). Inference only: a bank
takes no gradients. A row at slot -1 runs the base model with its bits.
Numerics: every row's output depends on its own tokens and slot only
(`rlfuse.kernels.linear.lora`), so in exact numerics a batch mixing adapters gives each
request the bits of its adapter served alone.
Test: python -m pytest -q tests/test_lora_bank.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path

import torch

from rlfuse.model.causal_lm import CausalLM
from rlfuse.model.lora import attach_lora, has_lora, lora_modules
from rlfuse.model.lora_peft import load_peft_weights, read_peft_config

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class AdapterSlots:
    """An adapter bank's names, in slot order, and each row's slot for the next forwards:
    `ids` (at least M,) int32, -1 the base (written by the engine, or `lora_bank.adapter_rows`).
    One object per model, shared by every adapted projection's `ProjectionBank`."""
    names: tuple[str, ...]
    ids: torch.Tensor | None = None


@dataclasses.dataclass(eq=False)
class ProjectionBank:
    """One projection's adapters of a bank (`rlfuse.model.lora_bank`): A (n, r, K), B (n, N, r),
    scale (n,) fp32, and the model's slots. Inference only (no gradients)."""
    A: torch.Tensor
    B: torch.Tensor
    scale: torch.Tensor
    slots: AdapterSlots

    def rows(self, M: int) -> torch.Tensor:
        if self.slots.ids is None or self.slots.ids.shape[0] < M:
            raise ValueError("the model holds an adapter bank: its forwards need each row's adapter "
                             "(the engine sets them per request; else `rlfuse.model.lora_bank.adapter_rows`)")
        return self.slots.ids[:M]


@torch.no_grad()
def load_adapter_bank(model: CausalLM, adapters: dict[str, str | Path]) -> AdapterSlots:
    """Attach one bank holding every PEFT folder of `adapters` (name -> folder, in slot
    order) to the base `model`; returns its slots (the names, in order)."""
    if not adapters:
        raise ValueError("load_adapter_bank: no adapters given")
    if has_lora(model):
        raise ValueError("load_adapter_bank: the model already has LoRA adapters; a bank goes on the base model")
    cfgs = {name: read_peft_config(folder, f"adapter {name!r}") for name, folder in adapters.items()}
    first_name, (first, _) = next(iter(cfgs.items()))
    for name, (cfg, _) in cfgs.items():
        if cfg.rank != first.rank or cfg.target_names != first.target_names:
            raise ValueError(f"adapter {name!r} ({adapters[name]}): rank {cfg.rank}, targets "
                             f"{list(cfg.target_names)}; adapter {first_name!r} has rank {first.rank}, targets "
                             f"{list(first.target_names)}: the adapters of one bank must share rank and targets")
    attach_lora(model, first)
    mods = lora_modules(model)
    stacks: dict[str, tuple[list, list]] = {n: ([], []) for n, _ in mods}
    for name, folder in adapters.items():
        load_peft_weights(model, folder, cfgs[name][1])
        for n, m in mods:
            stacks[n][0].append(m.lora_A.detach().clone())
            stacks[n][1].append(m.lora_B.detach().clone())
    device = model.lm_head_weight.device
    scale = torch.tensor([cfg.scale for cfg, _ in cfgs.values()], dtype=torch.float32, device=device)
    slots = AdapterSlots(tuple(adapters))
    for n, m in mods:
        m.bank = ProjectionBank(torch.stack(stacks[n][0]), torch.stack(stacks[n][1]), scale, slots)
        m.lora_A.requires_grad_(False)
        m.lora_B.requires_grad_(False)
    log.info("LoRA bank: %d adapters (%s), rank %d, on %d projections; each request runs its own",
             len(adapters), ", ".join(adapters), first.rank, len(mods))
    return slots


def adapter_bank(model: torch.nn.Module) -> AdapterSlots | None:
    """The model's bank slots, or None without a bank."""
    mods = lora_modules(model)
    return mods[0][1].bank.slots if mods and mods[0][1].bank is not None else None


@contextlib.contextmanager
def adapter_rows(model: torch.nn.Module, ids: torch.Tensor):
    """The enclosed forwards run row t of their (T, ...) input under slot ids[t] (-1: the base)."""
    slots = adapter_bank(model)
    if slots is None:
        raise ValueError("adapter_rows: the model holds no adapter bank (load_adapter_bank)")
    if ids.dim() != 1 or ids.dtype.is_floating_point or (ids.numel() and int(ids.max()) >= len(slots.names)):
        raise ValueError(f"adapter_rows: ids must be a 1-D integer tensor of slots in [-1, {len(slots.names)}), "
                         f"got {ids.dtype} {tuple(ids.shape)}")
    was = slots.ids
    slots.ids = ids.to(torch.int32)
    try:
        yield model
    finally:
        slots.ids = was
