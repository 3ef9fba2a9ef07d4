"""Calibrating an fp8 KV cache's scales (`EngineConfig.kv_cache_dtype: fp8_e4m3`).

Rule (`rlfuse.kernels.kv_quant.fp8`, docs/numerics.md "FP8 KV cache"): one power-of-two
scale per layer, K or V, and KV head, from the largest |K| (after q/k norm and RoPE, the
values the cache stores) and |V| of a packed forward over the rollout's distinct prompts,
times a margin of 2, mapped to at most e4m3's 448. The engine calibrates before the first request
after the weights changed (and at its first request), before any K/V of the new weights
is cached: the scales then stay fixed for the whole rollout phase, so every cached block,
prefix-cache hits included, holds K/V quantized with the current scales (the prefix
cache is dropped with the same weight change). The scales are rewritten in place: CUDA
graphs keep reading the same tensors.
Cost: one packed forward over at most `CALIBRATION_TOKENS` prompt tokens (distinct prompts,
in order, in micro-batches of max_num_batched_tokens), once per weight update.
Test: `python -m pytest -q tests/test_engine_kv_fp8.py`.
"""

from __future__ import annotations

import logging
import time

import torch

from rlfuse.kernels.kv_quant import KVQuant
from rlfuse.model import CausalLM, Packed, pack_by_tokens

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 16384  # prompt tokens a calibration reads at most: a GRPO batch's prompts, a bounded cost


def calibration_prompts(prompts: list[list[int]], max_tokens: int = CALIBRATION_TOKENS) -> list[list[int]]:
    """The distinct prompts, in order, until `max_tokens` tokens (the last one cut to fit)."""
    seen, out, n = set(), [], 0
    for p in prompts:
        key = tuple(p)
        if not p or key in seen or n >= max_tokens:
            continue
        seen.add(key)
        out.append(list(p[:max_tokens - n]))
        n += len(out[-1])
    return out


@torch.no_grad()
def calibrate_kv_scales(model: CausalLM, kvq: KVQuant, prompts: list[list[int]], batch_tokens: int) -> dict:
    """Set `kvq`'s scales (in place) from a packed forward of `prompts` through `model`
    (which must hold `kvq` as `model.kv_quant`); returns a summary (also logged)."""
    if model.kv_quant is not kvq:
        raise RuntimeError("calibrate_kv_scales: the model does not hold this KVQuant (model.kv_quant)")
    t0 = time.perf_counter()
    chosen = calibration_prompts(prompts)
    dev = model.lm_head_weight.device
    kvq.start_calibration()
    try:
        for pack in pack_by_tokens([len(p) for p in chosen], batch_tokens):
            ids = torch.tensor([t for i in pack for t in chosen[i]], dtype=torch.long).to(dev)
            pos = torch.cat([torch.arange(len(chosen[i])) for i in pack]).to(dev)
            model(ids, pos, Packed.from_lengths([len(chosen[i]) for i in pack], dev))
    finally:
        amax = kvq.finish_calibration()
    e = torch.log2(kvq.scale).flatten().tolist()  # host sync: once per weight update
    a = amax.amax(dim=(0, 2)).tolist()
    summary = {"tokens": sum(len(p) for p in chosen), "prompts": len(chosen), "amax_k": a[0], "amax_v": a[1],
               "scale_exp_min": int(min(e)), "scale_exp_max": int(max(e)), "seconds": time.perf_counter() - t0}
    log.info("fp8 KV scales calibrated on %d tokens of %d prompts in %.2f s: max |K| %.3g, max |V| %.3g, scales "
             "2^%d..2^%d", summary["tokens"], summary["prompts"], summary["seconds"], a[0], a[1],
             summary["scale_exp_min"], summary["scale_exp_max"])
    return summary
