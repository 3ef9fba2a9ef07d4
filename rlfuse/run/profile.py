"""One phase of one step under torch.profiler, on every rank: where the phase's wall time goes
(`logging.profile_step`, `logging.profile_phase`; off by default, and then nothing here runs).

    profiler = step_profiler(cfg.logging.profile_step, cfg.logging.profile_phase, run_dir, rank=r, device=dev)
    timer = PhaseTimer(dev, profile=profiler.at(step) if profiler else None)   # the trainer, per step
    with timer("train"): ...      # profiled when it is the chosen step's chosen phase

The profiler starts before the timer's opening device sync and stops after its closing one,
so the phase's logged time is the profiled wall. Per rank it writes, under RUN_DIR/profile/:
  step<N>_rank<R>.trace.json.gz  the Chrome trace (open in https://ui.perfetto.dev)
  step<N>_rank<R>.json           `summarize_trace`'s numbers for that wall

What the summary counts (seconds unless said):
  device events: GPU kernels, memcpys and memsets when the trace has any ("device": "cuda");
      else the host ops themselves ("device": "cpu": gloo runs, whose collectives are host ops)
  collectives: events whose name says nccl, gloo or c10d::, by kind from the name
      (AllGather / all_gather, ReduceScatter / reduce_scatter, AllReduce / all_reduce, else
      "other": broadcast, send/recv, barriers); copy-in / copy-out kernels are compute
  <kind>_s      length of the union of that kind's intervals (overlap counted once)
  comm_s        union of all collectives; compute_s: union of every other device event (cpu:
                busy_s - comm_s, the host ops nest and gloo blocks the calling thread)
  busy_s        union of all device events; idle_s = wall_s - busy_s (the device waited:
                host work, launches, syncs, a slower rank)
  exposed_comm_s  busy_s - compute_s: collective time no compute overlapped
  counts        per kind, the collective events not nested in another of the same thread (gloo:
                the c10d calls; CUDA: the NCCL kernels)
  host_sync_s   self time of the host's synchronize calls (cudaStreamSynchronize, ...)
  top_host_ops  the host ops with the most self time (own time, children excluded), with calls
Test: python -m pytest -q tests/test_profile.py
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
COMM_MARKS = ("nccl", "gloo", "c10d::")
KINDS = (("all_gather", ("allgather", "all_gather")), ("reduce_scatter", ("reducescatter", "reduce_scatter")),
         ("all_reduce", ("allreduce", "all_reduce")))
COMM_KINDS = tuple(k for k, _ in KINDS) + ("other",)
TOP_HOST_OPS = 12


def collective_kind(name: str) -> str | None:
    """all_gather / reduce_scatter / all_reduce / other for a collective's op or kernel name, None otherwise."""
    n = name.lower()
    if not any(m in n for m in COMM_MARKS) or "copy_in" in n or "copy_out" in n:
        return None
    return next((kind for kind, subs in KINDS if any(s in n for s in subs)), "other")


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _count_calls(events: list[dict]) -> dict[str, int]:
    """Collective kind -> events not nested in another collective event of the same thread."""
    counts = dict.fromkeys(COMM_KINDS, 0)
    by_thread: dict[tuple, list[dict]] = {}
    for e in events:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in by_thread.values():
        open_until = float("-inf")
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            if e["ts"] >= open_until:
                counts[collective_kind(e["name"])] += 1
                open_until = e["ts"] + e["dur"]
    return counts


def _self_times(events: list[dict]) -> dict[str, list[float]]:
    """name -> [self seconds, calls] of host events, nesting resolved per (pid, tid)."""
    by_thread: dict[tuple, list[dict]] = {}
    for e in events:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out: dict[str, list[float]] = {}
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, children's time, duration] per open event
        def close(item):
            name, own = item[1], item[3] - item[2]
            acc = out.setdefault(name, [0.0, 0])
            acc[0] += max(own, 0.0) * 1e-6
            acc[1] += 1
        for e in evs:
            while stack and e["ts"] >= stack[-1][0]:
                close(stack.pop())
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], 0.0, e["dur"]])
        while stack:
            close(stack.pop())
    return out


