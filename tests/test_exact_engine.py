"""Exact numerics end to end: engine rollout log-probs == trainer log-probs, bitwise.

The sweep of `rlfuse.consistency.check` (batch 1 and larger, n > 1 sharing a prompt,
prefix cache off, chunked prefill, forced preemption, eager vs static decode with
look-ahead, micro-batch packing, all combined) on a tiny random model: every sampled
token's log-prob from the engine equals the one from the trainer's packed forward with
autograd recording. Each setting is also checked to have exercised what it names
(preemptions happened, prefix-cache hits happened, ...), and fast numerics must show a
difference, so the comparison can fail. CPU: the torch references in fp32 and bf16,
and the Triton kernels under the interpreter (fp32, smaller). GPU (marked): bf16.
Run: python -m pytest -q tests/test_exact_engine.py
"""

import dataclasses
import json

import pytest
import torch
from engine_helpers import (
    one_thread,  # noqa: F401 (fixture)
    random_prompts,
    tiny_model,
)

from rlfuse.cli import main
from rlfuse.consistency.check import Setting, default_sweep, run_setting
from rlfuse.consistency.drift import layer_drift
from rlfuse.kernels import use_backend
from rlfuse.model.fuse import is_fused

PROMPT_LENS = [14, 30, 33, 7, 40, 3, 18, 9]  # the first two cross a block boundary while decoding
CHUNK = 16  # prefill budget a step: prompts of 18..40 tokens are chunked


