"""Attention kernels on one GPU: varlen flash attention (fwd, fwd+bwd) and paged decode.

Varlen: Qwen3-0.6B heads (Hq=16, Hkv=8, Dh=128), bf16, packed batches of 16k/32k/64k
tokens with lengths ~ U[100, 1024] and U[1024, 4096] (seed 0). Useful causal FLOPs:
    fwd = 4 * sum(L_i^2) / 2 * Hq * Dh,   bwd = 2.5 * fwd,   fwd+bwd = 3.5 * fwd
(padding work of the baselines is not counted, so padding shows as lower TFLOP/s).
Baselines: scaled_dot_product_attention (flash backend) on the batch padded to the
longest sequence with is_causal (K/V repeated to Hq outside the timing), FlexAttention
(compiled) with a document-causal block mask, and the bf16 matmul ceiling (8192^3).
Paged decode: batch 1..256 x context 512..4096, block size 16, random block tables;
time per call (eager and CUDA-graph replay), bytes = K+V of every context + q + o,
achieved GB/s vs an in-run device copy (read + write bytes / time).
--sweep also times alternative tile settings for the varlen kernels (tuning input).

Run on the GPU box:  OUT=./out python benchmarks/kernels/bench_attention.py [--quick] [--sweep]
Writes $OUT/bench_attention.json and $OUT/bench_attention.md (a table for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _timing import median_seconds  # benchmarks/kernels/_timing.py (the script's directory)

from rlfuse.engine.benchmark import copy_bandwidth
from rlfuse.kernels import use_backend
from rlfuse.kernels.attention.triton_paged import paged_attention_triton
from rlfuse.kernels.attention.triton_varlen import varlen_bwd, varlen_fwd
from rlfuse.kernels.attention.varlen import varlen_attention

HQ, HKV, DH = 16, 8, 128
DT = torch.bfloat16


def bench(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, timed with CUDA events (each call timed on its own)."""
    return median_seconds(fn, reps, warmup=warmup)


def lengths(total: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    out = []
    while sum(out) < total:
        out.append(rng.randint(lo, hi))
    out[-1] -= sum(out) - total  # exact total; the last one may be shorter
    return [n for n in out if n > 0]


def matmul_ceiling() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=DT)
    b = torch.randn(8192, 8192, device="cuda", dtype=DT)
    return 2 * 8192**3 / bench(lambda: a @ b) / 1e12


@functools.cache
def _flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention)  # compiled once; recompiles per shape are part of set-up


