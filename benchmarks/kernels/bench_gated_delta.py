"""Gated DeltaNet kernels on one GPU, ours against flash-linear-attention (fla-core 0.6, an
optional import of this script only): the chunked gated delta rule forward and
forward+backward over packed varlen batches, and the decode step.

Shapes: Qwen3.5 linear attention (Hk = 16, Hv = 32, Dk = Dv = 128), bf16 q/k/v/beta,
fp32 g; packed batches of 4k / 16k tokens with lengths ~ U[256, 2048] (seed 0), initial
states given. Decode: B = 1 / 32 / 256 sequences, one token each from a state:
  ours fast   fused_recurrent_gated_delta_rule (state updated in place); "slot pool": the
              engine's call, states read and written at each row's slot of a pool
  ours exact  chunk_gated_delta_rule over [buffer + 1 token] from the chunk-boundary
              state (the exact-numerics decode), buffers of 0 / 32 / 63 tokens; "engine":
              the engine's call, [buffer + token] as one 64-row chunk, S_c in a slot pool
  fla         fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule
bound = state read + write (B Hv Dk Dv 4 bytes x 2) at the in-run copy bandwidth.

Backward A/B: `gated_delta_bwd(..., split=True / False)` called directly on the same inputs,
the Dk-split kernels (tensor-core dots, the default at 128-wide heads) against the one-kernel
form (fp32 FMA dots there), each with the fast forward's ms added, and the max gap between
their gradients (max abs / max |one-kernel grad|).

Checks before timing (a timing of a wrong result is not a result): o of each
implementation against our fp32 reference (`chunk_gated_delta_rule_ref`, fast
numerics) on the same inputs, max abs error printed in the `err` column; the gradients
of ours vs FLA on the smallest case. FLA's final state is after the last token (ours
after the last full chunk), so only o is compared.

Run on the GPU box:  OUT=./out python benchmarks/kernels/bench_gated_delta.py [--quick]
Writes $OUT/bench_gated_delta.json and $OUT/bench_gated_delta.md. `--smoke` runs the whole
script on CPU (Triton interpreted, tiny heads, wall-clock times that mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time
from pathlib import Path

import torch
from _timing import median_seconds  # benchmarks/kernels/_timing.py (the script's directory)

from rlfuse.engine.benchmark import copy_bandwidth
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.backend import triton_ops
from rlfuse.kernels.gated_delta import (
    CHUNK,
    chunk_gated_delta_decode,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_ref,
    fused_recurrent_gated_delta_rule,
)

HK, HV, DK, DV = 16, 32, 128, 128
DT = torch.bfloat16
DEV = "cuda"


def timed(fn, reps: int) -> float:
    """Median seconds per call (CUDA events, L2 flushed); wall clock for the CPU smoke run."""
    if DEV == "cuda":
        return median_seconds(fn, reps, flush_l2=True)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def lengths(total: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    out = []
    while sum(out) < total:
        out.append(rng.randint(lo, hi))
    out[-1] -= sum(out) - total
    return [n for n in out if n > 0]


def inputs(lens, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T, B = sum(lens), len(lens)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    q, k, v = r(T, HK, DK).to(DT), r(T, HK, DK).to(DT), r(T, HV, DV).to(DT)
    g = -torch.rand(T, HV, device=DEV, generator=gen) * 0.5
    beta = torch.rand(T, HV, device=DEV, generator=gen).sigmoid().to(DT)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    s0 = r(B, HV, DK, DV) * 0.1
    return q, k, v, g, beta, cu, s0


def fp32_ref(args):
    """Our torch reference's o in fp32 (v passed as fp32: the same values, no output rounding)."""
    q, k, v, g, beta, cu, s0 = args
    return chunk_gated_delta_rule_ref(q, k, v.float(), g, beta, cu, initial_state=s0, exact=False)[0]


def load_fla():
    try:  # optional peer: the table says "not installed" instead
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    except ImportError as e:
        print(f"flash-linear-attention not importable ({e}); its columns stay empty")
        return None, None
    return fla_chunk, fla_recurrent


def ours(numerics):
    def fn(q, k, v, g, beta, cu, s0):
        with use_backend("triton"), use_numerics(numerics):
            return chunk_gated_delta_rule(q, k, v, g, beta, cu, initial_state=s0, output_final_state=True)[0]
    return fn


def fla_fn(fla_chunk):
    def fn(q, k, v, g, beta, cu, s0):
        o, _ = fla_chunk(q[None], k[None], v[None], g[None], beta[None], initial_state=s0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long())
        return o[0]
    return fn


