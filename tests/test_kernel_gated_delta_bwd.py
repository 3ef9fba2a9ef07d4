"""The chunked gated delta rule's backward split over Dk (`triton_chunk_bwd_split`, the
default for wide heads) against float64 gradients of the reference and against the
one-kernel backward (`gated_delta_bwd(..., split=False)`): odd shapes and Dk = Dv = 128
under the CPU interpreter, Qwen3.5's heads on the GPU.

    python -m pytest -q tests/test_kernel_gated_delta_bwd.py
    python -m pytest -m gpu tests/test_kernel_gated_delta_bwd.py    (a CUDA machine)
"""

import pytest
import torch
from test_kernel_gated_delta import _inputs

from rlfuse.kernels.backend import triton_ops
from rlfuse.kernels.gated_delta import chunk_gated_delta_rule_ref

pytest.importorskip("triton")

NAMES = "q k v g beta s0".split()


def _case(dims, lens, *, state, final, dtype=torch.float32, seed=0, device="cpu"):
    """Inputs (q, k, v, g, beta, cu, s0), do and the gradient dS' reaching the final state."""
    Hk, Hv, Dk, Dv = dims
    x = [t if t is None else t.to(device)
         for t in _inputs(lens, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, dtype=dtype, seed=seed, state=state)]
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(sum(lens), Hv, Dv, generator=gen).to(dtype).to(device)
    dsf = torch.randn(len(lens), Hv, Dk, Dv, generator=gen).to(device) if final else None
    return x, do, dsf


def _triton(x, do, dsf, split):
    q, k, v, g, beta, cu, s0 = x
    grads = triton_ops("gated_delta.triton_chunk_bwd").gated_delta_bwd(
        q, k, v, g, beta, cu, s0, q.shape[-1] ** -0.5, do, dsf, split=split)
    return grads if s0 is not None else grads[:5]


def _reference(x, do, dsf, double):
    """Autograd through the torch reference: in float64 (the gold), or in the inputs' dtype."""
    q, k, v, g, beta, cu, s0 = x
    cast = (lambda t: t.double()) if double else (lambda t: t)
    leaves = [cast(t.detach()).requires_grad_() for t in (q, k, v, g, beta) + (() if s0 is None else (s0,))]
    o, S = chunk_gated_delta_rule_ref(*leaves[:5], cu, initial_state=leaves[5] if s0 is not None else None,
                                      output_final_state=True, exact=False)
    loss = (o * do.to(o.dtype)).sum() + ((S * dsf.to(S.dtype)).sum() if dsf is not None else 0)
    return torch.autograd.grad(loss, leaves)


def _check(ours, ref, gold, margin):
    """No worse than the reference in the same dtype, up to margin x the gradient's size."""
    for name, a, r, gd in zip(NAMES, ours, ref, gold):
        assert a.dtype == r.dtype and a.shape == gd.shape, name
        err = (a.double() - gd).abs().max().item()
        err_ref = (r.double() - gd).abs().max().item()
        assert err <= 4 * err_ref + margin * (1 + gd.abs().max().item()), (name, err, err_ref)


# Dk = Dv = 128 (Qwen3.5's heads, the `wide` branch) with grouped heads, a partial last chunk, an
# initial state and the final state's gradient; 80 x 72: wide, non-power-of-2, Dk != Dv, two Dk
# blocks (the second masked), varlen; 12 x 40: narrow, Hv = 3 Hk, an empty sequence, no state
CASES = [((1, 2, 128, 128), [70, 5], True, True),
         ((2, 4, 80, 72), [130, 3], True, True),
         ((1, 3, 12, 40), [66, 0, 9], False, False)]


@pytest.mark.parametrize("dims,lens,state,final", CASES, ids=["128", "80x72", "12x40"])
def test_split_backward_against_float64_and_one_kernel(dims, lens, state, final):
    x, do, dsf = _case(dims, lens, state=state, final=final, seed=30)
    split = _triton(x, do, dsf, split=True)
    _check(split, _reference(x, do, dsf, double=False), _reference(x, do, dsf, double=True), 1e-5)
    for name, a, b in zip(NAMES, split, _triton(x, do, dsf, split=False)):  # the two forms: the same math
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * (1 + b.abs().max().item()), msg=name)


def test_split_backward_bf16_at_128():
    x, do, dsf = _case((1, 2, 128, 128), [70], state=True, final=True, dtype=torch.bfloat16, seed=31)
    split = _triton(x, do, dsf, split=True)
    _check(split, _reference(x, do, dsf, double=False), _reference(x, do, dsf, double=True), 1e-2)


# ------------------------------------------------------------------------------------ GPU

_GAP = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # split vs one kernel, x max |gold gradient|


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(16, 16), (16, 32)], ids=["qwen3.5-0.8b", "qwen3.5-2b"])
def test_gpu_split_backward_qwen35(dtype, heads):
    """At Qwen3.5's linear heads (Dk = Dv = 128; 16 / 32 value heads): the split backward
    (tf32 dots for bf16 inputs, fp32 for fp32) against float64 gradients, against the
    one-kernel fp32-FMA backward, and the same bits run to run."""
    x, do, dsf = _case((*heads, 128, 128), [300, 64, 5, 700], state=True, final=True, dtype=dtype, seed=32,
                       device="cuda")
    split = _triton(x, do, dsf, split=True)
    gold = _reference(x, do, dsf, double=True)
    _check(split, _reference(x, do, dsf, double=False), gold, 1e-2 if dtype == torch.bfloat16 else 1e-4)
    for name, a, b, gd in zip(NAMES, split, _triton(x, do, dsf, split=False), gold):
        gap = (a.double() - b.double()).abs().max().item()
        assert gap <= _GAP[dtype] * gd.abs().max().item(), (name, gap)
    assert all(torch.equal(a, b) for a, b in zip(split, _triton(x, do, dsf, split=True)))
