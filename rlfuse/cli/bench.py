"""`rlfuse bench generate`: engine throughput vs transformers vs the bandwidth bound.

    rlfuse bench generate                    # on the GPU: Qwen3-0.6B-shaped, bf16, 3 cases
    rlfuse bench generate --small --no-peer  # CPU smoke test
    rlfuse bench generate --shape 3.5-2b --cases decode   # a Qwen3.5-2B-shaped hybrid, B=256 decode
Writes $OUT (or --out) /bench_generate.json and /bench_generate.md (a section ready to
append to docs/benchmarks.md; --append-docs FILE appends it) and prints the table.
The protocol and the bound are described in `rlfuse.engine.benchmark`.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

from rlfuse.cli.common import fail
from rlfuse.engine.benchmark import SHAPES, BenchConfig, table
from rlfuse.engine.benchmark import run as run_bench
from rlfuse.kernels.backend import NUMERICS
from rlfuse.kernels.kv_quant import KV_CACHE_DTYPES
from rlfuse.run import make_folder

HELP = "benchmarks (generate)"


def add_arguments(p) -> None:
    p.add_argument("what", choices=["generate"], help="which benchmark")
    p.add_argument("--small", action="store_true", help="tiny fp32 model, small cases (CPU smoke test)")
    p.add_argument("--cases", default="nanovllm,fixed,grpo", help="comma-separated: nanovllm, fixed, grpo, decode")
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.6b",
                   help="the model's published shape, random weights (Qwen3 or the Qwen3.5 hybrids 3.5-*)")
    p.add_argument("--no-peer", action="store_true", help="skip transformers generate")
    p.add_argument("--peer-batch", type=int, default=128, help="rows per transformers generate call")
    p.add_argument("--peer-max-seqs", type=int, default=None, help="time the peer on the first N sequences only")
    p.add_argument("--device", default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--gpu-memory-fraction", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--numerics", choices=NUMERICS, default="fast", help="engine numerics (docs/numerics.md)")
    p.add_argument("--no-share-prefix-decode", action="store_true",
                   help="decode reads every sequence's prompt K/V itself (EngineConfig.share_prefix_decode off)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="EngineConfig.kv_cache_dtype (fp8_e4m3: %% of bound stays against the bf16-KV bound)")
    p.add_argument("--out", default=None, help="output folder (default: $OUT or ./out)")
    p.add_argument("--append-docs", default=None, metavar="MD", help="append the markdown section to this file")


def _commit() -> str:
    if os.environ.get("RLFUSE_COMMIT"):  # benchmarks/run_gpu.sh: the device's .git may be stale
        return os.environ["RLFUSE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args) -> int:
    cfg = BenchConfig(small=args.small, cases=tuple(c for c in args.cases.split(",") if c), peer=not args.no_peer,
                      shape=args.shape,
                      peer_batch=args.peer_batch, peer_max_seqs=args.peer_max_seqs, device=args.device,
                      max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      gpu_memory_fraction=args.gpu_memory_fraction, enforce_eager=args.enforce_eager,
                      numerics=args.numerics, share_prefix_decode=False if args.no_share_prefix_decode else None,
                      kv_cache_dtype=args.kv_cache_dtype)
    try:
        out = make_folder(args.out or os.environ.get("OUT") or "out", "--out")  # before minutes of benchmarking
        result = run_bench(cfg)
    except ValueError as e:
        return fail(e)
    result["commit"] = _commit()
    result["command"] = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    (out / "bench_generate.json").write_text(json.dumps(result, indent=2))
    tab = table(result)
    md = (f"\n## Generation throughput: engine vs transformers vs bandwidth bound\n\n"
          f"{result['device']}, torch {result['torch']}, {result['dtype']}, numerics {args.numerics}, "
          f"KV cache {result['kv_cache_dtype']}, "
          f"commit {result['commit']}, "
          f"{datetime.date.today()}; command `{result['command']}`. Model: "
          f"{'tiny (--small)' if args.small else f'{args.shape} shape (rlfuse.engine.benchmark.SHAPES), random weights'}"
          f"; copy bandwidth "
          f"{result['copy_bandwidth_GBps']:.0f} GB/s (read + write); {result['kv_blocks']} KV blocks. "
          f"Protocol and bound: `rlfuse/engine/benchmark.py`."
          + (f" {result['peer_note']}." if result["peer_note"] else "")
          + (f" Peer logits rel. error vs ours {result['peer_logits_rel_err']:.1e}." if "peer_logits_rel_err" in
             result else "") + f"\n\n{tab}\n")
    (out / "bench_generate.md").write_text(md)
    if args.append_docs:
        with open(args.append_docs, "a") as f:
            f.write(md)
    print(tab)
    return 0
