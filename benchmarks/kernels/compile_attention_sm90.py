"""Compile the attention kernels for sm_90 without a GPU and report resources.

Uses triton.compile with an explicit GPUTarget("cuda", 90) and the ptxas that ships
with the triton wheel (`ptxas -v` on the emitted PTX) to print, for the tile settings
the launchers pick (`attention._configs`, `paged_attention._config`): shared memory,
registers per thread, spill bytes and whether wgmma (Hopper tensor-core MMA) is used.
Exits 1 if a 16-bit configuration spills registers or needs more than 227 KiB of
shared memory (the H100 limit per block). The GPU target runs Triton 3.6, this box
may run a newer one: treat the numbers as a close estimate.

Run (CPU is fine; TRITON_INTERPRET must be unset):
    env -u TRITON_INTERPRET python benchmarks/kernels/compile_attention_sm90.py
"""

from __future__ import annotations

import sys

import triton

from _sm90 import compile_sm90  # benchmarks/kernels/_sm90.py (the script's directory)
from rlfuse.kernels import attention as A
from rlfuse.kernels import paged_attention as P

SMEM_LIMIT = 227 * 1024


def compile_one(fn, ptrs: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]  # as the launcher specializes aligned pointers
        elif name in ("qk_scale", "sm_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("s"):  # strides: multiples of 16 elements at our shapes
                attrs[(i,)] = [["tt.divisibility", 16]]
    k, ptx, regs, spill = compile_sm90(fn, sig, constexprs, dict(num_warps=num_warps, num_stages=num_stages), attrs)
    return {"smem": k.metadata.shared, "regs": regs, "spill": spill, "wgmma": "wgmma" in ptx}


def main():
    rows, bad = [], 0
    for dt, size in (("bf16", 2), ("fp32", 4)):
        tp, fp, prec = "*" + dt, "*fp32", "ieee" if dt == "fp32" else "tf32"
        for dh in (64, 128):
            cfgs = A._configs(dh, size)
            jobs = []
            c = dict(cfgs["fwd"])
            jobs.append(("fwd", A._fwd_kernel, dict(Q=tp, K=tp, V=tp, O=tp, LSE=fp, CU="*i32"),
                         dict(HEAD_DIM=dh, BLOCK_M=c.pop("BLOCK_M"), BLOCK_N=A.KV_BLOCK, PREC=prec), c))
            for name, fn, grads in (("dkdv", A._bwd_dkdv_kernel, ("DK", "DV")), ("dq", A._bwd_dq_kernel, ("DQ",))):
                c = dict(cfgs[name])
                ptrs = {n: tp for n in ("Q", "K", "V", "DO", *grads)} | dict(LSE=fp, DELTA=fp, CU="*i32")
                jobs.append((name, fn, ptrs, dict(HEAD_DIM=dh, BLOCK_M=c.pop("BLOCK_M"), BLOCK_N=c.pop("BLOCK_N"),
                                                  PREC=prec), c))
            for decode in (True, False):
                c = P._config(dh, size, decode)
                group = 2  # Qwen3-0.6B: 16 query heads on 8 kv heads
                block_q = 1 if decode else max(1, c.pop("BLOCK_M") // group)
                c.pop("BLOCK_M", None)
                ptrs = dict(Q=tp, KC=tp, VC=tp, O=tp, O_WS=fp, LSE_WS=fp, CU_Q="*i32", SEQ_LENS="*i32", BT="*i32")
                for split in ((False, True) if decode else (False,)):
                    jobs.append((f"paged {'decode' if decode else 'prefill'}{' split' if split else ''}",
                                 P._paged_kernel, ptrs,
                                 dict(PAGE=16, HEAD_DIM=dh, BLOCK_Q=block_q, GROUP=group,
                                      BLOCK_M=max(16, block_q * group), BLOCK_N=A.KV_BLOCK, SPLIT=split, PREC=prec), c))
            for name, fn, ptrs, constexprs, launch in jobs:
                r = compile_one(fn, ptrs, constexprs, launch.get("num_warps", 4), launch.get("num_stages", 2))
                flag = dt != "fp32" and (r["spill"] != 0 or r["smem"] > SMEM_LIMIT)
                bad += flag
                rows.append((dt, dh, name, r, flag))
                print(f"{'BAD ' if flag else 'ok  '}{dt:5s} dh={dh:<4d} {name:22s} smem {r['smem']:7d} B  regs "
                      f"{r['regs']:4d}  spill {r['spill']:5d} B  wgmma {r['wgmma']}", flush=True)
    print(f"{len(rows) - bad}/{len(rows)} ok (triton {triton.__version__}, target sm_90)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
