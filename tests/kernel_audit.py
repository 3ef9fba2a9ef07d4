"""Compile the Triton kernels that a workload launches for an H100 (sm_90) on a machine
without a GPU, and report each kernel's shared memory: `python tests/kernel_audit.py CASE...`
prints one JSON line per distinct compiled variant (its shared memory, and whether its PTX has
tensor-core instructions: wgmma or mma.sync).

Why: a kernel whose tiles need more shared memory than the card has (227 KB on an H100) fails
only when it first launches on a GPU (Triton's OutOfResources), and the CPU interpreter never
allocates shared memory at all. ptxas ships with the triton wheel, so compiling for sm_90 needs
no GPU. Every `JITFunction.run` is replaced by that compile: no kernel runs, the launchers'
outputs stay uninitialized, so a case may only chain kernels whose launch does not read data
back on the host.

Run in a fresh process (tests/test_kernel_resources.py does): the kernels must be decorated
without TRITON_INTERPRET, which the test session sets for the interpreter tests."""
import inspect
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import rlfuse.kernels.backend as backend  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
H100_SHARED = 232448  # bytes of shared memory a block may use (227 KB)
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64", torch.bool: "i1", torch.uint8: "u8", torch.int8: "i8", torch.float64: "fp64"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "num_ctas", "maxnreg")
_seen: set = set()


def _compile_instead(self, *args, grid, warmup, **kwargs):
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
    bound = inspect.signature(self.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs = {}, {}
    for param, (name, value) in zip(self.params, bound.arguments.items()):
        if param.is_constexpr or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    key = (self.fn.__name__, json.dumps(constexprs, sort_keys=True, default=str), json.dumps(options, sort_keys=True))
    if key not in _seen:
        _seen.add(key)
        compiled = triton.compile(ASTSource(fn=self, signature=signature, constexprs=constexprs),
                                  target=SM90, options=options)
        ptx = compiled.asm.get("ptx", "")
        print(json.dumps({"kernel": self.fn.__name__, "shared": compiled.metadata.shared,
                          "tensor_cores": "wgmma" in ptx or "mma.sync" in ptx,
                          "constexprs": key[1], "options": key[2]}), flush=True)


def _gpu_precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # what triton_common.dot_precision says on CUDA


def _gated_delta(dtype: torch.dtype, Hk=16, Hv=32, D=128, T=200):
    """Qwen3.5's linear attention (16 q/k heads, 32 value heads of 128): forward and backward,
    and the engine's two decode steps."""
    from rlfuse.kernels import gated_delta as gd
    q, k = (torch.randn(T, Hk, D, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(T, Hv, D, dtype=dtype, requires_grad=True)
    g = -torch.rand(T, Hv, requires_grad=True)
    beta = torch.rand(T, Hv, dtype=dtype, requires_grad=True)
    cu = torch.tensor([0, 70, T], dtype=torch.int32)
    o, _ = gd.chunk_gated_delta_rule(q, k, v, g, beta, cu, initial_state=torch.zeros(2, Hv, D, D),
                                     output_final_state=True)
    o.float().sum().backward()
    # the one-kernel backward as well (reachable with split=False, for the A/B in bench_gated_delta.py)
    bwd = backend.triton_ops("gated_delta.triton_chunk_bwd").gated_delta_bwd
    with torch.no_grad():
        bwd(q.detach(), k.detach(), v.detach(), g.detach(), beta.detach(), cu, torch.zeros(2, Hv, D, D), D ** -0.5,
            o.detach(), None, split=False)
    # the engine's decode steps on its slot pools: exact (the two kernels slot-addressed), fast (recurrent)
    B, N = 4, 6
    pool = torch.zeros(N, Hv, D, D)
    slots, tails = torch.arange(B), torch.arange(B) * 20
    with torch.no_grad():
        tail = (torch.zeros(N, gd.CHUNK, Hk, D, dtype=dtype), torch.zeros(N, gd.CHUNK, Hk, D, dtype=dtype),
                torch.zeros(N, gd.CHUNK, Hv, D, dtype=dtype), torch.zeros(N, gd.CHUNK, Hv),
                torch.zeros(N, gd.CHUNK, Hv, dtype=dtype))
        with backend.use_numerics("exact"):
            gd.chunk_gated_delta_decode(tail, pool, slots, tails)
        one = (q[:B].detach(), k[:B].detach(), v[:B].detach(), g[:B].detach(), beta[:B].detach())
        gd.fused_recurrent_gated_delta_rule(*one, torch.arange(B + 1, dtype=torch.int32), initial_state=pool,
                                            state_slots=slots)


CASES = {"gated_delta_bf16": lambda: _gated_delta(torch.bfloat16),
         "gated_delta_fp32": lambda: _gated_delta(torch.float32)}


def main(names: list[str]) -> None:
    JITFunction.run = _compile_instead
    backend.triton_interpreting = lambda: True  # lets CPU tensors reach the Triton launchers
    # before any kernel module imports it by name: the precision a CUDA tensor would get
    backend.triton_ops("triton_common").dot_precision = _gpu_precision
    for name in names:
        _seen.clear()
        with backend.use_backend("triton"):
            CASES[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
