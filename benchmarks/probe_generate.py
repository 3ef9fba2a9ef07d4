"""Where a whole `generate` step's wall time goes (diagnostic, GPU): the bench's fixed
case (256 prompts of 128 ids, 512 new tokens, temperature 0.6) on the Qwen3-0.6B-shaped
model, stepped by hand.

Run with look-ahead off, then on (EngineConfig.look_ahead). Pass 1 times every step (wall, batch size, graph or eager). Pass 2 wraps the step's
parts (scheduler, block-table upload + host arrays, decode graph replay, LM head,
sampler, log-prob, read-back, the engine's bookkeeping) with a device sync before and
after each, so each part's time is attributed to it (this serializes host and device:
the sum is larger than pass 1's step). Pass 3 profiles 5 mid-run decode steps (CUDA
kernels) to compare device busy time with the step's wall time.
    OUT=./out python benchmarks/probe_generate.py
Writes $OUT/probe_generate.json and prints tables.
"""

import collections
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from rlfuse.engine import model_runner as mr
from rlfuse.engine.benchmark import BenchConfig, build_model, make_cases
from rlfuse.engine.config import EngineConfig
from rlfuse.engine.llm import LLM
from rlfuse.kernels._triton_common import compiled_variants, new_variants

OUT = Path(os.environ.get("OUT", "out"))


SMALL = "--small" in sys.argv  # CPU smoke test of this script: tiny model, small case
DEV = torch.device("cpu" if SMALL else "cuda")


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def engine(look_ahead=True):
    b = BenchConfig()
    model = build_model(SMALL, DEV, 0)
    llm = LLM(model, None, EngineConfig(max_num_seqs=b.max_num_seqs, max_num_batched_tokens=b.max_num_batched_tokens,
                                        max_model_len=128 if SMALL else 2048, gpu_memory_fraction=b.gpu_memory_fraction,
                                        look_ahead=look_ahead))
    llm.capture_graphs()
    llm.generate([[1] * 16], mr_params(8))
    return llm


def mr_params(n):
    from rlfuse.engine.config import SamplingParams
    return SamplingParams(max_tokens=n)


def add_case(llm, name="fixed"):
    case = next(c for c in make_cases(SMALL, (name,)) if c.name == name)
    for p, sp in zip(case.prompts, case.params):
        llm.add_request(p, sp)


def pass_steps(llm):
    add_case(llm)
    rows = []
    sync()
    v0 = compiled_variants()
    t_all = time.perf_counter()
    while llm.has_unfinished():
        g0, d0 = llm.runner.graph_steps, llm.stats.decode_steps
        t0 = time.perf_counter()
        llm.step()
        rows.append(dict(ms=1e3 * (time.perf_counter() - t0), B=len(llm.scheduler.running),
                         graph=llm.runner.graph_steps > g0, decode=llm.stats.decode_steps > d0))
    sync()
    total = time.perf_counter() - t_all
    dec = [r["ms"] for r in rows if r["decode"]]
    eag = [r["ms"] for r in rows if not r["decode"]]
    res = dict(total_s=total, compiles=new_variants(v0, compiled_variants()), steps=len(rows), graph_steps=sum(r["graph"] for r in rows), decode_steps=len(dec),
               decode_median_ms=statistics.median(dec),
               decode_mean_ms=statistics.mean(dec), decode_p90_ms=sorted(dec)[int(0.9 * len(dec))],
               non_decode_ms=[round(x, 1) for x in eag][:20], first_graph_ms=[round(r["ms"], 1) for r in rows[:12]],
               slowest=sorted(((round(r["ms"], 1), i) for i, r in enumerate(rows)), reverse=True)[:10])
    print("pass 1 (plain steps):", json.dumps(res), flush=True)
    return res


