"""The Triton halves of the ops in `rlfuse.kernels`: kernels, launchers and autograd
Functions, one module per op under the op's own name.

Each op's contract, math and PyTorch reference stay in `rlfuse.kernels.<op>`; this
package holds only what needs triton, which is an optional dependency (a CPU-only install
runs the references). Nothing imports it at start-up: the public op reaches its module
through `rlfuse.kernels.backend.triton_ops` once its backend resolves to "triton", and
`tests/test_layering.py` keeps `import triton` inside this package.
"""
