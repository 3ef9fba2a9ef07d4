"""Small Triton helpers shared by several kernels (one op per file keeps its own math)."""

import functools
import sys

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (sizes grids); 4 elsewhere (the CPU
    interpreter: any small number)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@triton.jit
def round_to(x, DT: tl.constexpr):
    """fp32 x rounded to nearest-even in DT, returned as fp32. bf16 by bit arithmetic:
    Triton's interpreter truncates fp32 -> bf16 casts (the GPU rounds), so the explicit
    rounding gives both the same bits; a later cast to DT is then exact."""
    if DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        return (b & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)


def compiled_variants() -> dict[str, int]:
    """{kernel name: compiled specializations so far} over the loaded rlfuse.kernels
    modules. A diagnostic for benchmarks: a count that grows inside a timed region is a
    Triton compile (seconds on a GPU) that the timing paid for. Reads Triton's per-device
    kernel cache (first element of each `device_caches` entry in Triton 3.x)."""
    out = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("rlfuse.kernels.") or mod is None:
            continue
        for name, fn in vars(mod).items():
            if isinstance(fn, JITFunction) and getattr(fn, "device_caches", None):
                n = sum(len(c[0]) for c in fn.device_caches.values() if c and isinstance(c[0], dict))
                if n:
                    out[f"{mod_name.rsplit('.', 1)[1]}.{name}"] = n
    return out


def new_variants(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Kernels compiled between two `compiled_variants()` snapshots: {name: new count}."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
