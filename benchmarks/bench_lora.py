"""Decode throughput with LoRA adapters (applied, never merged) against without, side by side
in one process: the Qwen3-0.6B shape, random bf16 weights, the engine's `fixed` case
(256 prompts of 128 ids, 512 new tokens each) and its `grpo` case, fast and exact numerics.
The adapters get a nonzero B (`init_lora_(b_std=...)`) so the adapter path really computes.

    python benchmarks/bench_lora.py [--rank 16] [--cases fixed grpo] [--numerics fast exact]
    python benchmarks/bench_lora.py --ops            # + the op alone, per projection shape
    python benchmarks/bench_lora.py --small          # tiny fp32 model on CPU: a smoke test

`--ops`: one projection of the Qwen3-0.6B shape at decode batch sizes, fast numerics, each
variant captured in a CUDA graph and replayed (launch cost as in the engine's decode): the
base linear alone, LoRA by two GEMMs (shrink, then addmm; the torch backend) and LoRA by
the base GEMM + one Triton kernel (`lora_delta_`, the triton backend); microseconds a call.

Prints a table; with $OUT set, writes $OUT/bench_lora.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlfuse.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from rlfuse.engine.benchmark import build_model, make_cases  # noqa: E402
from rlfuse.model.lora import LoRAConfig, attach_lora, has_lora, init_lora_  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_cases(model, cases, numerics: str, small: bool, device) -> dict[str, float]:
    ecfg = EngineConfig(max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=128 if small else 2048,
                        gpu_memory_fraction=0.8, seed=0, numerics=numerics)
    llm = LLM(model, None, ecfg)
    llm.capture_graphs()
    llm.generate([[1] * 16], SamplingParams(max_tokens=8))  # warm-up: compiles, graphs
    out = {}
    for case in cases:
        warm = case.prompts[:8]
        llm.generate(warm, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=8)] * len(warm))
        llm.capture_graphs()
        _sync(device)
        t0 = time.perf_counter()
        outs = llm.generate(case.prompts, case.params)
        _sync(device)
        dt = time.perf_counter() - t0
        out[case.name] = sum(len(o.output_token_ids) for o in outs) / dt
        print(f"{numerics} {case.name} {'LoRA' if has_lora(model) else 'no LoRA'}: {out[case.name]:.0f} tok/s "
              f"({dt:.2f} s)", flush=True)
    llm.sleep()
    del llm
    return out


OP_SHAPES = {"q_proj": (1024, 2048), "k_proj/v_proj": (1024, 1024), "o_proj": (2048, 1024),
             "gate_proj/up_proj": (1024, 3072), "down_proj": (3072, 1024)}  # (in, out) at the 0.6B shape


def time_ops(rank: int, small: bool, device) -> list[dict]:
    from rlfuse.kernels import use_backend, use_numerics
    from rlfuse.kernels.lora import lora_linear

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = {"tiny": (64, 96)} if small else OP_SHAPES
    rows = []
    for name, (K, N) in shapes.items():
        w, a, b = (torch.randn(*s, device=device, dtype=dtype) * 0.02 for s in ((N, K), (rank, K), (N, rank)))
        for M in ((1, 8) if small else (1, 16, 64, 128, 256)):
            x = torch.randn(M, K, device=device, dtype=dtype)
            variants = {"base": ("torch", lambda: torch.nn.functional.linear(x, w)),
                        "two GEMMs": ("torch", lambda: lora_linear(x, w, None, a, b, 2.0)),
                        "one kernel": ("triton", lambda: lora_linear(x, w, None, a, b, 2.0))}
            row = {"proj": name, "M": M}
            for vname, (backend, fn) in variants.items():
                if backend == "triton" and device.type != "cuda":
                    continue
                with torch.no_grad(), use_numerics("fast"), use_backend(backend):
                    row[vname] = _graph_us(fn, device)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _graph_us(fn, device, reps: int = 200) -> float:
    """Microseconds a call: fn captured once in a CUDA graph, the graph replayed `reps` times
    (eager on the CPU)."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):  # 10 calls a replay: the replay's own launch is spread over them
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (reps * 10) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--cases", nargs="+", default=["fixed", "grpo"])
    ap.add_argument("--numerics", nargs="+", default=["fast", "exact"])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--ops", action="store_true", help="also time the op alone per projection shape (see above)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    ops = time_ops(args.rank, args.small, device) if args.ops else []
    cases = make_cases(args.small, args.cases)
    model = build_model(args.small, device, seed=0)
    rows = []
    base = {nm: time_cases(model, cases, nm, args.small, device) for nm in args.numerics}
    attach_lora(model, LoRAConfig(rank=args.rank, alpha=2.0 * args.rank))
    init_lora_(model, seed=0, b_std=0.01)
    model.to(device)
    lora = {nm: time_cases(model, cases, nm, args.small, device) for nm in args.numerics}
    for nm in args.numerics:
        for c in args.cases:
            rows.append({"numerics": nm, "case": c, "base_tok_s": base[nm][c], "lora_tok_s": lora[nm][c],
                         "lora_over_base": lora[nm][c] / base[nm][c]})
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{dev}, torch {torch.__version__}, LoRA rank {args.rank} on every linear layer (q k v o gate up down)")
    print("| numerics | case | no LoRA tok/s | LoRA tok/s | LoRA / no LoRA |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['numerics']} | {r['case']} | {r['base_tok_s']:.0f} | {r['lora_tok_s']:.0f} | "
              f"{r['lora_over_base']:.3f} |")
    if ops:
        how = "bf16, CUDA-graph replays" if device.type == "cuda" else "fp32 on the CPU (smoke test), eager"
        print(f"\nthe op alone, fast numerics, rank {args.rank}, {how} (us a call)")
        print("| projection (in, out) | rows | base linear | LoRA: two GEMMs | LoRA: one kernel |\n|---|---|---|---|---|")
        for r in ops:
            shape = OP_SHAPES.get(r["proj"], "")
            print(f"| {r['proj']} {shape} | {r['M']} | {r['base']:.1f} | {r['two GEMMs']:.1f} | "
                  f"{r.get('one kernel', float('nan')):.1f} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_lora.json").write_text(json.dumps({"device": dev, "rank": args.rank,
                                                                           "rows": rows, "ops": ops}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
