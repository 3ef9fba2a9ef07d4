"""GPU: image-text prompts on the fused kernels (auto backend, CUDA graphs, bf16).

* `rlfuse check --tiny --vision` (and `--hybrid`: the tiny Qwen3.5-VL) in exact numerics: every engine setting (batch sizes, n
  sharing a prompt, prefix cache off, chunked prefill splitting images, preemption,
  look-ahead and graph decode, micro-batching) gives rollout == trainer log-probs bitwise;
  fast numerics shows a difference (the comparison can fail);
* GRPO steps with the tiny VLM in bf16, exact numerics: mismatch/max_abs 0 at every step and
  the tower run once per distinct image (vision/encodes = prompts per step).
Run: python -m pytest -q -m gpu tests/test_vision_gpu.py"""

import json

import pytest

from rlfuse.cli import main
from rlfuse.recipes.vision_demo import vision_demo_config
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


def test_grpo_vision_exact_bf16_cuda(tmp_path):
    cfg = replace(vision_demo_config("ci", str(tmp_path), seed=0), **{
        "model.device": "cuda", "model.dtype": "bfloat16", "model.kernel_backend": "auto",
        "engine.numerics": "exact", "grpo.steps": 3, "grpo.prompts_per_step": 8, "grpo.group_size": 8,
        "grpo.check_every": 1, "data.train_size": 200, "data.eval_size": 16})
    ses = open_session(cfg)
    res = run_grpo(cfg, session=ses)
    for h in res["history"]:
        assert h["vision/encodes"] == 8.0, h["vision/encodes"]
        assert float(h["mismatch/max_abs"]) == 0.0, h["mismatch/max_abs"]
