"""Functions on tensors: each op in its own file with its contract and math, a PyTorch
reference (`*_ref`) and a public function that picks the backend; the op's Triton
kernels, launchers and autograd Function live in `rlfuse.kernels.triton.<op>`, because
triton is an optional dependency (a CPU-only install runs the references) and only
those modules import it.

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
