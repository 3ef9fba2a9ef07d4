"""RMSNorm / RoPE / SwiGLU: Triton kernels vs the PyTorch eager reference and
torch.compile of the same reference, forward and forward+backward, bf16.

Qwen3-0.6B shapes, T in {4096, 16384, 65536} tokens:
    rmsnorm   x (T, 1024), w (1024,)            (the per-layer norms)
    qk-norm   x (T * 16, 128), w (128,)         (Qwen3's per-head q norm)
    rope      q (T, 16, 128), positions 0..T-1
    swiglu    gate, up (T, 3072)
Median of --reps CUDA-graph replays of one call (forward, or forward + autograd.grad), each
timed alone with CUDA events after an L2 flush (--no-graph: eager calls, host included). GB/s
counts the bytes the op must move at least (read inputs + write outputs once; for
backward also the saved inputs), so it is comparable to the device-copy GB/s printed
first (read + write bytes / time of a 1 GiB copy).

Fused against unfused (both Triton, forward; add+rmsnorm also forward + backward), at
decode batches T in {64, 256} and a prefill chunk of 4096:
    add+rmsnorm      add_rmsnorm(h, x, w)       vs  s = h + x; rmsnorm(s, w)
    qk-norm+rope     qk_norm_rope(q, k, ...)    vs  rmsnorm(q), rmsnorm(k), rope(q), rope(k)
    qk-norm+rope+kv  the same with the KV store vs  the four, then store_kvcache
q (T, 16, 128), k and v (T, 8, 128), the cache in pages of 16. One more row compares the
step's RoPE table: a step's 28 layers of qk-norm+rope+kv (same inputs each layer) with cos/sin
from the table `rope_cos_sin` computes once (the "fused" column) against each kernel
computing its own (the "unfused" column); tests/test_kernel_rope_table.py checks their bits.

Run on the GPU box:  OUT=./out python benchmarks/kernels/bench_layers.py [--quick] [--no-compile] [--no-graph]
                     OUT=./out python benchmarks/kernels/bench_layers.py --fused   (the fused table only)
CPU smoke test (Triton's interpreter, tiny T, wall-clock; no numbers to keep):
                     python benchmarks/kernels/bench_layers.py --small
Writes $OUT/bench_layers.json and $OUT/bench_layers.md (tables for docs/benchmarks.md).
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

from rlfuse.engine.benchmark import copy_bandwidth
from rlfuse.kernels import use_backend
from rlfuse.kernels.activation.glu import swiglu, swiglu_ref
from rlfuse.kernels.norm.rms import add_rmsnorm, rmsnorm, rmsnorm_ref
from rlfuse.kernels.rope.rotary import qk_norm_rope, qk_norm_rope_ref, rope, rope_cos_sin, rope_inv_freq, rope_ref

DT = torch.bfloat16
def bench(fn, reps: int) -> float:
    """Median seconds of one call, L2 flushed before each (a 256 MiB write)."""
    return median_seconds(fn, reps, flush_l2=True)


def triton_op(op):
    def run(*args):
        with use_backend("triton"):
            return op(*args)
    return run


def cases(T: int):
    """name -> (public op, reference, make_inputs() -> (args, differentiable args),
    forward bytes, forward+backward bytes)."""
    e = 2  # bf16
    inv = rope_inv_freq(128, 1e6).to("cuda")

    def rms_inputs(n, d):
        def make():
            x = torch.randn(n, d, device="cuda", dtype=DT, requires_grad=True)
            w = torch.randn(d, device="cuda", dtype=DT, requires_grad=True)
            return (x, w, 1e-6), (x, w)
        return make

    def rope_inputs():
        q = torch.randn(T, 16, 128, device="cuda", dtype=DT, requires_grad=True)
        return (q, torch.arange(T, device="cuda"), inv), (q,)

    def swiglu_inputs():
        g = torch.randn(T, 3072, device="cuda", dtype=DT, requires_grad=True)
        u = torch.randn(T, 3072, device="cuda", dtype=DT, requires_grad=True)
        return (g, u), (g, u)

    n_rms, n_qk, n_rope, n_sw = T * 1024, T * 16 * 128, T * 16 * 128, T * 3072
    return {
        # fwd: x + y; bwd: dy, x -> dx (w, r, dw partials are negligible)
        "rmsnorm": (rmsnorm, rmsnorm_ref, rms_inputs(T, 1024), 2 * n_rms * e, 5 * n_rms * e),
        "qk-norm": (rmsnorm, rmsnorm_ref, rms_inputs(T * 16, 128), 2 * n_qk * e, 5 * n_qk * e),
        "rope": (rope, rope_ref, rope_inputs, 2 * n_rope * e, 4 * n_rope * e),  # bwd: dy -> dx
        # fwd: g, u -> y; bwd: dy, g, u -> dg, du
        "swiglu": (swiglu, swiglu_ref, swiglu_inputs, 3 * n_sw * e, 8 * n_sw * e),
    }


def fused_cases(T: int, dev: str):
    """name -> (fused op, unfused op, inputs, differentiable inputs or None,
    (forward bytes, forward + backward bytes))."""
    e = 2  # bf16
    g = torch.Generator().manual_seed(0)

    def rand(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(dev, DT).requires_grad_(grad)

    h, x, w = rand(T, 1024, grad=True), rand(T, 1024, grad=True), rand(1024, grad=True)
    q, k, v, wq, wk = rand(T, 16, 128), rand(T, 8, 128), rand(T, 8, 128), rand(128), rand(128)
    pos, inv = torch.arange(T, device=dev), rope_inv_freq(128, 1e6).to(dev)
    pages = -(-T // 16)
    cache = (torch.zeros(pages, 16, 8, 128, device=dev, dtype=DT), torch.zeros(pages, 16, 8, 128, device=dev, dtype=DT))
    slots = torch.arange(T, device=dev)

    def unfused_add(h, x, w):
        s = h + x
        return s, rmsnorm(s, w, 1e-6)

    qk = (q, k, pos, inv, wq, wk, 1e-6)
    kv = dict(v=v, kv_cache=cache, slot_mapping=slots)
    n_qk = T * 24 * 128

    n = 28 if dev == "cuda" else 2  # a Qwen3-0.6B step's layers (2 in the CPU smoke test)

    def layers(table: bool):  # the step's calls, with or without the step's table
        cs = rope_cos_sin(pos, inv) if table else None
        return [qk_norm_rope(*qk, **kv, cos_sin=cs) for _ in range(n)][-1]
    return {
        # fwd: h, x -> s, y; bwd: ds, dy, s -> dh (= dx)
        "add+rmsnorm": (lambda *a: add_rmsnorm(*a, 1e-6), unfused_add, (h, x, w), (h, x, w),
                        (4 * T * 1024 * e, 8 * T * 1024 * e)),
        "qk-norm+rope": (lambda: qk_norm_rope(*qk), lambda: qk_norm_rope_ref(*qk), (), None, (2 * n_qk * e,)),
        # reads q, k, v; writes q and the cache's k, v
        "qk-norm+rope+kv": (lambda: qk_norm_rope(*qk, **kv), lambda: qk_norm_rope_ref(*qk, **kv), (), None,
                            (2 * (n_qk + T * 8 * 128) * e,)),
        f"x{n}, table vs not": (lambda: layers(True), lambda: layers(False), (), None,
                                (n * 2 * (n_qk + T * 8 * 128) * e,)),
    }


def wall_seconds(fn, reps: int) -> float:
    """Smoke-test timing off the GPU: median wall clock of a call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def fused_rows(reps: int, small: bool, graph: bool) -> list[dict]:
    rows = []
    dev = "cpu" if small else "cuda"
    for T in ([16] if small else [64, 256, 4096]):
        for name, (fused, unfused, inputs, diff, nbytes) in fused_cases(T, dev).items():
            for backward in ((False, True) if diff else (False,)):
                r = dict(op=name, T=T, pass_="fwd+bwd" if backward else "fwd", GB=nbytes[backward] / 1e9)
                for impl, fn in (("fused", fused), ("unfused", unfused)):
                    with use_backend("triton"):
                        step = timed_step(fn, inputs, diff, backward)
                        s = wall_seconds(step, reps) if small else bench(graphed(step) if graph else step, reps)
                    r[f"{impl}_us"] = s * 1e6
                r["speedup"] = r["unfused_us"] / r["fused_us"]
                rows.append(r)
                print(f"T={T:<5d} {name:16s} {r['pass_']:8s} fused {r['fused_us']:8.1f} us  unfused "
                      f"{r['unfused_us']:8.1f} us  x{r['speedup']:.2f}", flush=True)
    return rows


