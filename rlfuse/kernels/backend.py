"""Explicit kernel-backend selection.

Three names: "torch" (the readable references), "triton" (the fused kernels; on CPU
tensors they need Triton's interpreter, `TRITON_INTERPRET=1` set before the first
import of triton) and "auto" (Triton for CUDA tensors, the reference otherwise).
The choice lives in a context variable so tests and the CLI set it without touching
module globals: `with use_backend("torch"): ...`.

Numerics, the second switch, lives beside it: "fast" (today's kernels: cuBLAS GEMMs,
split-KV decode, torch's own CPU reductions) or "exact" (every op reduces in an order
that depends only on the token's own sequence and position, so the engine's rollout
log-probs equal the trainer's bitwise; see docs/numerics.md).

One mechanism carries both: `KernelSettings(backend, numerics)`. A model owns one
(`CausalLM.kernels`, set by the run's session) and enters it around every forward and
log-prob head it runs (`use_settings`), in whatever thread calls it, so a new forward
cannot run in the wrong numerics; None (a model built outside a run, in tests) inherits the
ambient context that `use_backend` / `use_numerics` set. The query functions are
`is_exact()`, `current_numerics()`, `current_backend()` and `resolve_backend()`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import importlib.util
import logging
import os
import sys
from types import ModuleType

import torch

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")
NUMERICS = ("fast", "exact")
_backend: contextvars.ContextVar[str] = contextvars.ContextVar("rlfuse_kernel_backend", default="auto")
_numerics: contextvars.ContextVar[str] = contextvars.ContextVar("rlfuse_numerics", default="fast")


def current_backend() -> str:
    return _backend.get()


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, what: str, choices: tuple, name: str):
    if name not in choices:
        raise ValueError(f"{what} must be one of {choices}, got {name!r}")
    token = var.set(name)
    try:
        yield
    finally:
        var.reset(token)


def use_backend(name: str):
    """Run the enclosed ops with backend `name` ("auto", "torch" or "triton")."""
    return _setting(_backend, "kernel backend", BACKENDS, name)


def set_backend(name: str) -> None:
    """Set the backend for the current context (the CLI calls this once at start-up)."""
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    _backend.set(name)


def current_numerics() -> str:
    return _numerics.get()


def is_exact() -> bool:
    return _numerics.get() == "exact"


def use_numerics(name: str):
    """Run the enclosed ops in numerics `name` ("fast" or "exact")."""
    return _setting(_numerics, "numerics", NUMERICS, name)


@dataclasses.dataclass(frozen=True, slots=True)
class KernelSettings:
    """The kernel backend and the numerics a model's forwards run in (the module docstring)."""
    backend: str = "auto"
    numerics: str = "fast"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"kernel backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {self.numerics!r}")


@contextlib.contextmanager
def use_settings(settings: KernelSettings | None):
    """Run the enclosed ops with both switches of `settings`; None: leave the context as it is."""
    if settings is None:
        yield
        return
    with use_backend(settings.backend), use_numerics(settings.numerics):
        yield


def current_settings() -> KernelSettings:
    return KernelSettings(backend=_backend.get(), numerics=_numerics.get())


@functools.cache
def triton_available() -> bool:
    """Whether triton is installed (found, not imported: importing it is left to the first
    op that runs on it)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def triton_interpreting() -> bool:
    # Triton reads this variable itself when kernels are decorated; we only mirror it
    # to know whether CPU tensors may go to a Triton kernel.
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def is_triton_module(modname: str) -> bool:
    """Whether `modname` is a Triton half (the only modules that import triton): an op
    family's `rlfuse.kernels.<family>.triton_<op>` or the shared `rlfuse.kernels.triton_common`."""
    parts = modname.split(".")
    return parts[:2] == ["rlfuse", "kernels"] and len(parts) >= 3 and parts[-1].startswith("triton_")


@functools.cache
def triton_ops(op: str) -> ModuleType:
    """The Triton half of an op, imported on first use: triton is an optional dependency
    (CPU-only installs run the references), so only a backend that resolves to "triton"
    ever imports it. `op` is "<family>.triton_<name>" (`rlfuse.kernels.<family>.triton_<name>`),
    or "triton_common" for the helpers the families share."""
    name = f"rlfuse.kernels.{op}"
    if not is_triton_module(name):
        raise ValueError(f"triton_ops: {op!r} is not a Triton module name ('<family>.triton_<op>' or 'triton_common')")
    return importlib.import_module(name)


def triton_compiles() -> dict[str, int]:
    """{kernel name: compiled specializations so far} over the loaded Triton kernel
    modules; {} where triton was never imported. A diagnostic for benchmarks: a count
    that grows inside a timed region is a Triton compile the timing paid for."""
    if not triton_available():
        return {}
    return triton_ops("triton_common").compiled_variants()


def record_compiles(skip: bool = True):
    """Context manager (CUDA): kernel launches that would compile are recorded and skipped
    (`skip=False`: recorded only); yields [(module, kernel, specialization JSON, target)],
    the requests a compile worker (`compile_worker_command`) takes (train/warm.py)."""
    return triton_ops("triton_common").record_compiles(skip)


def compile_worker_command() -> list[str]:
    """argv of a compile worker process (`rlfuse.kernels.triton_common.compile_worker`): a
    fresh interpreter that imports only the kernels, never the caller's main script."""
    return [sys.executable, "-c", "from rlfuse.kernels.triton_common import compile_worker; compile_worker()"]


def new_compiles(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Kernels compiled between two `triton_compiles()` snapshots: {name: new count}."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (sizes grids); 4 elsewhere (the CPU
    interpreter: any small number)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


_warned: set[str] = set()


def resolve_backend(op: str, x: torch.Tensor) -> str:
    """The backend `op` runs on for input `x`: "torch" or "triton" ("auto" without triton
    on a CUDA tensor falls back to the reference, logged once with the reason)."""
    want = _backend.get()
    if want == "torch":
        return "torch"
    if want == "triton":
        if not triton_available():
            raise RuntimeError(f"{op}: backend 'triton' requested but triton is not installed")
        if not x.is_cuda and not triton_interpreting():
            raise RuntimeError(f"{op}: Triton on CPU tensors needs TRITON_INTERPRET=1 set before import")
        return "triton"
    # auto
    if x.is_cuda and triton_available():
        return "triton"
    if x.is_cuda and op not in _warned:
        _warned.add(op)
        log.warning("kernel %s: using the PyTorch reference on CUDA (triton is not installed)", op)
    return "torch"