def _try(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- a baseline that fails is reported in the table, not fatal
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def varlen_case(lens: list[int], with_flex: bool) -> dict:
    T, B, Lmax = sum(lens), len(lens), max(lens)
    flops = 4 * sum(n * n for n in lens) / 2 * HQ * DH
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(T, h, DH, device="cuda", dtype=DT, generator=g) for h in (HQ, HKV, HKV, HQ))
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
    scale = DH ** -0.5
    row = {"tokens": T, "seqs": B, "max_len": Lmax, "fwd_gflop": flops / 1e9}

    row["ours_fwd"] = flops / bench(lambda: varlen_fwd(q, k, v, cu, Lmax, scale)) / 1e12
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    with use_backend("triton"):  # through autograd, like the baselines
        row["ours_fwdbwd"] = 3.5 * flops / bench(lambda: torch.autograd.grad(
            varlen_attention(qg, kg, vg, cu, Lmax, scale), (qg, kg, vg), do)) / 1e12

    qp = kp = vp = dop = None
    try:  # padded copies for SDPA, K/V repeated to Hq (set-up, not timed)
        qp = torch.zeros(B, HQ, Lmax, DH, device="cuda", dtype=DT)
        kp, vp = torch.zeros_like(qp), torch.zeros_like(qp)
        for i, (s, e) in enumerate(zip(cu.tolist()[:-1], cu.tolist()[1:])):  # host sync: set-up only
            qp[i, :, :e - s] = q[s:e].transpose(0, 1)
            kp[i, :, :e - s] = k[s:e].transpose(0, 1).repeat_interleave(HQ // HKV, 0)
            vp[i, :, :e - s] = v[s:e].transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        qp.requires_grad_(), kp.requires_grad_(), vp.requires_grad_()
        dop = torch.randn_like(qp)
    except torch.OutOfMemoryError as e:
        row["sdpa_pad_fwd"] = row["sdpa_pad_fwdbwd"] = f"error: {e}"
    if dop is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
        row["sdpa_pad_fwd"] = _try(lambda: flops / bench(sdpa) / 1e12)
        row["sdpa_pad_fwdbwd"] = _try(lambda: 3.5 * flops / bench(
            lambda: torch.autograd.grad(sdpa(), (qp, kp, vp), dop)) / 1e12)
        del qp, kp, vp, dop

    if with_flex:
        from torch.nn.attention.flex_attention import create_block_mask
        doc = torch.repeat_interleave(torch.arange(B, device="cuda"), torch.tensor(lens, device="cuda"))

        def doc_causal(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (qi >= ki)

        mask = create_block_mask(doc_causal, None, None, T, T, device="cuda")
        qf, kf, vf = (x.transpose(0, 1)[None].contiguous().requires_grad_() for x in (q, k, v))
        dof = do.transpose(0, 1)[None].contiguous()

        def flex():
            return _flex()(qf, kf, vf, block_mask=mask, scale=scale, enable_gqa=True)
        row["flex_fwd"] = _try(lambda: flops / bench(flex) / 1e12)
        row["flex_fwdbwd"] = _try(lambda: 3.5 * flops / bench(
            lambda: torch.autograd.grad(flex(), (qf, kf, vf), dof)) / 1e12)
    else:
        row["flex_fwd"] = row["flex_fwdbwd"] = "skipped"
    return row


def decode_case(batch: int, ctx: int, page: int = 16) -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    width = ctx // page
    n_blocks = batch * width + 8
    kc = torch.randn(n_blocks, page, HKV, DH, device="cuda", dtype=DT, generator=g)
    vc = torch.randn_like(kc)
    bt = torch.randperm(n_blocks, device="cuda", generator=g)[:batch * width].view(batch, width).to(torch.int32)
    q = torch.randn(batch, HQ, DH, device="cuda", dtype=DT, generator=g)
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    nbytes = 2 * batch * ctx * HKV * DH * kc.element_size() + 2 * q.numel() * q.element_size()
    row = {"batch": batch, "ctx": ctx, "MB": nbytes / 1e6}
    for name, ns in (("auto", None), ("nosplit", 1)):
        f = lambda: paged_attention_triton(q, kc, vc, cu, sl, bt, 1, out=out, num_splits=ns)  # noqa: E731
        row[f"{name}_us"] = bench(f, reps=50) * 1e6
        row[f"{name}_GBs"] = nbytes / row[f"{name}_us"] / 1e3
    f = lambda: paged_attention_triton(q, kc, vc, cu, sl, bt, 1, out=out)  # noqa: E731
    f()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        f()
    row["graph_us"] = bench(graph.replay, reps=50) * 1e6
    row["graph_GBs"] = nbytes / row["graph_us"] / 1e3
    return row


def sweep(lens: list[int], fwd: bool = True) -> list[dict]:
    T, Lmax = sum(lens), max(lens)
    flops = 4 * sum(n * n for n in lens) / 2 * HQ * DH
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(T, h, DH, device="cuda", dtype=DT, generator=g) for h in (HQ, HKV, HKV, HQ))
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
    o, lse = varlen_fwd(q, k, v, cu, Lmax, DH ** -0.5)
    rows = []
    for bm in (64, 128) if fwd else ():
        for bn in (32, 64, 128):
            for w in (4, 8):
                for st in (2, 3, 4):
                    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
                    r = _try(lambda: flops / bench(lambda: varlen_fwd(q, k, v, cu, Lmax, DH ** -0.5, config=cfg)) / 1e12)
                    rows.append({"kernel": "fwd", **cfg, "tflops": r})
    for kern, bms, bns in (("dkdv", (16, 32, 64), (64, 128)), ("dq", (64, 128), (32, 64))):
        for bm in bms:
            for bn in bns:
                for w in (4, 8):
                    for st in (2, 3) if not fwd else (1, 2, 3):
                        cfg = {kern: dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)}
                        r = _try(lambda: 2.5 * flops / bench(
                            lambda: varlen_bwd(do, q, k, v, o, lse, cu, Lmax, DH ** -0.5, config=cfg)) / 1e12)
                        rows.append({"kernel": f"bwd[{kern}]", **cfg[kern], "tflops": r})
    return rows


