"""Every Triton kernel variant a workload launches fits an H100's shared memory: compiled
for sm_90 here, without a GPU (tests/kernel_audit.py says how and why). The Gated DeltaNet
state passes once needed 290-425 KB and failed on their first launch on an H100; its
backward at 128-wide heads ran fp32 FMA dots to fit, until it was split over Dk (its
kernels must keep tensor-core dots for bf16 inputs)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

AUDIT = os.path.join(os.path.dirname(__file__), "kernel_audit.py")
H100_SHARED = 232448  # bytes a block may use; kernel_audit.py is not imported here: it unsets TRITON_INTERPRET


def _audit(*cases: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, AUDIT, *cases], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gated_delta_bf16", "gated_delta_fp32"])
def test_gated_delta_kernels_fit_h100_shared_memory(case):
    rows = _audit(case)
    names = {r["kernel"] for r in rows}
    split = {"_chunk_bwd_vside_kernel", "_chunk_bwd_kside_kernel", "_chunk_bwd_finish_kernel"}
    assert {"_chunk_prep_kernel", "state_pass_kernel", "_state_bwd_kernel", "_chunk_bwd_kernel"} | split <= names, names
    over = [r for r in rows if r["shared"] > H100_SHARED]
    assert not over, over
    if case.endswith("bf16"):  # tf32 dots, as the forward's (fp32 inputs get fp32 dots in both)
        fma = [r for r in rows if r["kernel"] in split and not (r["tensor_cores"] and '"PREC": "tf32"' in r["constexprs"])]
        assert not fma, fma
