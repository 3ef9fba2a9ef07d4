"""Fused linear log-prob: time and memory of forward+backward against the usual ways of
getting per-token log-probs from hidden states, bf16.

    ours     rlfuse.kernels.loss.logprob.token_logprobs (Triton), loss = -sum(logp)
    torch    logits = h @ W^T (bf16) -> log_softmax in fp32 -> gather, loss = -sum
    liger    liger_kernel LigerFusedLinearCrossEntropyLoss(reduction="none"), loss = sum
    cce      cut_cross_entropy.linear_cross_entropy(reduction="none") with its defaults
             (note: its default gradient filtering skips vocab blocks with tiny
             probabilities, so its backward is not exact)
At temperature 1, log-prob = -cross entropy: all four compute the same quantity.
Shapes: (D, V) in {(1024, 151936) Qwen3-0.6B, (4096, 128256) Llama-3-8B}, N = G * 512 rows
for G in {8, 32, 64, 128, 256}. Time: median of --reps CUDA-event timings after a warm-up.
Peak: max_memory_allocated during forward+backward minus the memory held before (inputs);
it includes dH and dW themselves (N*D + V*D bf16), the same for every column. A column
whose package is not installed is skipped; a run out of memory prints "OOM".
--decode: forward only, N in {1, 8, 64, 256}, ours vs torch, with the GB/s of reading W.
--sweep: forward tile shapes of ours at G=32 and N=8 (to pick logprob._FWD_TILES).
--target: only the issue's case, D=1024, V=151936, G=8 (peak extra GiB <= 0.5, faster than
liger and cce), in a few seconds.

Run on the GPU box:  OUT=./out python benchmarks/kernels/bench_logprob.py [--quick] [--decode] [--sweep]
Writes $OUT/bench_logprob.json and $OUT/bench_logprob.md (a table for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
from pathlib import Path

import torch
from _timing import median_seconds  # benchmarks/kernels/_timing.py (the script's directory)

from rlfuse.kernels import use_backend
from rlfuse.kernels.loss.logprob import token_logprobs
from rlfuse.kernels.loss.triton_logprob import Tiles, token_logprobs_fwd_triton

DT = torch.bfloat16
SHAPES = [(1024, 151936), (4096, 128256)]


def timeit(fn, reps: int) -> float:
    return median_seconds(fn, reps, warmup=1)


def impls():
    def ours(h, w, y):
        with use_backend("triton"):
            return -token_logprobs(h, w, y).sum()

    def naive(h, w, y):
        logits = h @ w.t()
        return -torch.log_softmax(logits.float(), -1).gather(1, y[:, None]).sum()

    out = {"ours": ours, "torch": naive}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss(reduction="none")
        out["liger"] = lambda h, w, y: liger(w, h, y).sum()
    except ImportError:
        print("liger_kernel not installed: column skipped")
    try:
        from cut_cross_entropy import linear_cross_entropy
        out["cce"] = lambda h, w, y: linear_cross_entropy(h, w, y, reduction="none").sum()
    except ImportError:
        print("cut_cross_entropy not installed: column skipped")
    return out


def cell(res) -> str:
    if isinstance(res, str):
        return res
    return "OOM" if res is None else f"{res['ms']:.1f} ({res['peak_GiB']:.2f})"


def run_one(fn, h, w, y, reps, strict: bool):
    """-> (seconds, peak extra GiB) of forward+backward, None on OOM, "ERR" when a peer
    package fails (printed; `strict` re-raises: ours must not fail)."""
    def step():
        loss = fn(h, w, y)
        torch.autograd.grad(loss, (h, w))
    torch.cuda.empty_cache()
    try:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        return timeit(step, reps), peak
    except torch.cuda.OutOfMemoryError:
        return None
    except Exception as e:
        if strict:
            raise
        print(f"  peer failed: {type(e).__name__}: {str(e)[:200]}")
        return "ERR"
    finally:
        torch.cuda.empty_cache()


def make(N, D, V, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(N, D, device="cuda", generator=g).to(DT).requires_grad_()
    w = (torch.randn(V, D, device="cuda", generator=g) * D ** -0.5).to(DT).requires_grad_()
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    return h, w, y


def train_table(groups, reps, shapes):
    fns = impls()
    rows = []
    for D, V in shapes:
        for G in groups:
            N = G * 512
            h, w, y = make(N, D, V)
            tflop = 4 * 2 * N * V * D / 1e12  # fwd + recompute + dH + dW matmuls (ours)
            r = dict(D=D, V=V, G=G, N=N)
            for name, fn in fns.items():
                res = run_one(fn, h, w, y, reps, strict=name == "ours")
                r[name] = res if res is None or isinstance(res, str) else dict(ms=res[0] * 1e3, peak_GiB=res[1])
            r["ours_TFLOPs"] = tflop / (r["ours"]["ms"] / 1e3) if r["ours"] else None
            rows.append(r)
            print(f"D={D:5d} V={V} G={G:4d} N={N:7d}  " + "  ".join(f"{k} {cell(r[k])}" for k in fns)
                  + (f"  ours {r['ours_TFLOPs']:.0f} TFLOP/s" if r["ours"] else ""), flush=True)
            del h, w, y
    return list(fns), rows


def decode_table(reps):
    rows = []
    for D, V in SHAPES:
        for N in (1, 8, 64, 256):
            h, w, y = make(N, D, V)
            h, w = h.detach(), w.detach()
            T = torch.full((N,), 0.8, device="cuda")
            with torch.no_grad(), use_backend("triton"):
                t_ours = timeit(lambda: token_logprobs(h, w, y, T), reps)
                t_torch = timeit(lambda: torch.log_softmax((h @ w.t()).float() / T[:, None], -1).gather(1, y[:, None]),
                                 reps)
            gb = V * D * 2 / 1e9
            rows.append(dict(D=D, V=V, N=N, ours_us=t_ours * 1e6, torch_us=t_torch * 1e6,
                             ours_GBps=gb / t_ours, torch_GBps=gb / t_torch))
            print(f"decode D={D} V={V} N={N:4d}  ours {t_ours * 1e6:8.1f} us ({gb / t_ours:5.0f} GB/s of W)  "
                  f"torch {t_torch * 1e6:8.1f} us", flush=True)
    return rows


SWEEP = [Tiles(), Tiles(num_warps=8), Tiles(block_v=256, num_warps=8), Tiles(block_n=128, num_warps=8),
         Tiles(block_n=128, block_v=256, num_warps=8), Tiles(num_stages=4),
         Tiles(block_d=128, num_stages=2), Tiles(split_v=512, group=32)]
# (128 x 256 spills in Triton 3.9's offline sm_90 build; kept to measure what it costs)


def sweep_table(reps):
    rows = []
    for D, V in SHAPES:
        for N in (8, 32 * 512):
            h, w, y = make(N, D, V)
            h, w = h.detach(), w.detach()
            inv_t = torch.tensor(1.0)
            for t in SWEEP:
                try:
                    s = timeit(lambda: token_logprobs_fwd_triton(h, w, y, inv_t, tiles=t), reps)
                except Exception as e:  # noqa: BLE001 -- a shape that does not compile (shared memory) is reported, not fatal
                    print(f"sweep {t}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                rows.append(dict(D=D, V=V, N=N, tiles=dataclasses.asdict(t), ms=s * 1e3,
                                 TFLOPs=2 * N * V * D / s / 1e12))
                print(f"sweep D={D} N={N:6d} {t}: {s * 1e3:8.3f} ms {2 * N * V * D / s / 1e12:6.0f} TFLOP/s",
                      flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="G in {8, 64} only, 3 reps")
    ap.add_argument("--decode", action="store_true", help="also the small-N forward table")
    ap.add_argument("--sweep", action="store_true", help="also the forward tile sweep")
    ap.add_argument("--target", action="store_true", help="only D=1024, V=151936, G=8")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    reps = 3 if args.quick else args.reps
    gpu = torch.cuda.get_device_name()
    print(gpu, "torch", torch.__version__, flush=True)
    groups = [8] if args.target else [8, 64] if args.quick else [8, 32, 64, 128, 256]
    names, rows = train_table(groups, reps, SHAPES[:1] if args.target else SHAPES)
    dec = decode_table(max(reps, 20)) if args.decode else []
    sw = sweep_table(reps) if args.sweep else []
    commit = os.environ.get("RLFUSE_COMMIT") or subprocess.run(  # run_gpu.sh sets it
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cmd = "python benchmarks/kernels/bench_logprob.py" + "".join(
        f" --{k}" for k in ("quick", "decode", "sweep", "target") if getattr(args, k))
    meta = dict(gpu=gpu, torch=torch.__version__, commit=commit, dtype="bf16", command=cmd)
    (out / "bench_logprob.json").write_text(json.dumps(dict(meta=meta, train=rows, decode=dec, sweep=sw), indent=1))
    md = [f"### Fused linear log-prob, forward+backward, bf16 ({gpu}, torch {torch.__version__}, commit {commit})",
          "", f"`{cmd}`; ms (peak extra GiB incl. dH, dW); seq 512, N = G*512.", "",
          "| D | V | G | " + " | ".join(names) + " | ours TFLOP/s |", "|---|---|---|" + "---|" * (len(names) + 1)]
    for r in rows:
        cells = [cell(r[k]) for k in names]
        tf = f"{r['ours_TFLOPs']:.0f}" if r["ours_TFLOPs"] else "-"
        md.append(f"| {r['D']} | {r['V']} | {r['G']} | " + " | ".join(cells) + f" | {tf} |")
    if dec:
        md += ["", "| D | V | N (decode fwd) | ours us (GB/s of W) | torch us |", "|---|---|---|---|---|"]
        md += [f"| {r['D']} | {r['V']} | {r['N']} | {r['ours_us']:.1f} ({r['ours_GBps']:.0f}) | {r['torch_us']:.1f} |"
               for r in dec]
    (out / "bench_logprob.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    for r in rows:  # the target: G = 8, D = 1024, V = 151936
        if (r["D"], r["V"], r["G"]) == (1024, 151936, 8) and isinstance(r["ours"], dict):
            peers = ", ".join(f"{k} {cell(r[k])}" for k in names if k not in ("ours", "torch"))
            print(f"target G=8 D=1024: ours {cell(r['ours'])} ms (peak extra GiB), target peak <= 0.5 GiB and "
                  f"faster than liger and cce; peers: {peers or 'not installed'}")


if __name__ == "__main__":
    main()
