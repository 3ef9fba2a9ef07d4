"""The published model shapes the benchmarks and `rlfuse check --shape` use, with random weights.

`SHAPES`: Qwen3 0.6b..8b (`QWEN3_SHAPES`), the Qwen3.5 3.5-0.8b / 3.5-2b hybrids' text towers
(`QWEN3_5_SHAPES`), the MoE 30b-a3b / 35b-a3b and the unpublished moe-3b (`MOE_SHAPES`), each
as ModelConfig fields; `TINY`: a tiny dense model for CPU smoke tests. `random_model` builds
one on the device in its dtype; `build_model` is the generation benchmark's choice.
Test: python -m pytest -q tests/test_engine_bench.py
"""

from __future__ import annotations

import torch

from rlfuse.model import CausalLM
from rlfuse.model.arch.qwen3_5 import tiny_hybrid_fields
from rlfuse.model.config import ModelConfig


def _qwen3(hidden: int, inter: int, layers: int, heads: int, tied: bool) -> dict:
    return dict(model_type="qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8, head_dim=128,
                qk_norm=True, tie_word_embeddings=tied, rope_theta=1e6, max_position_embeddings=40960)


# the published config.json of Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B}: the shapes every benchmark
# uses (with random weights); one definition, benchmarks override max_position_embeddings if needed.
# 14B and 32B: issue 39's largest shapes (14B full fine-tune on 4 GPUs, 32B LoRA on one H200)
QWEN3_SHAPES = {
    "0.6b": _qwen3(1024, 3072, 28, 16, tied=True),
    "1.7b": _qwen3(2048, 6144, 28, 16, tied=True),
    "4b": _qwen3(2560, 9728, 36, 32, tied=True),
    "8b": _qwen3(4096, 12288, 36, 32, tied=False),
    "14b": _qwen3(5120, 17408, 40, 40, tied=False),
    "32b": _qwen3(5120, 25600, 64, 64, tied=False),
}
QWEN3_06B = QWEN3_SHAPES["0.6b"]
# MoE shapes of issue 36's targets (random weights): Qwen/Qwen3-30B-A3B's published config,
# Qwen3.5-35B-A3B's text model as transformers' Qwen3_5MoeTextConfig defaults describe it
# (rope theta and the like do not change a step's time and are left at our defaults), and
# "moe-3b", no published model: Qwen3-30B-A3B's layer scaled down (hidden 1024, 24 layers, 64
# experts of width 512, top-8) to 2.9 B parameters (0.74 B active), small enough for full
# fine-tuning on one GPU, the 1-GPU reference of the FSDP2 runs (bench_multi_gpu.py moe)
MOE_SHAPES = {
    "moe-3b": dict(_qwen3(1024, 3072, 24, 16, tied=False), model_type="qwen3_moe", num_key_value_heads=4,
                   moe=dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, norm_topk_prob=True)),
    "30b-a3b": dict(_qwen3(2048, 6144, 48, 32, tied=False), model_type="qwen3_moe", num_key_value_heads=4,
                    moe=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                             norm_topk_prob=True)),
    "35b-a3b": dict(model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
                    num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
                    tie_word_embeddings=False, max_position_embeddings=40960,
                    layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                      for i in range(40)),
                    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_num_key_heads=16, linear_num_value_heads=32,
                    moe=dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, norm_topk_prob=True,
                             shared_expert_intermediate_size=512)),
}


def _qwen3_5(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, lin_k: int, lin_v: int) -> dict:
    return dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256,
                partial_rotary_factor=0.25, rope_theta=1e7, tie_word_embeddings=True, max_position_embeddings=262144,
                layer_types=(("linear_attention",) * 3 + ("full_attention",)) * (layers // 4),
                linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=lin_k, linear_num_value_heads=lin_v)


# the text towers of the published Qwen/Qwen3.5-{0.8B,2B} config.json (three Gated DeltaNet
# layers then one gated full-attention layer, repeated), with random weights; ~0.75 B and
# ~1.9 B parameters here (no vision tower, no MTP head). The dense shape of about the same
# size as 3.5-2b is Qwen3-1.7B (1.7 B).
QWEN3_5_SHAPES = {
    "3.5-0.8b": _qwen3_5(1024, 3584, 24, 8, 2, 16, 16),
    "3.5-2b": _qwen3_5(2048, 6144, 24, 8, 2, 16, 16),
}
SHAPES = {**QWEN3_SHAPES, **QWEN3_5_SHAPES, **MOE_SHAPES}
TINY = dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, qk_norm=True,
            tie_word_embeddings=True, max_position_embeddings=512)


def random_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """A CausalLM of `shape` (ModelConfig fields) with random weights made directly on
    `device` in `dtype` (built on the meta device, then allocated): an 8B model never
    passes through fp32 on the CPU."""
    with torch.device("meta"):
        model = CausalLM(ModelConfig(**shape))
    model = model.to(dtype).to_empty(device=device)
    model.init_weights(std=0.02, generator=torch.Generator(device).manual_seed(seed))
    return model.eval()


def build_model(small: bool, device: torch.device, seed: int, shape: str = "0.6b") -> CausalLM:
    """The benchmark's model; `small`: a tiny fp32 one of the same kind (hybrid or dense)."""
    if shape not in SHAPES:
        raise ValueError(f"bench shape {shape!r}: expected one of {sorted(SHAPES)}")
    hybrid, moe = "layer_types" in SHAPES[shape], "moe" in SHAPES[shape]
    if small:  # an MoE shape: the tiny dense model with 4 routed experts (top-2), so the MoE bound runs
        tiny = tiny_hybrid_fields() if hybrid else TINY
        if moe and not hybrid:
            tiny = dict(TINY, model_type="qwen3_moe", moe=dict(num_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=32, norm_topk_prob=True))
        return random_model(tiny, device, torch.float32, seed)
    return random_model(SHAPES[shape], device, torch.bfloat16, seed)