def _sweep(max_batch, tokens):
    # the smallest safe pool: two of the longest sequences at full length (one always fits)
    need = max(PROMPT_LENS[:max(1, max_batch // 4)]) + tokens
    return default_sweep(max_batch, small_pool_blocks=2 * -(-need // 16), chunk_tokens=CHUNK)


def _check_exercised(setting: Setting, stats: dict, triton: bool = False):
    if setting.min_prompt_len and triton:  # the Triton path's shared-prefix decode ran
        assert stats["shared_prefix_steps"] > 0, setting.name
    if "preemption" in setting.name or setting.name == "combined":
        assert stats["preemptions"] > 0, setting.name
    if setting.n > 1 and setting.engine.get("enable_prefix_caching", True):
        assert stats["prompt_tokens_cached"] > 0, setting.name
    if not setting.engine.get("enable_prefix_caching", True):
        assert stats["prompt_tokens_cached"] == 0, setting.name
    if setting.engine.get("enforce_eager"):
        assert stats["look_ahead_steps"] == 0, setting.name
    elif setting.batch > 1:
        assert stats["look_ahead_steps"] > 0, setting.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_sweep_torch_backend_is_bitwise(dtype):
    model = tiny_model(dtype=dtype)
    prompts = random_prompts(PROMPT_LENS)
    with use_backend("torch"):
        for s in _sweep(8, 16):
            r = run_setting(model, prompts, s, numerics="exact", max_tokens=16, temperature=1.0)
            k = s.num_prompts
            assert r.tokens == (s.n * sum(max(1, 16 * (i + 1) // k) for i in range(k)) if s.ragged else s.batch * 16)
            assert r.bitwise_frac == 1.0 and r.max_abs == 0.0, (s.name, r.row(), r.first_diff)
            _check_exercised(s, r.engine_stats)


def test_exact_holds_with_activation_checkpointing():
    """The trainer's forward with activation checkpointing (recompute in backward) still
    gives the engine's bits: the recorded forward runs the same exact kernels."""
    model = tiny_model()
    model.gradient_checkpointing = True
    prompts = random_prompts(PROMPT_LENS)
    with use_backend("torch"):
        r = run_setting(model, prompts, _sweep(8, 8)[-1], numerics="exact", max_tokens=8, temperature=1.0)
    assert r.bitwise_frac == 1.0, (r.row(), r.first_diff)


def test_exact_holds_with_fused_projections():
    """q/k/v and gate/up fused (the CUDA default; a CPU engine fuses when asked): the
    engine's and the trainer's forwards both run the fused GEMMs, and keep the bits."""
    model = tiny_model()
    prompts = random_prompts(PROMPT_LENS)
    s = _sweep(8, 8)[-1]
    s = dataclasses.replace(s, engine={**s.engine, "fuse_projections": True})
    with use_backend("torch"):
        r = run_setting(model, prompts, s, numerics="exact", max_tokens=8, temperature=1.0)
    assert is_fused(model)
    assert r.bitwise_frac == 1.0, (r.row(), r.first_diff)


def test_exact_sweep_triton_is_bitwise():
    """The Triton kernels: under the interpreter on CPU, compiled on a GPU (fp32 here)."""
    model = tiny_model(device="cuda" if torch.cuda.is_available() else "cpu")
    prompts = random_prompts(PROMPT_LENS)
    sweep = {s.name: s for s in _sweep(8, 6)}
    with use_backend("triton"):
        for name in ("batch 1", "combined", "n=4 long shared prompts"):
            r = run_setting(model, prompts, sweep[name], numerics="exact", max_tokens=6, temperature=0.8)
            assert r.bitwise_frac == 1.0, (name, r.row(), r.first_diff)
            _check_exercised(sweep[name], r.engine_stats, triton=True)


def test_fast_numerics_shows_drift_and_the_probe_names_its_first_op():
    """The comparison can fail: fast numerics (torch's own CPU GEMMs, batch-variant for
    small M) differs somewhere, the probe names a layer and op there, and finds none in
    exact numerics for the same token."""
    model = tiny_model()
    prompts = random_prompts(PROMPT_LENS)
    with use_backend("torch"):
        # batch 1: the probe's single-sequence replay is exactly that rollout's forward
        bad = run_setting(model, prompts, _sweep(8, 16)[0], numerics="fast", max_tokens=16, temperature=1.0)
        assert bad.bitwise_frac < 1.0 and bad.max_abs > 0
        i, pos = bad.first_diff
        prompt, completion = bad.sequences[i]
        fast = layer_drift(model, prompt, completion, pos, numerics="fast")
        exact = layer_drift(model, prompt, completion, pos, numerics="exact")
    assert fast.first_divergence is not None and fast.logprob_delta > 0
    assert exact.first_divergence is None and exact.logprob_delta == 0.0
    assert all(v == 0.0 for v in exact.layer_max_abs)


def test_check_cli_tiny(tmp_path, capsys):
    rc = main(["check", "--tiny", "--numerics", "exact", "--max-batch", "4", "--max-tokens", "6",
               "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr()
    report = json.loads((tmp_path / "check.json").read_text())
    names = [r["name"] for r in report["settings"]]
    assert len(names) == 14 and "fp8 KV cache" in names and names[-3:] == [
        "image-text prompts, tiny Qwen3-VL", "multi-turn, scripted tool", "agent via OpenAI API"]
    assert report["settings"][-3]["engine_stats"]["vision_encodes"] == 3  # 3 distinct images (one in two prompts), 8 samples
    assert report["settings"][-2]["engine_stats"]["preemptions"] > 0
    agent = report["settings"][-1]["engine_stats"]  # a scripted openai client through the session server
    assert agent["rollout/agent_split_samples"] >= 1 and agent["rollout/agent_merged_frac"] > 0.3
    for row in report["settings"]:
        assert set(row) >= {"name", "tokens", "bitwise_frac", "max_abs", "mean_abs", "kl_k3"}
        assert row["bitwise_frac"] == 1.0 and row["tokens"] > 0
    out = capsys.readouterr().out
    assert "bitwise equal over all settings" in out


@pytest.mark.gpu
def test_exact_sweep_gpu_bf16():
    """Triton kernels on the GPU in bf16, CUDA graphs on, head_dim 128: every setting bitwise."""
    from rlfuse.model import CausalLM, ModelConfig

    cfg = ModelConfig(model_type="qwen3", vocab_size=4096, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                      qk_norm=True, tie_word_embeddings=True, max_position_embeddings=2048)
    model = CausalLM(cfg)
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(0))
    model = model.to(device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 4096, (int(n),), generator=g).tolist() for n in torch.randint(8, 200, (64,), generator=g)]
    need = 200 + 64
    for s in default_sweep(64, small_pool_blocks=64 * -(-need // 16) // 4, chunk_tokens=128):
        r = run_setting(model, prompts, s, numerics="exact", max_tokens=64, temperature=1.0)
        assert r.bitwise_frac == 1.0, (s.name, r.row(), r.first_diff)
        if s.min_prompt_len:
            assert r.engine_stats["shared_prefix_steps"] > 0, s.name
