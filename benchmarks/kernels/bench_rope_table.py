"""The step's RoPE table: a decode step's q/k norms + RoPE + KV store over all its layers,
cos/sin computed in every kernel (no table) against the table computed once
(`rope_cos_sin`) and loaded by each layer's kernel; the outputs are checked bitwise equal.

Qwen3-0.6B shapes, bf16: q (T, 16, 128), k and v (T, 8, 128), the cache in pages of 16, 28
layers (one call per layer on the same q/k/v and cache), positions 512..1535 (a rollout's
decode), T in {64, 256} (decode batches) and 4096 (a prefill chunk). Median of --reps
CUDA-graph replays of the whole 28-layer sequence, L2 flushed before each; per-layer us =
that / 28.

Run on the GPU box:  OUT=./out python benchmarks/kernels/bench_rope_table.py
CPU smoke test (Triton's interpreter, T = 16, 2 layers, wall-clock; no numbers to keep):
                     python benchmarks/kernels/bench_rope_table.py --small
Writes $OUT/bench_rope_table.json and $OUT/bench_rope_table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from _timing import graphed, median_seconds  # benchmarks/kernels/_timing.py (the script's directory)

LAYERS = 28  # Qwen3-0.6B


def cases(T: int, dev: str, layers: int):
    """(no-table step, table step, check()) for T tokens: each step runs the 28 layers' kernels."""
    from rlfuse.kernels.rope import qk_norm_rope, rope_cos_sin, rope_inv_freq
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dev, dt)

    q, k, v, wq, wk = rand(T, 16, 128), rand(T, 8, 128), rand(T, 8, 128), rand(128), rand(128)
    pos, inv = torch.randint(512, 1536, (T,), generator=g).to(dev), rope_inv_freq(128, 1e6).to(dev)
    pages = -(-T // 16)
    caches = [torch.zeros(pages, 16, 8, 128, device=dev, dtype=dt) for _ in range(4)]
    slots = torch.randperm(pages * 16, generator=g)[:T].to(dev)

    def step(table: bool, cache):
        cs = rope_cos_sin(pos, inv) if table else None
        for _ in range(layers):
            qo, _ = qk_norm_rope(q, k, pos, inv, wq, wk, 1e-6, v=v, kv_cache=cache, slot_mapping=slots, cos_sin=cs)
        return qo

    def check():
        a, b = step(False, caches[:2]), step(True, caches[2:])
        assert torch.equal(a, b) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), \
            "the table changed bits"

    return (lambda: step(False, caches[:2])), (lambda: step(True, caches[2:])), check


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--small", action="store_true", help="CPU smoke test (Triton's interpreter)")
    args = ap.parse_args()
    if args.small:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton first loads (the first op)
    from rlfuse.kernels import use_backend
    dev = "cpu" if args.small else "cuda"
    rows = []
    with use_backend("triton"), torch.no_grad():
        for T in ([16] if args.small else [64, 256, 4096]):
            layers = 2 if args.small else LAYERS
            plain, table, check = cases(T, dev, layers)
            check()
            r = dict(T=T, layers=layers)
            for name, fn in (("no_table", plain), ("table", table)):
                if args.small:
                    t0 = time.perf_counter()
                    fn()
                    s = time.perf_counter() - t0
                else:
                    s = median_seconds(graphed(fn), args.reps, flush_l2=True)
                r[f"{name}_us"] = s * 1e6
            r["speedup"] = r["no_table_us"] / r["table_us"]
            rows.append(r)
            print(f"T={T:<5d} {layers} layers: no table {r['no_table_us']:8.1f} us  table {r['table_us']:8.1f} us  "
                  f"(per layer {r['no_table_us'] / layers:.2f} -> {r['table_us'] / layers:.2f} us)  "
                  f"x{r['speedup']:.2f}  bitwise equal", flush=True)
    if args.small:
        return
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    commit = os.environ.get("RLFUSE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cmd = "python benchmarks/kernels/bench_rope_table.py"
    meta = dict(gpu=gpu, torch=torch.__version__, commit=commit, dtype="bf16", command=cmd)
    (out / "bench_rope_table.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    md = [f"### qk-norm+rope+kv over {LAYERS} layers: cos/sin per kernel vs the step's table ({gpu}, commit {commit})",
          "", f"`{cmd}`; CUDA-graph replays, L2 flushed; outputs bitwise equal.", "",
          "| T | no table us | table us | per layer us | speedup |", "|---|---|---|---|---|"]
    md += [f"| {r['T']} | {r['no_table_us']:.1f} | {r['table_us']:.1f} | {r['no_table_us'] / LAYERS:.2f} -> "
           f"{r['table_us'] / LAYERS:.2f} | {r['speedup']:.2f} |" for r in rows]
    (out / "bench_rope_table.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
