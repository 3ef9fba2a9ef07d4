"""CUDA-event timing shared by the kernel benchmarks (imported as `_timing`: the scripts run
from this directory). Each call is timed on its own; the result is the median in seconds."""

import statistics

import torch

_flush = None


def median_seconds(fn, reps: int, *, warmup: int = 3, flush_l2: bool = False) -> float:
    """Median seconds of one call of `fn` over `reps` calls after `warmup` calls; with
    `flush_l2`, a 256 MiB write before each call so no input is still in L2."""
    global _flush
    if flush_l2 and _flush is None:
        _flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if flush_l2:
            _flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def graphed(fn, warmup: int = 3):
    """`fn` captured once in a CUDA graph after `warmup` calls on a side stream (compiles,
    autotuning, allocator warm-up stay out of the capture); returns the graph's replay
    (its outputs live in the graph pool). Timing replays leaves the host's launch time out."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay
