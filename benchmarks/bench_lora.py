"""Decode throughput with LoRA adapters (applied, never merged) against without, side by side
in one process: the Qwen3-0.6B shape, random bf16 weights, the engine's `fixed` case
(256 prompts of 128 ids, 512 new tokens each) and its `grpo` case, fast and exact numerics.
Three models: the base; the base with one adapter on every projection (q k v o gate up
down, fused groups kept); the base with an adapter bank of --bank adapters, the requests
spread over them round-robin in one batch (`rlfuse serve --lora`'s path). The adapters
get a nonzero B (`init_lora_(b_std=...)`) so the adapter path really computes.

    python benchmarks/bench_lora.py [--rank 16] [--bank 4] [--cases fixed grpo] [--numerics fast exact]
    python benchmarks/bench_lora.py --small          # tiny fp32 model on CPU: a smoke test

Prints a table (LoRA / no LoRA and bank / no LoRA per case and numerics; the target is
>= 0.9); with $OUT set, writes $OUT/bench_lora.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlfuse.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from rlfuse.engine.benchmark import build_model, make_cases  # noqa: E402
from rlfuse.model.lora import LoRAConfig, attach_lora, init_lora_  # noqa: E402
from rlfuse.model.lora_bank import load_adapter_bank  # noqa: E402
from rlfuse.model.lora_peft import save_peft_adapter  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_cases(model, cases, numerics: str, small: bool, device, label: str, bank: int = 0) -> dict[str, float]:
    ecfg = EngineConfig(max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=128 if small else 2048,
                        gpu_memory_fraction=0.8, seed=0, numerics=numerics)
    llm = LLM(model, None, ecfg)
    llm.capture_graphs()
    llm.generate([[1] * 16], SamplingParams(max_tokens=8))  # warm-up: compiles, graphs
    out = {}
    for case in cases:
        params = case.params if not bank else [dataclasses.replace(p, adapter=i % bank)
                                                for i, p in enumerate(case.params)]
        warm = case.prompts[:8]
        llm.generate(warm, [dataclasses.replace(p, max_tokens=8) for p in params[:8]])
        llm.capture_graphs()
        _sync(device)
        t0 = time.perf_counter()
        outs = llm.generate(case.prompts, params)
        _sync(device)
        dt = time.perf_counter() - t0
        out[case.name] = sum(len(o.output_token_ids) for o in outs) / dt
        print(f"{numerics} {case.name} {label}: {out[case.name]:.0f} tok/s ({dt:.2f} s)", flush=True)
    llm.sleep()
    del llm
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--bank", type=int, default=4, help="adapters in the bank case (0: skip it)")
    ap.add_argument("--cases", nargs="+", default=["fixed", "grpo"])
    ap.add_argument("--numerics", nargs="+", default=["fast", "exact"])
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    cases = make_cases(args.small, args.cases)
    cfg = LoRAConfig(rank=args.rank, alpha=2.0 * args.rank)
    model = build_model(args.small, device, seed=0)
    base = {nm: time_cases(model, cases, nm, args.small, device, "no LoRA") for nm in args.numerics}

    lora_model = build_model(args.small, device, seed=0)  # the same base weights
    attach_lora(lora_model, cfg)
    init_lora_(lora_model, seed=0, b_std=0.01)
    lora = {nm: time_cases(lora_model, cases, nm, args.small, device, "LoRA") for nm in args.numerics}
    bank = {}
    if args.bank:
        with tempfile.TemporaryDirectory() as tmp:  # the bank's adapters: PEFT folders, as `serve --lora` reads
            folders = {}
            for i in range(args.bank):
                init_lora_(lora_model, seed=i, b_std=0.01)
                folders[f"a{i}"] = save_peft_adapter(lora_model, Path(tmp, f"a{i}"))
            del lora_model
            load_adapter_bank(model, folders)
        bank = {nm: time_cases(model, cases, nm, args.small, device, f"bank of {args.bank}", bank=args.bank)
                for nm in args.numerics}
    rows = []
    for nm in args.numerics:
        for c in args.cases:
            r = {"numerics": nm, "case": c, "base_tok_s": base[nm][c], "lora_tok_s": lora[nm][c],
                 "lora_over_base": lora[nm][c] / base[nm][c]}
            if bank:
                r.update(bank_tok_s=bank[nm][c], bank_over_base=bank[nm][c] / base[nm][c])
            rows.append(r)
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{dev}, torch {torch.__version__}, LoRA rank {args.rank} on every linear layer (q k v o gate up down)"
          + (f"; bank: {args.bank} adapters, requests round-robin" if bank else ""))
    print("| numerics | case | no LoRA tok/s | LoRA tok/s | LoRA / no LoRA | bank tok/s | bank / no LoRA |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        b = f"{r['bank_tok_s']:.0f} | {r['bank_over_base']:.3f}" if bank else "- | -"
        print(f"| {r['numerics']} | {r['case']} | {r['base_tok_s']:.0f} | {r['lora_tok_s']:.0f} | "
              f"{r['lora_over_base']:.3f} | {b} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_lora.json").write_text(json.dumps(
            {"device": dev, "rank": args.rank, "bank": args.bank, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
