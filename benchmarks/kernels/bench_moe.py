"""One MoE layer (router GEMM + routing + experts MLP + combine) at Qwen3-30B-A3B's shape:
D 2048, 128 experts of width 768, top-8, bf16; with `--arch qwen3_5_moe`, Qwen3.5-35B-A3B's
block: D 2048, 256 experts of width 512, top-8, plus the shared expert (a SwiGLU MLP of
width 512) scaled by sigmoid(shared_expert_gate(x)) (`rlfuse.model.layers.moe.SparseMoeBlock`).

Rows (T tokens):
  decode   T in {1, 8, 64, 256}, forward; rlfuse's path replayed from a CUDA graph (no
           host launch time), its "bound" the bytes that must move: every expert the batch
           touches read once (3 I D weights each) plus the router (and the shared expert and
           its gate), at the device-copy GB/s measured in the same run;
  train    T in {4096, 16384}, forward and forward + backward (d x, d every weight, d the
           router through the routing weights).
Columns: rlfuse's Triton path in exact numerics and in fast numerics (the same grouped GEMM;
the router GEMM is the exact linear or cuBLAS), and the eager per-expert loop transformers
runs (`Qwen3MoeExperts.forward`: a Python loop over the experts hit, index_add_), timed
eagerly (it syncs the host). Medians of --reps calls, each timed alone with CUDA events.

Run on the GPU box:  OUT=./out python benchmarks/kernels/bench_moe.py [--quick] [--arch qwen3_5_moe]
CPU smoke test (Triton's interpreter, tiny shapes, wall-clock; no numbers to keep):
                     python benchmarks/kernels/bench_moe.py --small
Writes $OUT/bench_moe.json ($OUT/bench_moe_qwen3_5_moe.json with --arch qwen3_5_moe).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--small" in sys.argv:  # before anything imports triton: the interpreter runs the CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from rlfuse.engine.benchmark import copy_bandwidth
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.activation.glu import swiglu
from rlfuse.kernels.linear import linear
from rlfuse.kernels.moe import experts_mlp, route

# S: the shared expert's width (0: none)
SHAPES = {"qwen3_moe": dict(D=2048, I=768, E=128, K=8, S=0),
          "qwen3_5_moe": dict(D=2048, I=512, E=256, K=8, S=512)}
SMALL = {"qwen3_moe": dict(D=64, I=32, E=8, K=2, S=0), "qwen3_5_moe": dict(D=64, I=32, E=8, K=2, S=48)}


def weights(s: dict, device, dtype, seed=0):
    """router, gate_up, down; then (shared gate, up, down, its sigmoid gate) when S > 0."""
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda *shape: (torch.randn(*shape, device=device, generator=g) * 0.02).to(dtype)  # noqa: E731
    w = [mk(s["E"], s["D"]), mk(s["E"], 2 * s["I"], s["D"]), mk(s["E"], s["D"], s["I"])]
    if s["S"]:
        w += [mk(s["S"], s["D"]), mk(s["S"], s["D"]), mk(s["D"], s["S"]), mk(1, s["D"])]
    return w


def ours(x, router, gate_up, down, *shared, k):
    """SparseMoeBlock.forward's ops (the shared-expert term as Qwen3.5-MoE adds it)."""
    r = route(linear(x, router), k, True)
    out = experts_mlp(x, gate_up, down, r)
    if shared:
        wg, wu, wd, sg = shared
        out = out + torch.sigmoid(linear(x, sg)) * linear(swiglu(linear(x, wg), linear(x, wu)), wd)
    return out


def eager_loop(x, router, gate_up, down, *shared, k):
    """transformers' Qwen3MoeSparseMoeBlock math (Qwen3_5MoeSparseMoeBlock's with the shared
    expert), eager (host-synchronizing loop over the experts hit)."""
    logits = F.linear(x, router)
    p = torch.softmax(logits, dtype=torch.float, dim=-1)
    w, idx = torch.topk(p, k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    inter = down.shape[2]
    for e in idx.unique().tolist():
        tok, slot = torch.where(idx == e)
        h = F.linear(x[tok], gate_up[e])
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], down[e]) * w[tok, slot, None]
        out.index_add_(0, tok, y)
    if shared:
        wg, wu, wd, sg = shared
        out = out + torch.sigmoid(F.linear(x, sg)) * F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    return out


def _timer(device):
    if device.type == "cuda":
        sys.path.insert(0, str(Path(__file__).parent))
        from _timing import graphed, median_seconds  # noqa: PLC0415 -- the scripts' shared helper, beside this file
        return median_seconds, graphed
    def wall(fn, reps, **_):
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps
    return wall, None


