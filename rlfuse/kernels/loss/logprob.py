"""Per-token log-probabilities straight from hidden states and the LM head.

    z_i      = (h_i . W^T) * (1 / T_i)          fp32 logits, never materialized as (N, V)
    lse_i    = logsumexp_v z_iv
    logp_i   = z_i[y_i] - lse_i
    ent_i    = lse_i - sum_v p_iv z_iv           (p = softmax(z), entropy)

Contract: hidden (N, D), weight (V, D) (rows at any stride; a non-unit stride along D
costs one copy), targets (N,) int in [0, V) (not checked: a sync; outside, logp = -lse);
temperature a Python float or an (N,) tensor of per-row temperatures, all > 0 (a tensor is
not checked: that would be a host sync). The temperature is an fp32 number: every path
multiplies the fp32 logits by inv_T = fp32(1 / fp32(T)) (`_inv_temperature`), the
reference included, so engine (per-row tensor) and trainer (float) agree bitwise on
inv_T. Outputs fp32 (N,) log-probs (and entropy). Differentiable w.r.t. hidden and weight.
This is THE log-prob of rlfuse: the engine reports rollout log-probs with it and the
trainer optimizes it.

Triton path (hidden and weight of one dtype: fp32, bf16 or fp16; tl.dot with fp32
accumulation, input_precision "ieee" for fp32 inputs so fp32 is not silently TF32 (that
runs on CUDA cores: fp32 is the test dtype, bf16 the fast one); under the CPU
interpreter the operands go to fp32 first, see `_dot`):
  forward  the vocab is cut into fine splits of `split_v` columns; `group` consecutive
           splits form a group. A program takes BLOCK_N rows and FOLD splits (FOLD = 1
           for small N, to fill the GPU; FOLD = group for large N), streams their
           BLOCK_V-column tiles of W (D loop of tl.dot) with an online (max, sum exp, sum
           exp*z) per split, target logit by compare-and-sum, folds each split into the
           program state with `_merge` and writes (N, P) partials; `_logprob_fold_kernel` folds
           them group by group (fold = 1 only) and then the groups, left to right.
           merge(identity, x) == x exactly, so both FOLDs give bitwise the same rows:
           batch-invariant (a row never meets another row's numbers; tiles depend on
           V, D and dtype only, never on N; FOLD, chosen from N and the SM count, changes
           the grid, not the numbers). Extra memory: 4 floats x (N, P). No host sync:
           CUDA-graph capturable (the engine's per-step call, no autograd).
  backward with the saved lse and entropy, over vocab slices of Vc columns (outer) and
           row chunks of C (inner), C x Vc x dtype <= `_DZ_SCRATCH_BYTES` (shapes only):
           `_logprob_dz_kernel` recomputes the logits tile by tile and writes
               dz_iv = [g_i (1[v = y_i] - p_iv) + ge_i p_iv (lse_i - ent_i - z_iv)] / T_i
           (ge: entropy grad; d ent / d z_v = p_v (E_p z - z_v), E_p z = lse - ent) to a
           (C, Vc) scratch in the input dtype; then dW[slice] += dz^T @ H[chunk] into an
           fp32 (Vc, D) buffer, rounded once into dW when the slice is done, and
           dH[chunk] += dz @ W[slice] into an fp32 (N, D) buffer (cuBLAS, fp32 output
           accumulating in place, `_mm_fp32`). No atomics: deterministic run to run.
           Extra memory beyond dH and dW: dz (64 MiB), fp32 (Vc, D) and fp32 (N, D); no
           fp32 copy of the head. dz in bf16 costs ~2^-9 relative per element in dH / dW.
Tests: `python -m pytest -q tests/test_kernel_logprob.py`; GPU: `python -m pytest -m gpu tests`.
"""

from __future__ import annotations

import torch

from rlfuse.kernels.backend import is_exact, resolve_backend, triton_ops
from rlfuse.kernels.invariant import pairwise_sum, pointwise
from rlfuse.kernels.linear.gemm import linear_exact


def _inv_temperature(temperature, N: int, device) -> torch.Tensor:
    """fp32 inv_T: a 0-d CPU tensor for a float, (N,) on `device` for a tensor."""
    if isinstance(temperature, torch.Tensor):
        if temperature.shape != (N,):
            raise ValueError(f"token_logprobs: temperature tensor shape {tuple(temperature.shape)} != ({N},)")
        return temperature.to(device=device, dtype=torch.float32).reciprocal()
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    return torch.tensor(temperature, dtype=torch.float32).reciprocal()


def token_logprobs_ref(hidden, weight, targets, temperature=1.0, return_entropy: bool = False):
    ct = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    inv_t = _inv_temperature(temperature, hidden.shape[0], hidden.device).to(hidden.device, ct)
    logits = (hidden.to(ct) @ weight.to(ct).t()) * (inv_t[:, None] if inv_t.ndim else inv_t)  # (N, V)
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(1, targets.long()[:, None]).squeeze(1) - lse
    if not return_entropy:
        return logp
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def token_logprobs_exact_ref(hidden, weight, targets, temperature=1.0, return_entropy: bool = False):
    """Exact numerics on the torch backend: the logits from the batch-invariant linear,
    then max, exp, sum and log through `rlfuse.kernels.invariant`, so a row's log-prob
    depends on that row alone. (The Triton path is batch-invariant by its tiling.)"""
    ct = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    inv_t = _inv_temperature(temperature, hidden.shape[0], hidden.device).to(hidden.device, ct)
    logits = linear_exact(hidden.to(ct), weight.to(ct)) * (inv_t[:, None] if inv_t.ndim else inv_t)  # (N, V)
    m = logits.detach().max(-1, keepdim=True).values
    e = pointwise(torch.exp, logits - m)
    z = pairwise_sum(e, -1)
    lse = m[:, 0] + pointwise(torch.log, z)
    logp = logits.gather(1, targets.long()[:, None]).squeeze(1) - lse
    if not return_entropy:
        return logp
    return logp, lse - pairwise_sum(e / z[:, None] * logits, -1)


def token_logprobs(hidden, weight, targets, temperature=1.0, return_entropy: bool = False):
    """Public op: logp (N,) fp32 (and entropy (N,) fp32); see the module docstring."""
    inv_t = _inv_temperature(temperature, hidden.shape[0], hidden.device)
    if resolve_backend("token_logprobs", hidden) != "triton":
        ref = token_logprobs_exact_ref if is_exact() else token_logprobs_ref
        return ref(hidden, weight, targets, temperature, return_entropy)
    return triton_ops("loss.triton_logprob").token_logprobs(hidden, weight, targets, inv_t, return_entropy)