def summarize_trace(trace: dict, wall_s: float) -> dict:
    """The module docstring's numbers for a Chrome trace (`traceEvents`, times in us) of a
    phase that took `wall_s` seconds."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    dev = [e for e in evs if e.get("cat") in DEVICE_CATS]
    host = [e for e in evs if e.get("cat") in HOST_CATS]
    on_gpu = bool(dev)
    busy_evs = dev if on_gpu else host
    span = lambda e: (float(e["ts"]), float(e["ts"]) + float(e["dur"]))  # noqa: E731
    kinds = {k: [] for k in COMM_KINDS}
    rest = []
    for e in busy_evs:
        kind = collective_kind(e.get("name", ""))
        (kinds[kind] if kind else rest).append(span(e))
    busy = union_length([span(e) for e in busy_evs])
    comm = union_length([iv for ivs in kinds.values() for iv in ivs])
    compute = union_length(rest) if on_gpu else busy - comm
    out = {"device": "cuda" if on_gpu else "cpu", "wall_s": wall_s, "busy_s": busy * 1e-6,
           "idle_s": max(wall_s - busy * 1e-6, 0.0), "compute_s": compute * 1e-6, "comm_s": comm * 1e-6,
           "exposed_comm_s": (busy - compute) * 1e-6}
    for k, ivs in kinds.items():
        out[f"{k}_s"] = union_length(ivs) * 1e-6
    calls = [e for e in busy_evs if collective_kind(e.get("name", ""))]
    if not on_gpu and any("c10d::" in e["name"].lower() for e in calls):
        # gloo: count the c10d calls, not also their work on gloo's threads (where a reduce-scatter
        # runs as gloo:all_reduce: the per-kind times follow gloo's names)
        calls = [e for e in calls if "c10d::" in e["name"].lower()]
    out["counts"] = counts = _count_calls(calls)
    out["n_collectives"] = sum(counts.values())
    selfs = _self_times([e for e in host if e.get("cat") != "gpu_user_annotation"])
    out["host_sync_s"] = sum(v[0] for k, v in selfs.items() if "synchronize" in k.lower())
    top = sorted(selfs.items(), key=lambda kv: -kv[1][0])[:TOP_HOST_OPS]
    out["top_host_ops"] = [{"name": k, "self_s": v[0], "calls": v[1]} for k, v in top]
    return out


class _Running:
    """A started profile of one phase; `finish` stops it and writes the files."""

    def __init__(self, owner: StepProfiler, name: str):
        self.owner, self.name = owner, name
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.device(owner.device).type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False)
        self.prof.start()

    def stop(self) -> None:
        self.prof.stop()

    def finish(self, wall_s: float) -> dict:
        self.prof.stop()
        o = self.owner
        o.out_dir.mkdir(parents=True, exist_ok=True)
        stem = f"step{o.step}_rank{o.rank}"
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=o.out_dir)
        os.close(fd)
        try:
            self.prof.export_chrome_trace(tmp)
            raw = Path(tmp).read_bytes()
        finally:
            os.unlink(tmp)
        with gzip.open(o.out_dir / f"{stem}.trace.json.gz", "wb", compresslevel=3) as f:
            f.write(raw)
        summary = {"step": o.step, "phase": self.name, "rank": o.rank, **summarize_trace(json.loads(raw), wall_s)}
        (o.out_dir / f"{stem}.json").write_text(json.dumps(summary, indent=1))
        log.info("profiled %s of step %d on rank %d: wall %.3f s, busy %.3f, idle %.3f, collectives %.3f "
                 "(%d; exposed %.3f), compute %.3f -> %s", self.name, o.step, o.rank, wall_s, summary["busy_s"],
                 summary["idle_s"], summary["comm_s"], summary["n_collectives"], summary["exposed_comm_s"],
                 summary["compute_s"], o.out_dir / f"{stem}.json")
        return summary


class StepProfiler:
    """Profiles phase `phase` of step `step` (1-based, as logged) on this rank into `out_dir`."""

    def __init__(self, out_dir: Path, *, step: int, phase: str, rank: int = 0, device="cpu"):
        self.out_dir, self.step, self.phase, self.rank, self.device = Path(out_dir), step, phase, rank, device
        self.done = False

    def at(self, step: int) -> StepProfiler | None:
        """Self when 0-based step `step` is the profiled one, else None (PhaseTimer's `profile`)."""
        return self if step + 1 == self.step and not self.done else None

    def start(self, name: str) -> _Running | None:
        """A running profile if `name` is the profiled phase and it was not profiled yet (a
        phase timed twice in a step, like GRPO's score, is profiled at its first entry)."""
        if name != self.phase or self.done:
            return None
        self.done = True
        return _Running(self, name)


def step_profiler(step: int, phase: str, run_dir, *, rank: int = 0, device="cpu") -> StepProfiler | None:
    """logging.profile_step / profile_phase -> a StepProfiler writing to RUN_DIR/profile, or None when off."""
    if not step:
        return None
    return StepProfiler(Path(run_dir) / "profile", step=step, phase=phase, rank=rank, device=device)