def run(args) -> dict:
    device = torch.device("cpu" if args.small else "cuda")
    dtype = torch.float32 if args.small else torch.bfloat16
    s = (SMALL if args.small else SHAPES)[args.arch]
    median, graphed = _timer(device)
    params = weights(s, device, dtype)
    router, gate_up = params[:2]
    expert_bytes = 3 * s["I"] * s["D"] * gate_up.element_size()
    always_bytes = sum(t.numel() * t.element_size() for t in [router, *params[3:]])  # router (+ the shared expert)
    gbps = copy_bandwidth(device, 1 << 30) if device.type == "cuda" else float("nan")
    decode = [1, 8] if args.small else ([1, 64, 256] if args.quick else [1, 8, 64, 256])
    train = [64] if args.small else ([4096] if args.quick else [4096, 16384])
    rows = []
    for T in decode + train:
        x = (torch.randn(T, s["D"], device=device) * 0.5).to(dtype)
        row = {"T": T, "kind": "decode" if T in decode else "train"}
        with torch.no_grad(), use_backend("auto" if device.type == "cuda" else "triton"):
            touched = int(torch.unique(route(linear(x, router), s["K"], True).experts).numel())  # host sync: setup
            row["experts_touched"] = touched
            for numerics in ("exact", "fast"):
                with use_numerics(numerics):
                    fn = lambda: ours(x, *params, k=s["K"])  # noqa: E731
                    if row["kind"] == "decode" and graphed is not None:
                        fn = graphed(fn)
                    row[f"fwd_{numerics}_s"] = median(fn, args.reps)
            row["fwd_eager_loop_s"] = median(lambda: eager_loop(x, *params, k=s["K"]), args.reps)
        if row["kind"] == "decode":
            moved = touched * expert_bytes + always_bytes
            row["bound_s"] = moved / (gbps * 1e9)
        else:
            leaves = [t.detach().requires_grad_() for t in (x, *params)]
            dy = torch.randn_like(x)

            def fwd_bwd(fn, leaves=leaves, dy=dy):
                return torch.autograd.grad(fn(*leaves, k=s["K"]), leaves, dy)
            with use_backend("auto" if device.type == "cuda" else "triton"):
                for numerics in ("exact", "fast"):
                    with use_numerics(numerics):
                        row[f"fwd_bwd_{numerics}_s"] = median(lambda: fwd_bwd(ours), args.reps)
            row["fwd_bwd_eager_loop_s"] = median(lambda: fwd_bwd(eager_loop), args.reps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"arch": args.arch, "shape": s, "dtype": str(dtype), "device": torch.cuda.get_device_name() if device.type == "cuda"
            else "cpu (interpreter)", "copy_gbps": gbps, "torch": torch.__version__,
            "commit": os.environ.get("RLFUSE_COMMIT", ""), "rows": rows}


def table(result: dict) -> str:
    ms = lambda v: f"{v * 1e3:.3f}" if v == v else "-"  # noqa: E731
    lines = ["| T | experts touched | exact fwd ms | fast fwd ms | eager loop fwd ms | bound ms | exact fwd+bwd ms | "
             "fast fwd+bwd ms | eager loop fwd+bwd ms |", "|" + "---|" * 9]
    for r in result["rows"]:
        lines.append(f"| {r['T']} | {r['experts_touched']} | {ms(r['fwd_exact_s'])} | {ms(r['fwd_fast_s'])} | "
                     f"{ms(r['fwd_eager_loop_s'])} | {ms(r.get('bound_s', float('nan')))} | "
                     f"{ms(r.get('fwd_bwd_exact_s', float('nan')))} | {ms(r.get('fwd_bwd_fast_s', float('nan')))} | "
                     f"{ms(r.get('fwd_bwd_eager_loop_s', float('nan')))} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="CPU smoke test under Triton's interpreter")
    p.add_argument("--quick", action="store_true", help="fewer token counts")
    p.add_argument("--arch", choices=sorted(SHAPES), default="qwen3_moe",
                   help="the layer's shape: Qwen3-30B-A3B's, or Qwen3.5-35B-A3B's (with the shared expert)")
    p.add_argument("--reps", type=int, default=None)
    args = p.parse_args()
    args.reps = args.reps or (1 if args.small else 20)
    result = run(args)
    print(table(result))
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    name = "bench_moe.json" if args.arch == "qwen3_moe" else f"bench_moe_{args.arch}.json"
    (out / name).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
