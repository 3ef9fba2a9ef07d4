"""GPU: image-text prompts on the fused kernels (auto backend, CUDA graphs, bf16).

* `rlfuse check --tiny --vision` (and `--hybrid`: the tiny Qwen3.5-VL) in exact numerics: every engine setting (batch sizes, n
  sharing a prompt, prefix cache off, chunked prefill splitting images, preemption,
  look-ahead and graph decode, micro-batching) gives rollout == trainer log-probs bitwise;
  fast numerics shows a difference (the comparison can fail);
* GRPO steps with the tiny VLM in bf16, exact numerics: mismatch/max_abs 0 at every step and
  the tower run once per distinct image (vision/encodes = prompts per step); the same with a
  tiny Qwen3.5-VL (the demo's widths, a hybrid text tower, no DeepStack).
Run: python -m pytest -q -m gpu tests/test_vision_gpu.py"""

import json

import pytest

from rlfuse.cli import main
from rlfuse.recipes.vision_demo import VLM, vision_demo_config
from rlfuse.run.config import replace
from rlfuse.train import open_session, run_grpo

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("hybrid", [False, True], ids=["qwen3_vl", "qwen3_5_vl"])
@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_check_tiny_vision_cuda(tmp_path, numerics, hybrid):
    rc = main(["check", "--tiny", "--vision", *(["--hybrid"] if hybrid else []), "--device", "cuda", "--numerics",
               numerics, "--max-batch", "32", "--max-tokens", "48", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "check.json").read_text())["settings"]
    assert rows and all(r["tokens"] > 0 for r in rows)
    if numerics == "exact":
        assert rc == 0 and all(r["bitwise_frac"] == 1.0 for r in rows), rows
    else:
        assert any(r["bitwise_frac"] < 1.0 for r in rows), "fast numerics shows no difference: nothing was compared"


# the demo VLM's widths on a Qwen3.5 hybrid text tower (3 Gated DeltaNet layers, 1 gated attention)
Q35_VLM = dict(model_type="qwen3_5", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=4, head_dim=16, partial_rotary_factor=0.5,
               layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
               linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=True, mrope_section=[1, 2, 1],
               vision=dict(VLM["vision"], deepstack_visual_indexes=[]))


@pytest.mark.parametrize("hybrid", [False, True], ids=["qwen3_vl", "qwen3_5_vl"])
def test_grpo_vision_exact_bf16_cuda(tmp_path, hybrid):
    cfg = replace(vision_demo_config("ci", str(tmp_path), seed=0), **{
        **({"model.random_init": Q35_VLM} if hybrid else {}),
        "model.device": "cuda", "model.dtype": "bfloat16", "model.kernel_backend": "auto",
        "engine.numerics": "exact", "grpo.steps": 3, "grpo.prompts_per_step": 8, "grpo.group_size": 8,
        "grpo.check_every": 1, "data.train_size": 200, "data.eval_size": 16})
    ses = open_session(cfg)
    res = run_grpo(cfg, session=ses)
    for h in res["history"]:
        assert h["vision/encodes"] == 8.0, h["vision/encodes"]
        assert float(h["mismatch/max_abs"]) == 0.0, h["mismatch/max_abs"]