def fwd_bwd(fn, args, do):
    leaves = [a.detach().requires_grad_() if a.is_floating_point() else a for a in args]
    o = fn(*leaves)
    grads = torch.autograd.grad(o, [x for x in leaves if x.requires_grad], do)
    return o, grads


def prefill_rows(fla_chunk, totals, reps):
    rows = []
    for total in totals:
        lens = lengths(total, 256, 2048) if DEV == "cuda" else lengths(total, 20, 150)
        args = inputs(lens)
        ref = fp32_ref(args)
        do = torch.randn_like(args[2])
        impls = {"ours fast": ours("fast"), "ours exact": ours("exact")}
        if fla_chunk is not None:
            impls["fla"] = fla_fn(fla_chunk)
        for name, fn in impls.items():
            with torch.no_grad():
                err = (fn(*args).float() - ref).abs().max().item()
            t_fwd = timed(lambda: fn(*args), reps)
            try:
                t_fb = timed(lambda: fwd_bwd(fn, args, do), max(3, reps // 4))
            except RuntimeError as e:  # FLA 0.6 refuses its backward on Hopper under Triton < 3.7.1 (fla#640)
                print(f"{name} backward refused: {str(e).splitlines()[0][:160]}")
                t_fb = float("nan")
            rows.append(dict(case=f"T={total} ({len(lens)} seqs)", impl=name, err=err, fwd_ms=t_fwd * 1e3,
                             fwd_bwd_ms=t_fb * 1e3))
    return rows


def backward_ab_rows(totals, reps):
    """Our backward both ways (split over Dk / one kernel) on the same inputs: ms, and the
    forward + backward ms with the fast forward's time added."""
    bwd = triton_ops("gated_delta.triton_chunk_bwd").gated_delta_bwd
    rows = []
    for total in totals:
        lens = lengths(total, 256, 2048) if DEV == "cuda" else lengths(total, 20, 150)
        q, k, v, g, beta, cu, s0 = args = inputs(lens)
        do = torch.randn_like(v)
        t_fwd = timed(lambda: ours("fast")(*args), reps)
        grads = {}
        for split in (False, True):
            def fn():
                return bwd(q, k, v, g, beta, cu, s0, DK ** -0.5, do, None, split=split)
            grads[split] = fn()
            t = timed(fn, reps)
            gap = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
                      for a, b in zip(grads[split], grads[False]))
            rows.append(dict(case=f"T={total} ({len(lens)} seqs)",
                             impl="split over Dk (tensor cores)" if split else "one kernel (fp32 FMA at Dk 128)",
                             bwd_ms=t * 1e3, fwd_bwd_ms=(t + t_fwd) * 1e3, gap=gap))
    return rows


def grad_check(fla_chunk):
    """Gradients of ours (fast, bf16) on one small batch against our fp32 torch reference
    (inputs upcast) and against FLA's: max abs difference per input, relative to the other
    side's max. FLA's column stays empty where FLA refuses its backward."""
    args = inputs(lengths(2048 if DEV == "cuda" else 200, 256 if DEV == "cuda" else 20, 1024), seed=1)
    do = torch.randn_like(args[2])
    names = ["q", "k", "v", "g", "beta", "s0"]
    _, g_ours = fwd_bwd(ours("fast"), args, do)

    def ref(q, k, v, g, beta, cu, s0):
        return chunk_gated_delta_rule_ref(q.float(), k.float(), v.float(), g, beta.float(), cu, initial_state=s0,
                                          exact=False)[0]
    gap = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()  # noqa: E731
    _, g_ref = fwd_bwd(ref, args, do.float())
    out = {f"{n} vs fp32 ref": gap(a, b) for n, a, b in zip(names, g_ours, g_ref)}
    if fla_chunk is not None:
        try:
            _, g_fla = fwd_bwd(fla_fn(fla_chunk), args, do)
            out.update({f"{n} vs FLA": gap(a, b) for n, a, b in zip(names, g_ours, g_fla)})
        except RuntimeError as e:
            out["FLA backward"] = str(e).splitlines()[0][:120]
    return out


def decode_rows(fla_recurrent, batches, reps, bw):
    rows = []
    for B in batches:
        args = inputs([1] * B, seed=2)
        q, k, v, g, beta, cu, s0 = args
        ref = fp32_ref(args)
        state = s0.clone()

        def fast():
            with use_backend("triton"), use_numerics("fast"):
                return fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu, initial_state=state, state_out=state)[0]

        # the engine's static decode call: states in a pool of slots (B + 1: the scratch slot),
        # read and written in place at each row's slot (here reversed, as slots come unordered)
        pool = torch.cat([s0, s0[:1]]).contiguous()
        slots = torch.arange(B - 1, -1, -1, device=s0.device)
        pool[slots] = s0

        def fast_pool():
            with use_backend("triton"), use_numerics("fast"):
                return fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu, initial_state=pool,
                                                        state_slots=slots)[0]

        impls = {"ours fast (recurrent)": fast, "ours fast (recurrent, slot pool)": fast_pool}
        if fla_recurrent is not None:
            impls["fla (recurrent)"] = lambda: fla_recurrent(
                q[None], k[None], v[None], g[None], beta[None], initial_state=s0, output_final_state=True,
                use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long())[0][0]
        bound = 2 * B * HV * DK * DV * 4 / bw
        for name, fn in impls.items():
            state.copy_(s0)
            pool[slots] = s0
            err = (fn().float() - ref).abs().max().item()
            t = timed(fn, reps)
            rows.append(dict(case=f"decode B={B}", impl=name, err=err, us=t * 1e6, bound_us=bound * 1e6))
        for buf in (0, 32, 63):  # exact decode: one chunk call over [buffer + token] per sequence
            bargs = inputs([buf + 1] * B, seed=3)
            t = timed(lambda: ours("exact")(*bargs), reps)
            rows.append(dict(case=f"decode B={B}", impl=f"ours exact (chunk, buffer {buf})", err=float("nan"),
                             us=t * 1e6, bound_us=bound * 1e6))
        # the engine's exact decode call (chunk_gated_delta_decode): each row's [tail + token]
        # as one 64-row chunk read in its slot's tail, S_c read from and written to its slot in
        # place, moved on where the token ends a chunk; tails of 0..63 rows across the batch
        tails = [torch.zeros(B + 1, CHUNK, *x.shape[1:], dtype=x.dtype, device=DEV) for x in (q, k, v, g, beta)]
        for x, src in zip(tails, inputs([CHUNK] * (B + 1), seed=4)[:5]):
            x.copy_(src.view(x.shape))
        tail_lens = torch.arange(B, device=DEV) % CHUNK

        def exact_slots():
            with use_backend("triton"), use_numerics("exact"):
                return chunk_gated_delta_decode(tails, pool, slots, tail_lens)
        t = timed(exact_slots, reps)
        rows.append(dict(case=f"decode B={B}", impl="ours exact (engine: 64-row chunk, slot pool)", err=float("nan"),
                         us=t * 1e6, bound_us=bound * 1e6))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one prefill size, two decode batches, fewer reps")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke test of the script (tiny heads, interpreter)")
    a = ap.parse_args()
    if a.smoke:
        global HK, HV, DK, DV, DEV
        HK, HV, DK, DV, DEV = 1, 2, 16, 8, "cpu"
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (by the first op)
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    fla_chunk, fla_recurrent = load_fla()
    reps = 5 if a.quick else 20
    bw = copy_bandwidth(torch.device(DEV), 1 << (20 if a.smoke else 30))
    quick = a.quick or a.smoke
    prefill = prefill_rows(fla_chunk, [300 if a.smoke else 4096] if quick else [4096, 16384], reps)
    backward = backward_ab_rows([300 if a.smoke else 4096] if quick else [4096, 16384], reps)
    grads = grad_check(fla_chunk)
    decode = decode_rows(fla_recurrent, [1, 3 if a.smoke else 256] if quick else [1, 32, 256], reps, bw)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = dict(gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)", torch=torch.__version__,
                commit=commit, shapes=dict(Hk=HK, Hv=HV, Dk=DK, Dv=DV, dtype=str(DT)), copy_GBps=bw / 1e9)
    lines = [f"GPU {meta['gpu']}, commit {commit}, Hk={HK} Hv={HV} Dk={DK} Dv={DV} bf16", "",
             "| case | impl | max err vs fp32 ref | fwd ms | fwd+bwd ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['impl']} | {r['err']:.2e} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} |"
              for r in prefill]
    lines += ["", "| case | our backward | bwd ms | fwd (fast) + bwd ms | max grad gap vs one kernel |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['impl']} | {r['bwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {r['gap']:.1e} |"
              for r in backward]
    lines += ["", "gradient gap of ours (max abs / max |other grad|): " +
              ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k}: {v}" for k, v in grads.items()), "",
              "| case | impl | max err vs fp32 ref | us | state bound us |", "|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['impl']} | {r['err']:.2e} | {r['us']:.1f} | {r['bound_us']:.1f} |" for r in decode]
    table = "\n".join(lines)
    print(table)
    (out / "bench_gated_delta.md").write_text(table + "\n")
    (out / "bench_gated_delta.json").write_text(json.dumps(dict(meta=meta, prefill=prefill, backward=backward, grads=grads,
                                                                decode=decode), indent=1))


if __name__ == "__main__":
    main()