def fmt(x) -> str:
    return f"{x:.1f}" if isinstance(x, float) else str(x)[:40]  # errors in full in the JSON


def table(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32k tokens only, decode batch {1, 64}")
    ap.add_argument("--sweep", action="store_true", help="also time alternative varlen tile settings")
    ap.add_argument("--sweep-bwd", action="store_true", help="only the backward kernels' tile sweep (smaller)")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes minutes)")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    commit = os.environ.get("RLFUSE_COMMIT") or subprocess.run(  # run_gpu.sh sets it
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit or "unknown",
            "heads": [HQ, HKV, DH], "dtype": "bf16"}
    import triton
    meta["triton"] = triton.__version__
    meta["matmul_tflops"] = matmul_ceiling()
    meta["copy_GBs"] = copy_bandwidth(torch.device("cuda"), 1 << 30) / 1e9
    print(f"{meta['gpu']}: matmul 8192^3 bf16 {meta['matmul_tflops']:.0f} TFLOP/s, copy {meta['copy_GBs']:.0f} GB/s",
          flush=True)

    totals = (32768,) if args.quick else (16384, 32768, 65536)
    if args.sweep_bwd:  # the backward sweep alone: no main tables
        totals = ()
    varlen_rows = []
    for lo, hi in ((100, 1024), (1024, 4096)):
        for total in totals:
            row = {"lengths": f"U[{lo},{hi}]", **varlen_case(lengths(total, lo, hi), not args.no_flex)}
            varlen_rows.append(row)
            print(f"  varlen {row['lengths']} T={total}: ours fwd {fmt(row['ours_fwd'])} fwd+bwd "
                  f"{fmt(row['ours_fwdbwd'])} TFLOP/s ({time.time() - t0:.0f}s)", flush=True)

    batches = () if args.sweep_bwd else (1, 64) if args.quick else (1, 4, 16, 64, 256)
    decode_rows = []
    for b in batches:
        for ctx in (512, 1024, 2048, 4096):
            decode_rows.append(decode_case(b, ctx))
    for r in decode_rows:
        r["graph_pct_copy"] = 100 * r["graph_GBs"] / meta["copy_GBs"]

    sweep_rows = sweep(lengths(32768, 1024, 4096), fwd=not args.sweep_bwd) if args.sweep or args.sweep_bwd else []

    vcols = ["lengths", "tokens", "seqs", "max_len", "ours_fwd", "sdpa_pad_fwd", "flex_fwd",
             "ours_fwdbwd", "sdpa_pad_fwdbwd", "flex_fwdbwd"]
    dcols = ["batch", "ctx", "MB", "auto_us", "nosplit_us", "graph_us", "auto_GBs", "graph_GBs", "graph_pct_copy"]
    md = [f"## Attention kernels ({meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']})",
          "", f"`OUT=./out python benchmarks/kernels/bench_attention.py {' '.join(sys.argv[1:])}`; "
          f"Hq={HQ} Hkv={HKV} Dh={DH} bf16. Matmul ceiling {meta['matmul_tflops']:.0f} TFLOP/s, "
          f"copy {meta['copy_GBs']:.0f} GB/s.", "",
          "Varlen causal attention, TFLOP/s of useful causal FLOPs:", "", table(varlen_rows, vcols), "",
          "Paged decode (block size 16), µs per call and GB/s of K+V read:", "", table(decode_rows, dcols)]
    if sweep_rows:
        md += ["", "Tile sweep (32k tokens, U[1024,4096]), TFLOP/s:", "",
               table(sweep_rows, ["kernel", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "tflops"])]
    text = "\n".join(md)
    (out / "bench_attention.md").write_text(text + "\n")
    (out / "bench_attention.json").write_text(json.dumps(
        {"meta": meta, "varlen": varlen_rows, "decode": decode_rows, "sweep": sweep_rows}, indent=1))
    print(text)
    print(f"done in {time.time() - t0:.0f}s; wrote {out / 'bench_attention.json'}")


if __name__ == "__main__":
    main()
