"""Decode throughput with LoRA adapters (applied, never merged) against without, side by side
in one process: the Qwen3-0.6B shape, random bf16 weights, the engine's `fixed` case
(256 prompts of 128 ids, 512 new tokens each) and its `grpo` case, fast and exact numerics.
The adapters get a nonzero B (`init_lora_(b_std=...)`) so the adapter path really computes.

    python benchmarks/bench_lora.py [--rank 16] [--cases fixed grpo] [--numerics fast exact]
    python benchmarks/bench_lora.py --small          # tiny fp32 model on CPU: a smoke test

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--cases", nargs="+", default=["fixed", "grpo"])
    ap.add_argument("--numerics", nargs="+", default=["fast", "exact"])
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
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
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_lora.json").write_text(json.dumps({"device": dev, "rank": args.rank,
                                                                           "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
