"""Compile the fused log-prob and policy-loss kernels for sm_90 without a GPU.

triton.compile with GPUTarget("cuda", 90) at the launchers' settings (and the --sweep
tile shapes of bench_logprob.py), then `ptxas -v` on the PTX: registers per thread,
spill bytes, shared memory, and whether tl.dot became wgmma. Exits 1 on a compile error
or a spill in a default configuration. Also compiles with N = 1 as a constexpr (Triton
specializes an int argument equal to 1), the engine's batch-of-one case.

Run (CPU is fine; TRITON_INTERPRET must be unset):
    env -u TRITON_INTERPRET python benchmarks/kernels/compile_logprob_sm90.py
"""

from __future__ import annotations

import os
import sys

import triton

from _sm90 import compile_sm90  # benchmarks/kernels/_sm90.py (the script's directory)
from rlfuse.kernels import logprob as L
from rlfuse.kernels import policy_loss as PL

# int arguments a real launch sees as multiples of 16 (Triton specializes those): strides
# and sizes of the benchmark shapes (D = 1024/4096, V = 151936/128256, N = G * 512)
DIV16 = {"N", "V", "D", "NP", "s_hn", "s_wv", "s_dz", "s_dw", "row0", "n_rows", "K"}


def compile_one(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int = 3) -> dict:
    """types: arg name -> triton type for pointers and non-i32 scalars (others i32). Pointer
    arguments and DIV16 ints carry the divisibility-by-16 hint a launch would give them."""
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in constexprs and (sig[n].startswith("*") or n in DIV16)}
    k, ptx, regs, spill = compile_sm90(fn, sig, constexprs, dict(num_warps=num_warps, num_stages=num_stages), attrs)
    return dict(smem=k.metadata.shared, regs=regs, spill=spill, wgmma=ptx.count("wgmma.mma_async"), mma=ptx.count("mma.sync"))


def jobs():
    for dt, tdt in (("bf16", L.torch.bfloat16), ("fp32", L.torch.float32)):
        p = "*" + dt
        prec = "ieee" if dt == "fp32" else "tf32"
        lp = dict(H=p, W=p, Y="*i64", INVT="*fp32", PART="*fp32", inv_t_scalar="fp32")
        unit = dict(s_hd=1, s_wd=1)  # the launchers pass rows with unit element stride
        t = L._FWD_TILES[tdt]
        sweep = [(f"sweep{i}", s, False) for i, s in enumerate(L_SWEEP)] if dt == "bf16" else []
        configs = [("default", t, True)] + sweep
        for tag, t, strict in configs:
            for fold in (1, t.group):
                ce = dict(PER_ROW_T=True, ENTROPY=True, FOLD=fold, SPLIT_V=t.split_v, BLOCK_N=t.block_n,
                          BLOCK_V=t.block_v, BLOCK_D=t.block_d, EVEN_D=True, GROUP_R=8, DOT_PREC=prec, **unit)
                yield f"fwd {tag} fold={fold} {dt} {t.block_n}x{t.block_v}x{t.block_d} w{t.num_warps}", \
                    L._fwd_kernel, lp, ce, t.num_warps, t.num_stages, strict
        t = L._FWD_TILES[tdt]
        ce = dict(PER_ROW_T=False, ENTROPY=False, FOLD=1, SPLIT_V=t.split_v, BLOCK_N=t.block_n, BLOCK_V=t.block_v,
                  BLOCK_D=t.block_d, EVEN_D=True, GROUP_R=8, DOT_PREC=prec, N=1, P=1, NP=1, **unit)
        yield f"fwd N=1 constexpr, scalar T {dt}", L._fwd_kernel, lp, ce, t.num_warps, t.num_stages, True
        fold = dict(PIN="*fp32", POUT="*fp32", LOGP="*fp32", ENT="*fp32", LSE="*fp32")
        yield f"fold splits->groups C={t.group} {dt}", L._fold_kernel, fold, \
            dict(C=t.group, ENTROPY=True, FINAL=False, BLOCK=16), 4, 1, True
        yield f"fold final C=16 {dt}", L._fold_kernel, fold, dict(C=16, ENTROPY=True, FINAL=True, BLOCK=32), 4, 1, True
        yield f"fold final N=1 C=16 {dt}", L._fold_kernel, fold, \
            dict(C=16, ENTROPY=False, FINAL=True, BLOCK=32, N=1), 4, 1, True
        tz = L._DZ_TILES[tdt]
        yield f"dz {dt} {tz.block_n}x{tz.block_v}x{tz.block_d} w{tz.num_warps}", L._dz_kernel, \
            dict(H=p, W=p, Y="*i64", INVT="*fp32", LSE="*fp32", ENT="*fp32", GLP="*fp32", GENT="*fp32", DZ=p,
                 inv_t_scalar="fp32"), \
            dict(PER_ROW_T=True, HAS_GLP=True, HAS_GENT=True, BLOCK_N=tz.block_n, BLOCK_V=tz.block_v,
                 BLOCK_D=tz.block_d, EVEN_D=True, GROUP_R=8, DOT_PREC=prec, **unit), tz.num_warps, tz.num_stages, True
    for ct in ("fp32", "fp64"):
        yield f"policy loss {ct} gspo dual k3", PL._pl_kernel, \
            dict(LOGP="*" + ct, OLD="*fp32", LOGR="*" + ct, ADV="*fp32", MASK="*" + ct, WGT="*" + ct, REF="*fp32",
                 COEF="*" + ct, PART="*" + ct, lo="fp32", hi="fp32", dual_c="fp32", kl_coef="fp32"), \
            dict(GSPO=True, DUAL=True, KL=3, BLOCK=1024), 4, 1, True


L_SWEEP = []


def main():
    global L_SWEEP
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_logprob import SWEEP
    L_SWEEP = SWEEP
    bad = n = 0
    for name, fn, types, constexprs, warps, stages, strict in jobs():
        n += 1
        try:
            r = compile_one(fn, types, constexprs, warps, stages)
        except Exception as e:  # report every kernel, then fail
            bad += strict
            print(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            continue
        flag = r["spill"] != 0
        bad += flag and strict
        print(f"{'BAD ' if flag else 'ok  '}{name:52s} regs {r['regs']:4d} spill {r['spill']:5d} B "
              f"smem {r['smem']:6d} B  wgmma {r['wgmma']} mma {r['mma']}", flush=True)
    print(f"{n}/{n} compiled, {bad} failures in default configurations (triton {triton.__version__}, sm_90)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
