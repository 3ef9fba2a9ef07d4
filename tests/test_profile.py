"""rlfuse.run.profile: the per-rank summary of a profiled phase, on hand-made Chrome traces
(numbers worked out by hand below), and one real profile of a phase in one process.
Run: python -m pytest -q tests/test_profile.py
"""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from rlfuse.run import PhaseTimer, step_profiler
from rlfuse.run.profile import collective_kind, summarize_trace


def _ev(name, cat, ts, dur, tid=1, pid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


@pytest.mark.parametrize("name,kind", [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(...)", "reduce_scatter"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)", "all_reduce"),
    ("ncclDevKernel_SendRecv(...)", "other"),
    ("c10d::_allgather_base_", "all_gather"), ("c10d::_reduce_scatter_base_", "reduce_scatter"),
    ("gloo:all_reduce", "all_reduce"), ("c10d::broadcast_", "other"),
    ("fsdp::all_gather_copy_in", None), ("void at::native::elementwise_kernel<128, 2>(...)", None),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", None), ("FSDP::all_gather (model.layers.0)", None),
])
def test_collectives_are_classified_by_name(name, kind):
    assert collective_kind(name) == kind


def test_gpu_trace_summary():
    # device (pid 0; stream 7 compute, stream 20 NCCL), times in us; wall 0.001 s = 1000 us
    trace = {"traceEvents": [
        _ev("gemm", "kernel", 0, 100, tid=7, pid=0),
        _ev("ncclDevKernel_AllGather_RING_LL", "kernel", 50, 100, tid=20, pid=0),   # 50 us under the gemm
        _ev("elementwise", "kernel", 200, 50, tid=7, pid=0),
        _ev("ncclDevKernel_ReduceScatter_Sum_f32", "kernel", 300, 100, tid=20, pid=0),  # exposed
        _ev("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 450, 10, tid=7, pid=0),
        _ev("ncclDevKernel_AllGather_RING_LL", "kernel", 500, 20, tid=20, pid=0),
        # host: a forward op with a child, a sync, a launch; a GPU-side annotation (not host)
        _ev("aten::linear", "cpu_op", 0, 80), _ev("aten::mm", "cpu_op", 10, 50),
        _ev("cudaStreamSynchronize", "cuda_runtime", 420, 40), _ev("cudaLaunchKernel", "cuda_runtime", 90, 5),
        _ev("FSDP::pre_forward", "gpu_user_annotation", 0, 500, tid=7, pid=0),
        {"ph": "i", "name": "marker", "ts": 5},  # not a complete event
    ]}
    s = summarize_trace(trace, 0.001)
    assert s["device"] == "cuda"
    # busy: [0, 150) + [200, 250) + [300, 400) + [450, 460) + [500, 520) = 150 + 50 + 100 + 10 + 20
    assert s["busy_s"] == pytest.approx(330e-6) and s["idle_s"] == pytest.approx(670e-6)
    assert s["compute_s"] == pytest.approx(160e-6)  # gemm 100, elementwise 50, memcpy 10
    assert s["comm_s"] == pytest.approx(220e-6) and s["exposed_comm_s"] == pytest.approx(170e-6)
    assert s["all_gather_s"] == pytest.approx(120e-6) and s["reduce_scatter_s"] == pytest.approx(100e-6)
    assert s["all_reduce_s"] == 0 and s["other_s"] == 0
    assert s["counts"] == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 0, "other": 0}
    assert s["n_collectives"] == 3
    ops = {o["name"]: o for o in s["top_host_ops"]}
    assert ops["aten::linear"]["self_s"] == pytest.approx(30e-6) and ops["aten::mm"]["self_s"] == pytest.approx(50e-6)
    assert s["host_sync_s"] == pytest.approx(40e-6) and "FSDP::pre_forward" not in ops
    assert s["top_host_ops"][0]["name"] == "aten::mm"  # most self time first


