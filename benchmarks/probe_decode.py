"""Where a decode step's time goes (diagnostic, GPU): the decode GEMMs of the
Qwen3-0.6B-shaped model alone (eager and in a CUDA graph), and a kernel profile of one
graph-replayed decode step at batch 256 with 1024-token prompts.

The first engine check showed 9.8 ms per B=256 decode step in the bf16 GEMMs (~23 TFLOP/s),
and graph replay slower than eager device time; this probe separates the two questions.
    OUT=./out python benchmarks/probe_decode.py
Writes $OUT/probe_decode.json and prints tables.
"""

import json
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

OUT = Path(os.environ.get("OUT", "out"))
SHAPES = {"q_proj": (1024, 2048), "k_proj": (1024, 1024), "o_proj": (2048, 1024), "gate_proj": (1024, 3072),
          "down_proj": (3072, 1024), "lm_head": (1024, 151936)}


def time_fn(fn, reps=50):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def gemms():
    rows = []
    for M in (1, 64, 256, 2048):
        for name, (K, N) in SHAPES.items():
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            eager = time_fn(lambda: torch.matmul(x, w.t(), out=out))
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    F.linear(x, w)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                for _ in range(10):
                    F.linear(x, w)
            graph = time_fn(g.replay, reps=20) / 10
            flops, nbytes = 2 * M * K * N, 2 * (K * N + M * K + M * N)
            rows.append(dict(M=M, op=name, K=K, N=N, eager_us=1e3 * eager, graph_us=1e3 * graph,
                             tflops=flops / (eager * 1e-3) / 1e12, GBs=nbytes / (eager * 1e-3) / 1e9))
            r = rows[-1]
            print(f"M={M:5d} {name:9s} eager {r['eager_us']:8.1f} us  graph {r['graph_us']:8.1f} us  "
                  f"{r['tflops']:6.1f} TFLOP/s  {r['GBs']:6.0f} GB/s", flush=True)
    return rows


def decoding_engine(model, B: int, eager: bool):
    """An engine on `model` with B sequences of 1024-token prompts (160 new tokens each),
    stepped until every prompt is prefilled and 3 decode steps ran (graph captured): the
    next steps are pure decode at batch B."""
    from rlfuse.engine import LLM, EngineConfig, SamplingParams

    llm = LLM(model, None, EngineConfig(max_model_len=2048, max_num_seqs=256, enforce_eager=eager,
                                        num_kv_blocks=B * 80 + 16))
    g = torch.Generator().manual_seed(B)
    for _ in range(B):
        llm.add_request(torch.randint(0, 10000, (1024,), generator=g).tolist(),
                        SamplingParams(temperature=1.0, max_tokens=160, ignore_eos=True))
    # until every prompt is prefilled: the scheduler mixes decodes of early sequences with
    # later prefills, and those mixed steps run eager (the first probe timed them as decode)
    while llm.scheduler.waiting or any(s.num_computed < s.num_prompt_tokens for s in llm.scheduler.running):
        llm.step()
    for _ in range(3):  # first decode steps: capture the graph
        llm.step()
    return llm


def decode_profile(B=256, steps=5, eager=False):
    """Device time per kernel over `steps` decode steps at batch B (1024-token prompts),
    CUDA-graph replay or eager: where a decode step's time goes. Top kernels first."""
    from torch.profiler import ProfilerActivity, profile

    from rlfuse.engine.benchmark import build_model

    llm = decoding_engine(build_model(False, torch.device("cuda"), 0), B, eager)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append(dict(kernel=e.key[:90], ms_per_step=t / 1e3 / steps, calls_per_step=e.count / steps))
    rows.sort(key=lambda r: -r["ms_per_step"])
    total = sum(r["ms_per_step"] for r in rows)
    print(f"{'eager' if eager else 'graph'} decode B={B}: {total:.2f} ms device time per step "
          f"(graph steps so far {llm.stats.graph_steps})")
    for r in rows[:15]:
        print(f"  {r['ms_per_step']:8.3f} ms  {r['calls_per_step']:6.1f}x  {r['kernel']}")
    llm.sleep()
    return dict(batch=B, eager=eager, device_ms_per_step=total, top=rows[:25])


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    res = dict(device=torch.cuda.get_device_name(), gemms=gemms())
    try:
        res["graph_profile"] = decode_profile()
    except Exception as e:  # diagnostic: report and keep the GEMM table
        res["graph_profile_error"] = repr(e)
        print(repr(e))
    (OUT / "probe_decode.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