def timed_step(fn, inputs, diff, backward: bool):
    """One call of fn: under no_grad, or forward + autograd.grad of its output(s)."""
    if not backward:
        def step():
            with torch.no_grad():
                return fn(*inputs)
        return step
    out = fn(*inputs)
    douts = [torch.randn_like(o) for o in (out if isinstance(out, tuple) else (out,))]

    def step():
        return torch.autograd.grad(fn(*inputs), diff, douts)
    return step


def timed(fn, inputs, diff, backward: bool, reps: int, graph: bool = True) -> float:
    """Median seconds of one forward (no grad) or forward + backward call. With `graph`,
    the call is captured once in a CUDA graph and the replays are timed: the host's launch
    time drops out (eager fwd+bwd of these ~100 us ops was mostly host time, and the
    device machine's host is noisy: the same kernels measured 350-900 us across runs)."""
    step = timed_step(fn, inputs, diff, backward)
    return bench(graphed(step) if graph else step, reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="T = 16384 only, fewer reps")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-graph", action="store_true", help="time eager calls (host launch time included)")
    ap.add_argument("--fused", action="store_true", help="only the fused-vs-unfused table")
    ap.add_argument("--small", action="store_true", help="CPU smoke test of the fused table (Triton's interpreter)")
    args = ap.parse_args()
    if args.small:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton first loads (the first op)
        fused_rows(2, small=True, graph=False)
        return
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    reps = 10 if args.quick else args.reps
    torch._dynamo.config.cache_size_limit = 64
    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth(torch.device("cuda"), 1 << 30) / 1e9
    print(f"{gpu}: device copy {bw:.0f} GB/s", flush=True)
    rows = []
    for T in ([] if args.fused else [16384] if args.quick else [4096, 16384, 65536]):
        for name, (op, ref, make, fwd_bytes, fb_bytes) in cases(T).items():
            inputs, diff = make()
            impls = {"triton": triton_op(op), "eager": ref}
            if not args.no_compile:
                impls["compile"] = torch.compile(ref, dynamic=False)
            for backward in (False, True):
                nbytes = fb_bytes if backward else fwd_bytes
                r = dict(op=name, T=T, pass_="fwd+bwd" if backward else "fwd", GB=nbytes / 1e9)
                for impl, fn in impls.items():
                    s = timed(fn, inputs, diff, backward, reps, graph=not args.no_graph)
                    r[f"{impl}_us"] = s * 1e6
                    r[f"{impl}_GBps"] = nbytes / s / 1e9
                rows.append(r)
                print(f"T={T:<6d} {name:8s} {r['pass_']:8s} " + "  ".join(
                    f"{i} {r[f'{i}_us']:8.1f} us {r[f'{i}_GBps']:6.0f} GB/s" for i in impls), flush=True)
            del inputs, diff
            torch.cuda.empty_cache()
    fused = fused_rows(reps, small=False, graph=not args.no_graph)
    commit = os.environ.get("RLFUSE_COMMIT") or subprocess.run(  # run_gpu.sh sets it
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cmd = "python benchmarks/kernels/bench_layers.py" + (" --quick" if args.quick else "") + \
        (" --no-compile" if args.no_compile else "") + (" --no-graph" if args.no_graph else "") + \
        (" --fused" if args.fused else "")
    meta = dict(gpu=gpu, torch=torch.__version__, commit=commit, copy_GBps=bw, dtype="bf16", command=cmd)
    (out / "bench_layers.json").write_text(json.dumps(dict(meta=meta, rows=rows, fused=fused), indent=1))
    impls = ["triton", "eager"] + ([] if args.no_compile else ["compile"])
    md = [f"### RMSNorm / RoPE / SwiGLU, Qwen3-0.6B shapes, bf16 ({gpu}, torch {torch.__version__}, commit {commit})",
          "", f"`{cmd}`; device copy {bw:.0f} GB/s; GB/s = minimum bytes moved / time.", "",
          "| op | T | pass | " + " | ".join(f"{i} us (GB/s)" for i in impls) + " |",
          "|---|---|---|" + "---|" * len(impls)]
    md += [f"| {r['op']} | {r['T']} | {r['pass_']} | " + " | ".join(
        f"{r[f'{i}_us']:.1f} ({r[f'{i}_GBps']:.0f})" for i in impls) + " |" for r in rows]
    md += ["", f"### Fused vs unfused decode-path kernels, Triton, bf16 ({gpu}, commit {commit})", "",
           "| op | T | pass | fused us | unfused us | speedup | fused GB/s |", "|---|---|---|---|---|---|---|"]
    md += [f"| {r['op']} | {r['T']} | {r['pass_']} | {r['fused_us']:.1f} | {r['unfused_us']:.1f} | "
           f"{r['speedup']:.2f} | {r['GB'] * 1e6 / r['fused_us']:.0f} |" for r in fused]
    (out / "bench_layers.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