def test_host_trace_summary_counts_the_c10d_calls():
    # gloo: the c10d call on the main thread (tid 1), its work on a gloo thread (tid 9)
    trace = {"traceEvents": [
        _ev("aten::mm", "cpu_op", 0, 100),
        _ev("c10d::_allgather_base_", "cpu_op", 100, 50), _ev("record_param_comms", "cpu_op", 105, 40),
        _ev("gloo:all_gather", "user_annotation", 110, 60, tid=9),
        _ev("c10d::_reduce_scatter_base_", "cpu_op", 200, 30), _ev("gloo:all_reduce", "user_annotation", 200, 30, tid=9),
        _ev("aten::add", "cpu_op", 300, 10),
    ]}
    s = summarize_trace(trace, 0.0005)
    assert s["device"] == "cpu"
    # busy [0, 170) + [200, 230) + [300, 310) = 210; comm [100, 170) + [200, 230) = 100
    assert s["busy_s"] == pytest.approx(210e-6) and s["comm_s"] == pytest.approx(100e-6)
    assert s["compute_s"] == pytest.approx(110e-6) and s["exposed_comm_s"] == pytest.approx(100e-6)
    assert s["counts"] == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0, "other": 0}


def test_a_profiled_phase_writes_its_files_and_others_do_not(tmp_path):
    prof = step_profiler(2, "train", tmp_path, rank=3)
    assert step_profiler(0, "train", tmp_path) is None  # off
    assert prof.at(0) is None and prof.at(1) is prof  # 0-based steps; profile_step is 1-based
    x = torch.randn(64, 64)
    timer = PhaseTimer("cpu", profile=prof.at(1))
    with timer("generate"):
        x @ x
    with timer("train"):
        for _ in range(3):
            x = torch.tanh(x @ x)
    with timer("train"):  # the phase timed again in the step: profiled once
        x @ x
    assert prof.at(1) is None  # done
    s = json.loads((tmp_path / "profile" / "step2_rank3.json").read_text())
    assert (s["step"], s["phase"], s["rank"], s["device"]) == (2, "train", 3, "cpu")
    assert s["wall_s"] < timer.times["train"] and s["busy_s"] > 0 and s["n_collectives"] == 0
    assert any(op["name"] == "aten::mm" and op["calls"] == 3 for op in s["top_host_ops"])
    with gzip.open(tmp_path / "profile" / "step2_rank3.trace.json.gz") as f:
        assert any(e.get("name") == "aten::tanh" for e in json.load(f)["traceEvents"])
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step2_rank3.json", "step2_rank3.trace.json.gz"]


@pytest.mark.gpu
def test_a_profiled_cuda_phase_counts_kernels_as_device_time(tmp_path):
    """On a GPU: kernels are the device events, the host launches are host ops; a forced host
    sync shows in host_sync_s."""
    prof = step_profiler(1, "train", tmp_path, device="cuda")
    x = torch.randn(2048, 2048, device="cuda")
    timer = PhaseTimer("cuda", profile=prof.at(0))
    with timer("train"):
        for _ in range(8):
            x = torch.tanh(x @ x)
        torch.cuda.synchronize()  # a host sync inside the phase
        for _ in range(8):
            x = torch.tanh(x @ x)
    s = json.loads((tmp_path / "profile" / "step1_rank0.json").read_text())
    assert s["device"] == "cuda" and s["n_collectives"] == 0 and s["comm_s"] == 0
    assert 0 < s["compute_s"] == pytest.approx(s["busy_s"]) and s["busy_s"] <= s["wall_s"] * 1.01
    assert s["host_sync_s"] > 0
    assert any("launch" in op["name"].lower() for op in s["top_host_ops"])


def test_a_phase_that_raises_writes_no_profile(tmp_path):
    prof = step_profiler(1, "train", tmp_path)
    timer = PhaseTimer("cpu", profile=prof.at(0))
    with pytest.raises(RuntimeError, match="boom"), timer("train"):
        raise RuntimeError("boom")
    assert not (tmp_path / "profile").exists() and "train" in timer.times
