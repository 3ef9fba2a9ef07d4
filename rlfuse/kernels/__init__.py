"""Functions on tensors: each op in its own file with a PyTorch reference (`*_ref`),
a Triton kernel, a launcher and a public function that picks the backend.

Backend choice is explicit: `use_backend("torch" | "triton" | "auto")` (a context
manager) or the `backend=` argument where an op takes one. "auto" runs Triton on CUDA
tensors and the reference elsewhere.
"""

from rlfuse.kernels.backend import (current_backend, current_numerics, resolve_backend, triton_available,
                                    use_backend, use_numerics)

__all__ = ["current_backend", "current_numerics", "resolve_backend", "triton_available", "use_backend",
           "use_numerics"]
