"""`rlfuse bench generate --small`: the benchmark runs end to end on CPU (tiny model,
small cases), writes its JSON and markdown, completes every sequence, and the GRPO case
prefills each shared prompt once. benchmarks/profile_decode.py puts every Triton kernel in
its op's category."""

import ast
import importlib.util
import json
from pathlib import Path

from engine_helpers import one_thread  # noqa: F401 (fixture)

from rlfuse.cli import main
from rlfuse.engine.benchmark import bound_bytes, make_cases
from rlfuse.model import ModelConfig
from rlfuse.model.arch.qwen3_5 import tiny_hybrid_fields

REPO = Path(__file__).resolve().parents[1]


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


def test_hybrid_decode_case_and_its_bound_count_the_linear_state(tmp_path):
    """`--shape 3.5-2b --small`: the tiny hybrid runs the decode case; the bound adds the
    linear-attention state read and written once per sequence and step, and counts K/V of
    the full-attention layers only."""
    (case,) = make_cases(True, ["decode"])        # 8 prompts of 16 tokens, 16 outputs
    assert bound_bytes(case, 1000, 10, 7) == 15 * 1000 + 8 * 360 * 10 + 8 * 15 * 7
    assert main(["--log-level", "WARNING", "bench", "generate", "--small", "--shape", "3.5-2b", "--cases", "decode",
                 "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bench_generate.json").read_text())
    mc = ModelConfig(**tiny_hybrid_fields())  # 3 Gated DeltaNet layers: 4 value heads of 16 x 16, conv 128 x 3
    assert res["linear_state_bytes_per_seq_step"] == 2 * 3 * (4 * 16 * 16 * 4 + 128 * 3 * 4)
    assert res["kv_bytes_per_token"] == 2 * 1 * mc.num_key_value_heads * mc.head_dim * 4
    (r,) = res["cases"]
    assert r["complete"] and 0 < r["pct_bound"] < 100 and "no peer on a hybrid" in res["peer_note"]


def _profile_decode():
    spec = importlib.util.spec_from_file_location("profile_decode", REPO / "benchmarks" / "profile_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# the category of benchmarks/profile_decode.py that each op family's kernels belong in
KERNEL_CATEGORIES = {"attention": "attention", "loss": "log-prob", "linear": "gemm", "norm": "norm",
                     "rope": "rope", "activation": "swiglu", "sampling": "sampling", "moe": "moe",
                     "gated_delta": "linear-attn"}


def test_profile_decode_puts_each_kernel_in_its_ops_category():
    """Kernels are told apart by name in a profile: every Triton kernel has a name of its own,
    and profile_decode's categories put it with its op family (policy loss: training only,
    never in a decode profile). The fused log-prob's kernels are not 'other'."""
    category = _profile_decode().category
    kernels = []  # (family, module, name) of every @triton.jit function
    for path in sorted((REPO / "rlfuse" / "kernels").glob("*/triton_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                kernels.append((path.parent.name, path.stem, node.name))
    names = [n for _, _, n in kernels]
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)
    launched = [(f, n) for f, m, n in kernels if n.endswith("_kernel") and m != "triton_policy"
                and f in KERNEL_CATEGORIES]
    assert ("loss", "_logprob_fwd_kernel") in launched and len(launched) > 20
    wrong = {n: category(n) for f, n in launched
             if category(n) != ("qk-norm+rope+kv" if n == "_qk_norm_rope_kernel" else KERNEL_CATEGORIES[f])}
    assert not wrong, wrong


def _functions(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def test_benchmarks_import_the_engine_benchmarks_helpers():
    """One definition: a benchmark script imports rlfuse.engine.benchmark's public helpers
    (copy_bandwidth, build_model, ...) instead of defining its own of the same name (the
    entry points every script has, run and table, aside)."""
    ours = {n for f in (REPO / "rlfuse" / "engine" / "benchmark").glob("*.py") for n in _functions(f)
            if not n.startswith("_")}
    ours -= {"run", "table", "main"}
    assert "copy_bandwidth" in ours
    again = {str(p.relative_to(REPO)): sorted(_functions(p) & ours) for p in (REPO / "benchmarks").rglob("*.py")}
    assert not {p: names for p, names in again.items() if names}


def test_moe_bound_reads_the_experts_the_running_batch_touches():
    """An MoE step reads the dense weights and, per layer, the experts its b running
    sequences touch: 1 - (1 - k/E)^b of them under uniform routing. One sequence of 4 decode
    steps with E = 4, k = 2 reads half the experts a step; 8 sequences read nearly all."""
    from rlfuse.engine import SamplingParams
    from rlfuse.engine.benchmark import Case

    one = Case("one", [[1] * 16], [SamplingParams(max_tokens=5)])
    assert bound_bytes(one, 1000, 10, 0, (800, 4, 2)) == 4 * (200 + 400) + (4 * 16 + 10) * 10
    (case,) = make_cases(True, ["fixed"])  # 8 sequences all running for 15 steps
    touched = 1 - (1 - 2 / 4) ** 8
    assert bound_bytes(case, 1000, 10, 0, (800, 4, 2)) == round(15 * (200 + 800 * touched)) + 8 * 360 * 10
    # sequences that finish early stop touching experts: fewer bytes than all running to the end
    ragged = Case("ragged", [[1] * 16] * 2, [SamplingParams(max_tokens=2), SamplingParams(max_tokens=9)])
    assert bound_bytes(ragged, 1000, 0, 0, (800, 4, 2)) == round(200 + 800 * 0.75 + 7 * 600)
