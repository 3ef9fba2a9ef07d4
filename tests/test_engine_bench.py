"""`rlfuse bench generate --small`: the benchmark runs end to end on CPU (tiny model,
small cases), writes its JSON and markdown, completes every sequence, and the GRPO case
prefills each shared prompt once."""

import json

from rlfuse.cli import main
from rlfuse.engine.benchmark import bound_bytes, make_cases
from engine_helpers import one_thread  # noqa: F401 (fixture)


def test_bench_generate_small_runs(tmp_path):
    assert main(["--log-level", "WARNING", "bench", "generate", "--small", "--no-peer", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bench_generate.json").read_text())
    assert [r["case"] for r in res["cases"]] == ["nanovllm", "fixed", "grpo"]
    for r in res["cases"]:
        assert r["complete"] and r["engine_tok_s"] > 0 and 0 < r["pct_bound"] < 100
    grpo = res["cases"][2]
    assert grpo["prefill_once"] and grpo["stats"]["prompt_tokens_computed"] == 4 * (25 + 3 * (25 % 16))
    assert "| grpo |" in (tmp_path / "bench_generate.md").read_text()


def test_bound_counts_weights_per_step_and_kv_per_context_token():
    (case,) = make_cases(True, ["fixed"])         # 8 prompts of 16 tokens, 16 outputs
    W, kv = 1000, 10
    # 15 decode steps; per sequence sum_{j=1..15} (16 + j) = 15 * 16 + 120 = 360 tokens read
    assert bound_bytes(case, W, kv) == 15 * W + 8 * 360 * kv