def pass_parts(llm):
    acc = collections.defaultdict(list)

    def timed(name, fn):
        @functools.wraps(fn)
        def w(*a, **k):
            sync()
            t0 = time.perf_counter()
            r = fn(*a, **k)
            sync()
            acc[name].append(1e3 * (time.perf_counter() - t0))
            return r
        return w

    r = llm.runner
    saved = dict(schedule=llm.scheduler.schedule, sync_bt=r._sync_block_tables, replay=r._replay,
                 eager=r._run_eager, logits=r._logits, logprobs=r._logprobs, launch=r.launch)
    llm.scheduler.schedule = timed("schedule", saved["schedule"])
    r._sync_block_tables = timed("sync_block_tables", saved["sync_bt"])
    r._replay = timed("graph_replay", saved["replay"])
    r._run_eager = timed("eager_forward", saved["eager"])
    r._logits = timed("lm_head", saved["logits"])
    r._logprobs = timed("logprob", saved["logprobs"])
    r.launch = timed("runner.launch (all, synced)", saved["launch"])
    sample0 = mr.sample
    mr.sample = timed("sample", sample0)
    add_case(llm)
    step_ms = []
    try:
        while llm.has_unfinished():
            t0 = time.perf_counter()
            llm.step()
            step_ms.append(1e3 * (time.perf_counter() - t0))
    finally:
        mr.sample = sample0
        for k in ("schedule",):
            llm.scheduler.schedule = saved[k]
        r._sync_block_tables, r._replay, r._run_eager = saved["sync_bt"], saved["replay"], saved["eager"]
        r._logits, r._logprobs, r.launch = saved["logits"], saved["logprobs"], saved["launch"]
    res = {k: dict(n=len(v), median_ms=statistics.median(v), total_s=sum(v) / 1e3) for k, v in acc.items()}
    res["step (all, synced parts)"] = dict(n=len(step_ms), median_ms=statistics.median(step_ms),
                                           total_s=sum(step_ms) / 1e3)
    print("pass 2 (synced parts):")
    for k, v in res.items():
        print(f"  {k:26s} n={v['n']:5d} median {v['median_ms']:8.3f} ms  total {v['total_s']:7.2f} s")
    return res


def pass_profile(llm, skip=100, steps=5):
    skip = 3 if SMALL else skip
    from torch.profiler import ProfilerActivity, profile
    add_case(llm)
    for _ in range(skip):
        llm.step()
    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        sync()
    wall = 1e3 * (time.perf_counter() - t0) / steps
    while llm.has_unfinished():
        llm.step()
    dev = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or 0
        if t > 0:
            dev.append((t / 1e3 / steps, e.count / steps, e.key[:80]))
    dev.sort(reverse=True)
    cpu = sorted(((e.self_cpu_time_total / 1e3 / steps, e.count / steps, e.key[:80]) for e in prof.key_averages()),
                 reverse=True)
    busy = sum(d[0] for d in dev)
    print(f"pass 3 (profiled, {steps} decode steps at step {skip}): wall {wall:.2f} ms/step (profiler on), "
          f"device kernels {busy:.2f} ms/step")
    for d in dev[:15]:
        print(f"  dev {d[0]:8.3f} ms {d[1]:6.1f}x {d[2]}")
    for c in cpu[:15]:
        print(f"  cpu {c[0]:8.3f} ms {c[1]:6.1f}x {c[2]}")
    return dict(wall_ms=wall, device_ms=busy, top_device=dev[:25], top_cpu=cpu[:25])


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    res = dict(device=torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", commit=os.environ.get("RLFUSE_COMMIT", "?"))
    for la in (False, True):
        llm = engine(look_ahead=la)
        key = "look_ahead" if la else "plain"
        print(f"--- {key}", flush=True)
        res[key] = dict(first=pass_steps(llm), again=pass_steps(llm), stats=str(llm.stats))
        if not la:
            res[key]["parts"] = pass_parts(llm)  # synced parts: only meaningful without look-ahead
        res[key]["profile"] = pass_profile(llm)
        llm.sleep()
        del llm
    (OUT / "probe_generate.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
