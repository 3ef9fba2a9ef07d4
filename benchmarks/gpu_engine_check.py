"""Engine checks on one GPU (H100): GPU tests, decode step times, bf16 log-prob agreement.

  1. pytest: the `gpu`-marked engine tests (CUDA graphs vs eager vs naive greedy, live
     weights under graphs, sleep/wake memory, memory budget) -> pass/fail;
  2. decode step time on the Qwen3-0.6B-shaped random bf16 model: B sequences with
     1024-token prompts decode 64 tokens; median wall time per decode step with CUDA
     graphs and eager, and the host-side share (scheduler + input preparation +
     postprocessing, measured with the device idle) -- the per-step Python overhead;
  3. rollout vs trainer log-probs in bf16: the engine's reported log-probs against
     `teacher_forced_logprobs` (packed forward, the trainer's path) on the same tokens:
     max / mean |diff| (a measurement, no threshold: bf16 kernels differ in order).
Each stage runs on its own; a failing stage prints its traceback and the rest go on.

    OUT=./out python benchmarks/gpu_engine_check.py
Writes $OUT/gpu_engine_check.json and prints a table.
"""

import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from probe_decode import decode_profile, decoding_engine  # benchmarks/probe_decode.py (the script's directory)
from rlfuse.engine import LLM, EngineConfig, SamplingParams
from rlfuse.engine.benchmark import build_model
from rlfuse.engine.model_runner import Pending
from rlfuse.engine.naive import teacher_forced_logprobs

OUT = Path(os.environ.get("OUT", "out"))


def stage_pytest():
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_engine.py",
                        "-p", "no:cacheprovider"], capture_output=True, text=True)
    print(r.stdout[-4000:], r.stderr[-2000:])
    return dict(returncode=r.returncode, summary=r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "")


def _decode_step_times(model, B, eager):
    llm = decoding_engine(model, B, eager)
    walls, hosts = [], []
    launch = llm.runner.launch
    for _ in range(40):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.step()
        walls.append(time.perf_counter() - t0)
    # host share: the same step with the device work removed (the runner's launch returns a
    # finished step at once: token 1, log-prob 0 for every sequence)
    llm.runner.launch = lambda seqs, n, feed=None: Pending(
        list(range(len(seqs))), torch.ones(len(seqs), dtype=torch.long, device="cuda"),
        torch.tensor([[1.0] * len(seqs), [0.0] * len(seqs)], dtype=torch.float64), None)
    for _ in range(10):
        t0 = time.perf_counter()
        llm.step()
        hosts.append(time.perf_counter() - t0)
    llm.runner.launch = launch
    graph_steps = llm.stats.graph_steps
    llm.sleep()  # free the KV pool and graphs now: the next engine needs the memory
    return statistics.median(walls), statistics.median(hosts), graph_steps


def stage_step_times():
    model = build_model(False, torch.device("cuda"), 0)
    rows = []
    for B in (1, 8, 64, 256):
        for eager in (False, True):
            wall, host, graphs = _decode_step_times(model, B, eager)
            rows.append(dict(batch=B, mode="eager" if eager else "graphs", step_ms=1e3 * wall,
                             host_ms_per_step=1e3 * host, tok_s=B / wall, graph_steps=graphs))
            print(rows[-1])
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def stage_profile():
    """Kernel profile of eager decode steps at batch 256 (the graph-replay profile is
    `benchmarks/probe_decode.py`)."""
    return decode_profile(eager=True)


def stage_logprobs():
    model = build_model(False, torch.device("cuda"), 0)
    llm = LLM(model, None, EngineConfig(max_model_len=2048, max_num_seqs=64, num_kv_blocks=4096))
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(16, 600, (32,), generator=g).tolist()
    prompts = [torch.randint(0, 10000, (n,), generator=g).tolist() for n in lens]
    out = {}
    for T in (1.0, 0.6):
        outs = llm.generate(prompts, SamplingParams(temperature=T, max_tokens=128, ignore_eos=True, seed=0))
        with torch.no_grad():
            ref = teacher_forced_logprobs(model, prompts, [o.output_token_ids for o in outs], T)
        d = torch.cat([(o.logprobs - r.cpu()).abs() for o, r in zip(outs, ref)])
        out[f"T={T}"] = dict(max_abs=float(d.max()), mean_abs=float(d.mean()), tokens=int(d.numel()))
        print(T, out[f"T={T}"])
    return out


def main():
    logging.basicConfig(level="INFO")
    OUT.mkdir(parents=True, exist_ok=True)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    for name, fn in (("pytest", stage_pytest), ("step_times", stage_step_times), ("logprobs", stage_logprobs),
                     ("profile", stage_profile)):
        try:
            res[name] = fn()
        except Exception:  # report and continue: one broken stage must not hide the others
            res[name] = dict(error=traceback.format_exc())
            print(res[name]["error"])
    (OUT / "gpu_engine_check.json").write_text(json.dumps(res, indent=2))
    print("\n| stage | result |\n|---|---|")
    print(f"| pytest -m gpu | {res['pytest'].get('summary', res['pytest'].get('error', '')[-200:])} |")
    for r in res["step_times"] if isinstance(res["step_times"], list) else []:
        print(f"| decode B={r['batch']} {r['mode']} | {r['step_ms']:.2f} ms/step, host {r['host_ms_per_step']:.2f} ms, "
              f"{r['tok_s']:,.0f} tok/s |")
    if "error" not in res["logprobs"]:
        for k, v in res["logprobs"].items():
            print(f"| bf16 rollout vs trainer log-prob {k} | max {v['max_abs']:.2e}, mean {v['mean_abs']:.2e} "
                  f"over {v['tokens']} tokens |")
    return 0 if res["pytest"].get("returncode") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
