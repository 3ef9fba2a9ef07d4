"""Functions on tensors, one folder per op family (attention, norm, rope, linear, activation,
sampling, loss): each op's `<op>.py` holds its contract and math, a PyTorch reference
(`*_ref`) and the public function that picks the backend; its `triton_<op>.py` holds the
Triton kernels, launchers and autograd Function, because triton is an optional dependency
(a CPU-only install runs the references) and only those modules import it. Shared helpers
sit below the families: `backend` (the backend and numerics switches), `invariant`
(batch-invariant reductions), `triton_common` (Triton helpers).

Backend choice is explicit: `use_backend("torch" | "triton" | "auto")` (a context
manager) or the `backend=` argument where an op takes one. "auto" runs Triton on CUDA
tensors and the reference elsewhere.
"""

from rlfuse.kernels.backend import (
                                    current_backend,
                                    current_numerics,
                                    resolve_backend,
                                    triton_available,
                                    use_backend,
                                    use_numerics,
)

__all__ = ["current_backend", "current_numerics", "resolve_backend", "triton_available", "use_backend",
           "use_numerics"]
