"""The memory-bandwidth bound of generation (`bound_bytes`) and what it is made of.

Bandwidth bound (an upper limit no schedule can beat): every decode step reads all
weights once (`W` bytes: every parameter, the tied LM head once) and, for each sequence,
the K/V of its context (`kv` bytes/token = 2 * L * Hkv * Dh * 2, L = the layers keeping
K/V: every layer of a dense model, the full-attention ones of a hybrid), and on a hybrid
reads and writes each linear-attention layer's recurrent state once (`st` bytes a sequence
and step = 2 * sum over those layers of (Hv Dk Dv * 4 + conv channels (W-1) * 2): the
state a one-token recurrence must move; the engine's exact-contract step also reads the
tail of < 64 buffered tokens, not counted). With all sequences in one batch, sequence i
(prompt P_i, O_i outputs, the first from prefill) costs decode steps j = 1 .. O_i - 1
reading P_i + j tokens; the batch takes max_i O_i - 1 steps:
    bytes = (max_i O_i - 1) * W + kv * sum_i [(O_i - 1) P_i + O_i (O_i - 1) / 2]
            + st * sum_i (O_i - 1)
    bound = sum_i O_i / (bytes / BW),  BW = device-to-device copy (read + write bytes / s)
measured in the same run. Prefill time is not in the bound, so % of bound is conservative.
On an MoE shape `W` counts the routed experts a step touches, not all of them (`bound_bytes`:
uniform routing, b running sequences touch 1 - (1 - k/E)^b of a layer's E experts; at
30B-A3B's E = 128, k = 8 that is 98% at b = 64: the bound matters at small batches).
Test: python -m pytest -q tests/test_engine_bench.py
"""

from __future__ import annotations

import time

import torch

from rlfuse.engine.benchmark.cases import Case
from rlfuse.engine.cache import linear_layers
from rlfuse.model import CausalLM


def bound_bytes(case: Case, weight_bytes: int, kv_per_token: int, state_per_step: int = 0,
                experts: tuple[int, int, int] | None = None) -> int:
    """experts: (bytes of the routed experts' weights, E, top-k) of an MoE model. A step then
    reads the dense weights and the experts its running sequences touch; under uniform
    routing a layer's expert is touched by one of b tokens with probability 1 - (1 - k/E)^b
    (an estimate: trained routers are skewed, which touches fewer)."""
    steps, kv, seq_steps, ends = 0, 0, 0, []
    for prompt, p in zip(case.prompts, case.params):
        P, O = len(prompt), p.max_tokens
        steps = max(steps, O - 1)
        kv += p.n * ((O - 1) * P + O * (O - 1) // 2)
        seq_steps += p.n * (O - 1)
        ends += [O - 1] * p.n
    if experts is None:
        return steps * weight_bytes + kv * kv_per_token + seq_steps * state_per_step
    eb, E, k = experts
    ends.sort()
    w, i = 0.0, 0
    for step in range(steps):  # a sequence with O - 1 decode steps runs in steps 0 .. O - 2
        while i < len(ends) and ends[i] <= step:
            i += 1
        w += weight_bytes - eb + eb * (1 - (1 - k / E) ** (len(ends) - i))
    return round(w) + kv * kv_per_token + seq_steps * state_per_step


def routed_expert_bytes(model: CausalLM) -> tuple[int, int, int] | None:
    """(bytes of every MoE layer's routed experts, E, top-k), or None for a dense model. The
    shared experts and routers are dense: read every step."""
    moe = getattr(model.config, "moe", None)
    if moe is None:
        return None
    eb = sum(t.numel() * t.element_size() for n, t in model.named_parameters()
             if ".experts." in f".{n}." and "shared_expert" not in n)
    return (eb, moe.num_experts, moe.num_experts_per_tok) if eb else None


def state_bytes_per_step(model: CausalLM) -> int:
    """Bytes of linear-attention state one sequence's decode step must read and write (the
    module docstring's `st`; 0 for a dense model)."""
    itemsize = model.lm_head_weight.element_size()
    one = sum(m.n_v * m.dk * m.dv * 4 + m.conv_dim * (m.width - 1) * itemsize for _, m in linear_layers(model))
    return 2 * one


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting read + write."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    reps = 20
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    _sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
