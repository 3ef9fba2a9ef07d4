"""Small Triton helpers shared by several kernels (one op per file keeps its own math)."""

import contextlib
import dataclasses
import importlib
import json
import sys

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, convert_to_tuple_if_list

from rlfuse.kernels.backend import is_triton_module


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


def _kernel_caches():
    """(module.kernel, its per-device kernel caches) over the loaded Triton modules
    (`backend.is_triton_module`): the first element of each `device_caches` entry (Triton 3.x)."""
    for mod_name, mod in list(sys.modules.items()):
        if not is_triton_module(mod_name) or mod is None:
            continue
        for name, fn in vars(mod).items():
            if isinstance(fn, JITFunction) and getattr(fn, "device_caches", None):
                caches = [c[0] for c in fn.device_caches.values() if c and isinstance(c[0], dict)]
                yield f"{mod_name.rsplit('.', 1)[1]}.{name}", caches


def compiled_variants() -> dict[str, int]:
    """{kernel name: compiled specializations so far} (see `backend.triton_compiles`)."""
    counts = ((name, sum(len(c) for c in caches)) for name, caches in _kernel_caches())
    return {name: n for name, n in counts if n}


def forget_compiled() -> None:
    """Empty the in-memory kernel caches: the next launch of each kernel loads or compiles it
    again (a test of a cold start after tests that compiled the same kernels)."""
    for _, caches in _kernel_caches():
        for c in caches:
            c.clear()


@triton.jit
def dot(a, b, acc, PREC: tl.constexpr):
    """acc + a @ b (acc None: a @ b), PREC from `dot_precision`. "interp" (Triton's CPU
    interpreter, where `tl.dot` is numpy's matmul): the operands go up to fp64 (the
    interpreter multiplies bf16 as raw uint16, Triton 3.9), the fp32 x fp32 products are
    exact there and the sums carry 29 more bits than fp32, and the result is rounded to
    fp32. The BLAS under numpy may pick its kernel, and so the sum order, by the tile's
    shape and a row's place in it (seen with OpenBLAS on an AMD EPYC): in fp32 that broke
    the bitwise batch invariance and tile agreement the exact-mode tests check; in fp64 a
    different order changes the fp32 result only when the exact sum lies within ~2^-40 of
    an fp32 rounding boundary."""
    if PREC == "interp":
        out = tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee").to(tl.float32)
        return out if acc is None else acc + out
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


def dot_precision(x: torch.Tensor) -> str:
    """The `dot` PREC for operands like x: "ieee" for fp32 (exact fp32 products, the test
    dtype), "tf32" otherwise (ignored by 16-bit inputs), "interp" off the GPU."""
    if x.device.type != "cuda":
        return "interp"
    return "ieee" if x.dtype == torch.float32 else "tf32"


@triton.jit
def swizzle(pid, R, C, GROUP_R: tl.constexpr):
    """pid -> (r, c) over an R x C tile grid, GROUP_R tile rows at a time, row fastest:
    programs running together share column tiles (same c; the weight in a GEMM) and row
    blocks (same r) in L2."""
    per_group = GROUP_R * C
    first = (pid // per_group) * GROUP_R
    size = tl.minimum(R - first, GROUP_R)
    return first + (pid % per_group) % size, (pid % per_group) // size


@contextlib.contextmanager
def record_compiles(skip: bool = True):
    """Inside: every kernel launch that would compile is recorded and skipped (nothing
    compiles, the kernel does not run; launches of kernels compiled before run). Yields
    the list it fills with (module, kernel name, Triton's specialization JSON, target), one
    per distinct specialization, for `compile_from_spec`. `skip=False`: only record (the
    kernels compile and run as usual: a diagnostic of which variants a workload compiles)."""
    requests, seen = [], set()
    # the target travels beside the JSON: Triton 3.6 leaves it out (3.9 writes it in)
    target = dataclasses.asdict(triton.runtime.driver.active.get_current_target())

    def record(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        spec = compile["specialization_data"]
        if spec not in seen:
            seen.add(spec)
            requests.append((fn.module, fn.name, spec, target))
        return skip

    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = record
    try:
        yield requests
    finally:
        knobs.runtime.jit_cache_hook = before


def compile_from_spec(module: str, name: str, spec: str, target: dict) -> None:
    """Compile kernel `module.name` for a specialization `record_compiles` recorded, into
    Triton's on-disk cache, for `target` (or the one the JSON names): no GPU needed (the
    compile workers). The decoding follows `JITFunction.preload`, which needs a device."""
    fn = getattr(importlib.import_module(module), name)
    d = json.loads(spec)
    target = GPUTarget(**{k: convert_to_tuple_if_list(v) for k, v in d.get("target", target).items()})
    backend = make_backend(target)

    def constant(v):
        if tl.dtype.is_dtype(v):
            return tl.dtype(v)
        if isinstance(v, dict) and "constexpr" in v:
            return tl.constexpr(convert_to_tuple_if_list(v["constexpr"]))
        return convert_to_tuple_if_list(v)

    constexprs = {tuple(k): constant(v) for k, v in zip(d["constant_keys"], d["constant_vals"])}
    attrs = dict(zip(map(tuple, d["attrs_keys"]), d["attrs_vals"]))
    signature = {k: convert_to_tuple_if_list(v) for k, v in d["signature"].items()}
    options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in d["options"].items()})
    triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def compile_worker() -> None:
    """A compile worker's loop (`backend.compile_worker_command()`): one JSON request
    [module, kernel, specialization JSON, target] per stdin line, one JSON line out per
    request, {"kernel": name, "error": null or "Type: message"}."""
    for line in sys.stdin:
        module, name, spec, target = json.loads(line)
        try:
            compile_from_spec(module, name, spec, target)
            err = None
        except Exception as e:  # noqa: BLE001 -- reported to the parent, whose update then compiles it
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(json.dumps({"kernel": name, "error": err}), flush=True)
