"""Compile the RMSNorm / RoPE / SwiGLU / sampling kernels for sm_90 without a GPU.

triton.compile with GPUTarget("cuda", 90) at the launchers' settings, then `ptxas -v`
(bundled with the triton wheel) on the PTX: registers per thread, spill bytes, shared
memory, and the count of precise vs approximate math in the PTX (div.rn vs div.full,
libdevice calls). Exits 1 on a compile error or a spill. The GPU box runs Triton 3.6,
this one may run a newer Triton: a close estimate, not a guarantee.

Run (CPU is fine; TRITON_INTERPRET must be unset):
    env -u TRITON_INTERPRET python benchmarks/kernels/compile_layers_sm90.py
"""

from __future__ import annotations

import sys

import triton

from _sm90 import compile_sm90  # benchmarks/kernels/_sm90.py (the script's directory)
from rlfuse.kernels import rmsnorm as R
from rlfuse.kernels import rope as P
from rlfuse.kernels import sampling as S
from rlfuse.kernels import swiglu as G


def compile_one(fn, types: dict, constexprs: dict, num_warps: int) -> dict:
    """types: arg name -> triton type for pointers and non-i32 scalars (others i32)."""
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    k, ptx, regs, spill = compile_sm90(fn, sig, constexprs, dict(num_warps=num_warps))
    return dict(smem=k.metadata.shared, regs=regs, spill=spill,
                math={o: ptx.count(o) for o in ("div.rn", "div.full", "rsqrt.approx", "__nv_")})


def jobs():
    for dt in ("bf16", "fp32"):
        p = "*" + dt
        yield f"swiglu fwd {dt}", G._swiglu_fwd_kernel, dict(G_ptr=p, U_ptr=p, Y_ptr=p, N="i64"), \
            dict(BLOCK=G._BLOCK, EVEN=True), G._WARPS
        yield f"swiglu bwd {dt}", G._swiglu_bwd_kernel, dict(DY_ptr=p, G_ptr=p, U_ptr=p, DG_ptr=p, DU_ptr=p, N="i64"), \
            dict(BLOCK=G._BLOCK, EVEN=True), G._WARPS
        for D in (1024, 128):
            block_d, rows, warps = R._tile(D)
            yield f"rmsnorm fwd D={D} {dt}", R._rmsnorm_fwd_kernel, \
                dict(X_ptr=p, W_ptr=p, Y_ptr=p, R_ptr="*fp32", eps="fp32"), \
                dict(ROWS=rows, BLOCK_D=block_d, STORE_R=True), warps
            block_d, rows, warps = R._tile(D, backward=True)
            yield f"rmsnorm bwd D={D} {dt}", R._rmsnorm_bwd_kernel, \
                dict(DY_ptr=p, X_ptr=p, W_ptr=p, R_ptr="*fp32", DX_ptr=p, DWP_ptr="*fp32"), \
                dict(ROWS=rows, BLOCK_D=block_d), warps
            yield f"rmsnorm dw sum D={D} {dt}", R._dw_sum_kernel, dict(DWP_ptr="*fp32", DW_ptr=p), \
                dict(BLOCK_D=block_d, COLS=R._DW_COLS, BLOCK_P=R._DW_ROWS), R._DW_WARPS
        for bwd in (False, True):
            yield f"rope {'bwd' if bwd else 'fwd'} Dh=128 {dt}", P._rope_kernel, \
                dict(X_ptr=p, Y_ptr=p, P_ptr="*i64", F_ptr="*fp32"), \
                dict(HALF=64, BLOCK_T=P._BLOCK_T, BLOCK_F=64, BACKWARD=bwd), 4
        prm = dict(L_ptr=p, T_ptr="*fp32", K_ptr="*i64", P_ptr="*fp32", MP_ptr="*fp32", SEED_ptr="*i64",
                   OFF_ptr="*i64", M_part="*fp32", Z_part="*fp32", V_part="*fp32", I_part="*i32", H_part="*i32",
                   CUT_ptr="*fp32", OFS_ptr="*i32", N_part="*i32", Q_part="*fp32", XO_part="*fp32", C_ptr="*i32",
                   SV_ptr="*fp32",
                   IDS_ptr="*i64", LP_ptr="*fp32", THR_ptr="*fp32")
        yield f"sample partial {dt}", S._partial_kernel, prm, \
            dict(CHUNK=S._CHUNK, BLOCK=S._BLOCK, BLOCK_H=S._BLOCK_H, NB=S._NB, W_INV=S._W_INV), 8
        yield f"sample cutoff {dt}", S._cutoff_kernel, prm, \
            dict(CHUNK=S._CHUNK, S_BLOCK=16, NB=S._NB, W_INV=S._W_INV), 4
        yield f"sample compact {dt}", S._compact_kernel, prm, \
            dict(CHUNK=S._CHUNK, CAP=S._CAP, BLOCK=S._BLOCK_K2[2 if dt == "bf16" else 4], W_INV=S._W_INV), \
            S._WARPS_K2
        yield f"sample finish {dt}", S._finish_kernel, prm, \
            dict(S_BLOCK=16, CAP=S._CAP, EXH=S._EXH, TB=S._TB, BLOCK_C=S._BLOCK_C, NP=S._NP, VS=S._VS), S._WARPS_K3

def main():
    bad = n = 0
    for name, fn, types, constexprs, warps in jobs():
        n += 1
        try:
            r = compile_one(fn, types, constexprs, warps)
        except Exception as e:  # report every kernel, then fail
            bad += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            continue
        flag = r["spill"] != 0
        bad += flag
        print(f"{'BAD ' if flag else 'ok  '}{name:28s} regs {r['regs']:4d} spill {r['spill']:5d} B "
              f"smem {r['smem']:6d} B  {r['math']}", flush=True)
    print(f"{n - bad}/{n} ok (triton {triton.__version__}, target sm_90)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
