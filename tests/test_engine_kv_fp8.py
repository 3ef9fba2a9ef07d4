"""The engine with an fp8 KV cache (`EngineConfig.kv_cache_dtype: fp8_e4m3`).

Exact numerics stay bitwise (engine rollout log-probs == the trainer's, which reads K/V
fake-quantized with the engine's scales), and the comparison can fail: a trainer that
reads unquantized K/V differs. The scales are calibrated on the prompts once per weight
update, in place, and follow the weights; a cache in the model's dtype leaves the model
without scales; the pool holds twice the tokens in the same bytes. The `rlfuse check` row
("fp8 KV cache") runs in tests/test_exact_engine.py's sweeps.
Run: python -m pytest -q tests/test_engine_kv_fp8.py   (Triton under the interpreter: -m slow)
"""

import pytest
import torch
from engine_helpers import (
    one_thread,  # noqa: F401 (fixture)
    random_prompts,
    tiny_model,
)

from rlfuse.consistency.check import Setting, run_setting, trainer_logprobs
from rlfuse.engine import LLM, EngineConfig, SamplingParams
from rlfuse.engine.cache import plan_num_blocks
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.kv_quant import FP8_DTYPE, scales_from_amax

FP8 = dict(kv_cache_dtype="fp8_e4m3")
PROMPT_LENS = [14, 30, 33, 7]


def test_exact_fp8_rollout_equals_trainer_and_the_check_can_fail(dtype=torch.bfloat16):
    """(bf16; the check's sweep runs fp32 and bf16 in tests/test_exact_engine.py.) Shared prompts (prefix-cache hits on fp8 blocks), chunked prefill reading cached fp8
    blocks, and forced preemption with recompute: bitwise. The same tokens scored by a
    trainer without the fake quant differ."""
    model = tiny_model(dtype=dtype)
    prompts = random_prompts(PROMPT_LENS)
    s = Setting(name="fp8", num_prompts=3, n=2, engine=dict(**FP8, max_num_batched_tokens=16, num_kv_blocks=6))
    with use_backend("torch"):
        r = run_setting(model, prompts, s, numerics="exact", max_tokens=8, temperature=1.0)
        assert r.bitwise_frac == 1.0 and r.max_abs == 0.0, (r.row(), r.first_diff)
        st = r.engine_stats
        assert st["kv_calibrations"] == 1 and st["prompt_tokens_cached"] > 0 and st["preemptions"] > 0, st
        kvq, model.kv_quant = model.kv_quant, None  # the trainer reading bf16/fp32 K/V instead
        with use_numerics("exact"):
            plain = torch.cat(trainer_logprobs(model, r.sequences, 1.0))
        model.kv_quant = kvq
        with use_numerics("exact"):
            again = torch.cat(trainer_logprobs(model, r.sequences, 1.0))
    assert not torch.equal(plain, again)
    assert (plain - again).abs().max() < 0.5  # close: e4m3 K/V (2^-4 relative) moves them by ~0.01-0.1 here


def _generate(llm, prompts, n=2):
    return llm.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=4, seed=3))


def test_scales_calibrate_once_per_weight_update_in_place():
    model = tiny_model()
    prompts = random_prompts(PROMPT_LENS)
    with use_backend("torch"):
        llm = LLM(model, config=EngineConfig(**FP8, max_num_seqs=8))
        kvq = model.kv_quant
        assert kvq is llm.runner.kv_quant and llm.kv.pool.dtype == FP8_DTYPE
        scale, inv = kvq.scale, kvq.inv
        _generate(llm, prompts)
        first = scale.clone()
        _generate(llm, prompts)  # same weights: no new calibration, the cached prompts are hit
        assert llm.stats.kv_calibrations == 1 and llm.stats.prompt_tokens_cached > 0
        with torch.no_grad():  # V grows 16x in every layer: V's scales follow, exactly (powers of two)
            for layer in model.model.layers:
                layer.self_attn.v_proj.weight.mul_(16.0)
        cached = llm.stats.prompt_tokens_cached
        _generate(llm, prompts)
    assert llm.stats.kv_calibrations == 2
    assert llm.stats.prompt_tokens_cached - cached < sum(PROMPT_LENS)  # no block of the old weights reused
    assert kvq.scale is scale and kvq.inv is inv  # rewritten in place (CUDA graphs hold them)
    assert torch.equal(scale[:, 1], first[:, 1] * 16) and torch.equal(scale[:, 0], first[:, 0])
    assert torch.equal(inv * scale, torch.ones_like(scale))


def test_calibrated_scales_follow_the_rule():
    """The scales are `scales_from_amax` of the largest |K| (after norm and RoPE) and |V| of a
    packed forward over the prompts, recorded here independently with forward hooks."""
    model = tiny_model()
    prompts = random_prompts(PROMPT_LENS)
    seen = {}

    def hook(i):
        def f(mod, args, out):
            seen.setdefault(i, []).append(out.detach().abs().view(out.shape[0], 2, 16).amax(dim=(0, 2)))
        return f

    hooks = [layer.self_attn.v_proj.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    with use_backend("torch"):
        llm = LLM(model, config=EngineConfig(**FP8, max_num_seqs=8))
        seen.clear()
        llm.runner.calibrate_kv(prompts)
    for h in hooks:
        h.remove()
    for i in range(2):
        amax_v = torch.stack(seen[i]).amax(0)
        assert torch.equal(model.kv_quant.scale[i, 1], scales_from_amax(amax_v)), i


def test_a_cache_in_the_model_dtype_clears_the_scales():
    model = tiny_model()
    with use_backend("torch"):
        LLM(model, config=EngineConfig(**FP8, max_num_seqs=2))
        assert model.kv_quant is not None
        LLM(model, config=EngineConfig(max_num_seqs=2))
    assert model.kv_quant is None


def test_fp8_pool_holds_twice_the_tokens_in_the_same_bytes():
    model = tiny_model()
    mcfg = model.config
    plain = EngineConfig(max_num_seqs=4096, cpu_kv_cache_gib=0.01)
    fp8 = EngineConfig(**FP8, max_num_seqs=4096, cpu_kv_cache_gib=0.01)
    n16 = plan_num_blocks(mcfg, plain, 512, torch.bfloat16, torch.device("cpu"), lambda: None)
    n8 = plan_num_blocks(mcfg, fp8, 512, FP8_DTYPE, torch.device("cpu"), lambda: None)
    assert n8 == 2 * n16 or n8 == 2 * n16 - 1, (n8, n16)  # the scales' few bytes may cost a block


def test_bad_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="EngineConfig.kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")


@pytest.mark.slow
def test_exact_fp8_triton_interpreter_is_bitwise():
    """The Triton kernels (fused norm + RoPE + fp8 store, paged attention dequantizing on
    load) under the interpreter, bf16: rollout == trainer bitwise."""
    model = tiny_model(dtype=torch.bfloat16, layers=1)
    prompts = random_prompts([70, 9])
    s = Setting(name="fp8", num_prompts=2, n=2, engine=dict(**FP8, max_num_batched_tokens=32))
    with use_backend("triton"):
        r = run_setting(model, prompts, s, numerics="exact", max_tokens=4, temperature=1.0)
    assert r.bitwise_frac == 1.0, (r.row(), r.first_diff)
