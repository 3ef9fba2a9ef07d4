"""Multi-GPU runs of the real commands (torchrun, NCCL) against one GPU: does it run,
equivalence, GRPO scaling, faults. Needs >= 2 CUDA GPUs (one node).

Every job is a real command (`python3 -m rlfuse ...` or `torchrun --standalone
--nproc_per_node 2 -m rlfuse ...`) on a generated recipe: a Qwen3-shaped random-weight
model (bf16 unless noted), a character tokenizer saved as a folder, prompts of 128 random
letters (128 tokens) with 64-letter SFT completions, reward = share of even token ids
(any reward with variance will do). Run folders live under --work (default /tmp/mgpu);
results go to $OUT/bench_multi_gpu_<phase>.json, every job's log into
$OUT/logs_<phase>.tar.gz, and a table is printed last.

Phases (several may be given; they run in order):
  env     nvidia-smi, device count, NCCL / PyTorch multicast variables, versions
  run     SFT (fp32) and GRPO (bf16, numerics exact) on 1 GPU and on 2 GPUs, 3 steps, same
          global batch and seed: per-step metric and final-weight differences, exact
          mismatch; GRPO fast numerics on 2 GPUs (CUDA graphs after each wake); DPO 1 vs N: kinds2
  kinds   PPO (policy and critic sharded), LoRA GRPO (base and adapters replicated),
          LoRA GRPO in stream mode, full fine-tune GRPO in stream mode (FSDP2-sharded: groups
          sum in finishing order, so 1 vs N agree to rounding, not bitwise) and GRPO through a
          server-recorded agent (rollout.agent:
          two chat calls an episode, each rank its own server and engine), bf16, exact
          numerics, on 1 GPU and on 2 GPUs, 3 steps, same global batch and seed: per-step
          metric and final-weight (LoRA: adapter) differences, exact mismatch
  kinds2  DPO (reference precompute and live), GRPO with an environment (rollout.env), with tools
          (rollout.tools), on image rows (a tiny Qwen3-VL) and through the Python API (rows in
          memory, trainer.generate), the same comparison plus the generated texts
          (benchmarks/multi_gpu_kinds.py), on a pool of --kinds-slots GPUs
  scale   GRPO 8 prompts x 8 completions per GPU, <=1024 new tokens, per --scale-runs
          SHAPE:GPUS[:SETTINGS] (settings: distributed.* FSDP2 knobs, or any recipe key); with
          --profile-train, the train phase of one step profiled on every rank (rlfuse.run.profile):
          a second table (all-gather / reduce-scatter / all-reduce / compute / exposed
          communication / idle / host-sync seconds, max over ranks and rank 0, collective counts,
          top host ops) and $OUT/profile_traces_<i>.tar (rank 0's and the slowest rank's traces)
  faults  on --fault-gpus N (2 or 4): a reward raising on the last rank, its reward worker
          SIGKILLed, the rank itself SIGKILLed mid-step (kill_rank), the N-GPU step-2
          checkpoint resumed on N, N/2, ..., 1 GPUs vs the uninterrupted run
  moe     full fine-tuning GRPO (bf16, numerics exact) of a Qwen3-MoE shape (--moe-shape,
          default moe-3b: 2.9 B parameters, 64 experts top-8), experts FSDP2-sharded, on each
          of --moe-gpus (1 2 4), 3 steps, same global batch and seed: per-step
          metric differences against 1 GPU (the router losses apart: split-dependent), the
          log-prob mismatch and moe/routing_mismatch (max over ranks: 0 = 0 on every rank),
          step time and peak memory (the fullest GPU), final-weight differences

    OUT=out python3 benchmarks/bench_multi_gpu.py env run
    OUT=out python3 benchmarks/bench_multi_gpu.py scale --scale-runs 0.6b:1 0.6b:2 4b:2
    OUT=out python3 benchmarks/bench_multi_gpu.py scale --profile-train --scale-runs 0.6b:1 0.6b:2 0.6b:4 \
        0.6b:4:reshard_after_forward=false 0.6b:4:prefetch=2,reshard_after_backward=false
    OUT=out python3 benchmarks/bench_multi_gpu.py kinds
    OUT=out python3 benchmarks/bench_multi_gpu.py kinds2 --kinds-gpus 2
    OUT=out python3 benchmarks/bench_multi_gpu.py moe --moe-gpus 1 2 4 --job-timeout 900
The subprocesses inherit this environment unchanged (the machine's NCCL settings included).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multi_gpu_jobs import (  # noqa: E402  (benchmarks/multi_gpu_jobs.py)
    COMMON_SHAPE,
    DEADLINE,
    MOE_SHAPES,
    SHAPES,
    SMALL,
    Jobs,
    metric_diff,
    metrics,
    print_equivalence,
    recipe,
    setup,
    weight_diff,
)
from multi_gpu_kinds import phase_kinds2  # noqa: E402  (benchmarks/multi_gpu_kinds.py)

from rlfuse.run.config import load_config  # noqa: E402


# ------------------------------------------------------------------ phases
def phase_env(out: Path, work: Path) -> dict:
    import torch

    def sh(*argv):
        try:
            return subprocess.run(argv, capture_output=True, text=True).stdout
        except OSError as e:
            return repr(e)
    smi, topo = sh("nvidia-smi"), sh("nvidia-smi", "topo", "-m")
    env = {k: v for k, v in os.environ.items() if any(s in k for s in ("NCCL", "NVLS", "MULTICAST", "NVSHMEM", "SYMM"))}
    import transformers
    import triton
    info = {"device_count": torch.cuda.device_count(), "names": [torch.cuda.get_device_name(i)
                                                                 for i in range(torch.cuda.device_count())],
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None, "env": env, "nvidia_smi": smi, "topo": topo}
    print(smi)
    print(topo)
    print(json.dumps({k: v for k, v in info.items() if k not in ("nvidia_smi", "topo")}, indent=1))
    (out / "bench_multi_gpu_env.json").write_text(json.dumps(info, indent=1))
    return info


def phase_run(out: Path, work: Path, args) -> dict:
    J = Jobs(work, out, "run")
    sft = recipe(work, "sft", "sft", dtype="float32", save_final=True)
    grpo_x = recipe(work, "grpo_exact", "grpo", numerics="exact", prompts=8, group=4, new=64, save_final=True)
    grpo_f = recipe(work, "grpo_fast", "grpo", numerics="fast", prompts=8, group=4, new=64)
    # one-GPU references side by side (one per GPU), then the 2-GPU runs
    J.wait(J.start("sft_1gpu", J.argv("sft", sft, work / "sft1", 1), gpu="0"),
           J.start("grpo_exact_1gpu", J.argv("grpo", grpo_x, work / "grpox1", 1), gpu="1"))
    J.run("sft_2gpu", J.argv("sft", sft, work / "sft2", 2))
    J.run("grpo_exact_2gpu", J.argv("grpo", grpo_x, work / "grpox2", 2))
    J.run("grpo_fast_2gpu", J.argv("grpo", grpo_f, work / "grpof2", 2))
    eq = {
        "sft_fp32": {**metric_diff(metrics(work / "sft2", "sft"), metrics(work / "sft1", "sft")),
                     "weights": weight_diff(work / "sft2" / "final", work / "sft1" / "final")},
        "grpo_exact_bf16": {**metric_diff(metrics(work / "grpox2", "grpo"), metrics(work / "grpox1", "grpo")),
                            "weights": weight_diff(work / "grpox2" / "final", work / "grpox1" / "final")},
        "grpo_fast_2gpu_rows": metrics(work / "grpof2", "grpo"),
    }
    J.finish({"equivalence": eq})
    print("\n| job | rc | wall s |\n|---|---|---|")
    for r in J.results.values():
        print(f"| {r['name']} | {r['rc']} | {r['wall_s']} |")
    for k in ("sft_fp32", "grpo_exact_bf16"):
        print(f"\n{k}: weights {eq[k]['weights']}")
        print("| step | loss 1 GPU | loss 2 GPU | |dloss| | max rel metric diff (which) | mismatch max 1 / 2 |")
        print("|---|---|---|---|---|---|")
        for s in eq[k]["steps"]:
            print(f"| {s['step']} | {s['loss_1gpu']} | {s['loss_2gpu']} | {s['loss_abs_diff']:.2e} | "
                  f"{s['max_rel_diff']:.2e} ({s['where']}) | {s['mismatch_max_abs_1gpu']} / {s['mismatch_max_abs_2gpu']} |")
    return eq


def phase_kinds(out: Path, work: Path, args) -> dict:
    """PPO, LoRA GRPO, LoRA and full fine-tune stream mode and an agent: 1 GPU vs 2 GPUs (the
    module docstring's `kinds`)."""
    J = Jobs(work, out, "kinds")
    ppo = recipe(work, "ppo_exact", "ppo", numerics="exact", prompts=8, group=4, new=64, save_final=True)
    lora = recipe(work, "lora_exact", "grpo", numerics="exact", prompts=8, group=4, new=64, save_final=True,
                  model={"lora": {"rank": 16}}, optim={"lr": 1e-4})
    stream = recipe(work, "lora_stream", "grpo", numerics="exact", prompts=8, group=4, new=64, save_final=True,
                    model={"lora": {"rank": 16}}, optim={"lr": 1e-4}, grpo={"overlap": "stream"})
    # the KV pool stays allocated while groups train (full fine-tune: masters, moments, gradients beside it)
    fsdp_stream = recipe(work, "fsdp_stream", "grpo", numerics="exact", prompts=8, group=4, new=64, save_final=True,
                         gpu_frac=0.5, grpo={"overlap": "stream"})
    agent = recipe(work, "agent_exact", "grpo", numerics="exact", prompts=8, group=4, new=64, save_final=True,
                   model={"tokenizer": str(work / "tok_chat")},
                   rollout={"agent": f"{work}/agent.py:twice", "max_turn_tokens": 64, "max_total_tokens": 512})
    fresh = "--overwrite"  # a rerun in the same --work replaces its run folders
    J.wait(J.start("ppo_1gpu", J.argv("ppo", ppo, work / "ppo1", 1, fresh), gpu="0", timeout=args.job_timeout),
           J.start("lora_1gpu", J.argv("grpo", lora, work / "lora1", 1, fresh), gpu="1", timeout=args.job_timeout))
    J.wait(J.start("stream_1gpu", J.argv("grpo", stream, work / "stream1", 1, fresh), gpu="0", timeout=args.job_timeout),
           J.start("agent_1gpu", J.argv("grpo", agent, work / "agent1", 1, fresh), gpu="1", timeout=args.job_timeout))
    J.wait(J.start("fsdp_stream_1gpu", J.argv("grpo", fsdp_stream, work / "fsdp_stream1", 1, fresh), gpu="0",
                   timeout=args.job_timeout))
    n = args.kinds_gpus  # the "2gpu" jobs and folders keep their names at any N
    for run, cmd, cfg in (("ppo", "ppo", ppo), ("lora", "grpo", lora), ("stream", "grpo", stream),
                          ("fsdp_stream", "grpo", fsdp_stream), ("agent", "grpo", agent)):
        J.run(f"{run}_2gpu", J.argv(cmd, cfg, work / f"{run}2", n, fresh), timeout=args.job_timeout)
    eq = {name: {**metric_diff(metrics(work / f"{run}2", stage), metrics(work / f"{run}1", stage)),
                 "weights": weight_diff(work / f"{run}2" / "final", work / f"{run}1" / "final")}
          for name, run, stage in (("ppo_exact_bf16", "ppo", "ppo"), ("lora_grpo_exact_bf16", "lora", "grpo"),
                                   ("lora_stream_exact_bf16", "stream", "grpo"),
                                   ("fsdp_stream_exact_bf16", "fsdp_stream", "grpo"),
                                   ("agent_grpo_exact_bf16", "agent", "grpo"))}
    J.finish({"equivalence": eq, "gpus": n})
    print_equivalence(J, eq, n)
    return eq


# moe/aux_loss, moe/z_loss: share-weighted means over each rank's micro-batches, so another
# split of the batch gives other values by design (rlfuse.model.layers.moe.RouterLoss); their
# coefficients are 0 in these runs, so they do not enter the gradient
ROUTER_LOSSES = ("moe/aux_loss", "moe/z_loss")


def phase_moe(out: Path, work: Path, args) -> dict:
    """Full fine-tuning GRPO of an MoE shape under FSDP2 on each of --moe-gpus GPU counts
    (the module docstring's `moe`), compared with the 1-GPU run of this call or of an
    earlier call in the same --work (so `--moe-gpus 1 2` then `--moe-gpus 4` fit two device
    calls). model.init keyed: each rank draws only its shards; every run starts from the
    same weights."""
    J = Jobs(work, out, "moe")
    cfg = recipe(work, "moe_exact", "grpo", shape=args.moe_shape, numerics="exact", prompts=8, group=4, new=64,
                 save_final=True, model={"init": "keyed"}, engine={"numerics": "exact"})
    for n in args.moe_gpus:  # --overwrite: a rerun in the same --work replaces its run folder
        J.run(f"moe_{n}gpu", J.argv("grpo", cfg, work / f"moe{n}", n, "--overwrite"), gpu="0" if n == 1 else None,
              timeout=args.job_timeout)
    one = metrics(work / "moe1", "grpo")
    res = {"shape": args.moe_shape, "runs": {}}
    for n in sorted({*args.moe_gpus, *(int(d.name[3:]) for d in work.glob("moe[0-9]*") if metrics(d, "grpo"))}):
        rows = metrics(work / f"moe{n}", "grpo")
        job = J.results.get(f"moe_{n}gpu", {"rc": "earlier call", "errors": []})
        r = {"rc": job["rc"], "errors": job["errors"],
             "steps": [{k: row.get(k) for k in ("step", "loss", "time/step", "time/generate", "time/train",
                                               "memory/peak_mb", "mismatch/max_abs", "mismatch/full_max_abs",
                                               "moe/routing_mismatch", "moe/load_max")} for row in rows],
             "memory": {k: v for k, v in (rows[-1] if rows else {}).items() if k.startswith("memory/")}}
        if n > 1 and one:
            r["vs_1gpu"] = {**metric_diff(rows, one, skip=ROUTER_LOSSES),
                            "weights": weight_diff(work / f"moe{n}" / "final", work / "moe1" / "final")}
        res["runs"][n] = r
    J.finish({"moe": res})
    print(f"\nMoE full fine-tuning GRPO, shape {args.moe_shape}, exact numerics\n| job | rc | wall s |\n|---|---|---|")
    for r in J.results.values():
        print(f"| {r['name']} | {r['rc']} | {r['wall_s']} |")
    print("\n| GPUs | step | loss | step s | peak MiB (fullest GPU) | mismatch max | routing mismatch | "
          "max rel metric diff vs 1 GPU (which) |\n|---|---|---|---|---|---|---|---|")
    for n, r in res["runs"].items():
        diffs = {s["step"]: s for s in r.get("vs_1gpu", {}).get("steps", [])}
        for st in r["steps"]:
            d = diffs.get(st["step"])
            dtxt = f"{d['max_rel_diff']:.2e} ({d['where']})" if d else "-"
            print(f"| {n} | {st['step']} | {st['loss']} | {st['time/step']} | {st['memory/peak_mb']} | "
                  f"{st['mismatch/max_abs']} | {st['moe/routing_mismatch']} | {dtxt} |")
    for n, r in res["runs"].items():
        if "vs_1gpu" in r:
            print(f"{n} GPUs vs 1: final weights {r['vs_1gpu']['weights']}")
        print(f"{n} GPU(s) memory (MiB, fullest rank): {r['memory']}")
    return res


def summarize_scale(rows: list[dict], gpus: int, per_gpu_prompts: int, group: int, skip: tuple[int, ...] = ()) -> dict:
    """Means over the timed steps: after step 1 (CUDA graphs, compiles) and without `skip`
    (the profiled step, slowed by the profiler)."""
    timed = [r for r in rows if r.get("step", 0) > 1 and r.get("step") not in skip] or rows[1:]
    mean = lambda k: sum(r.get(k, 0.0) for r in timed) / max(len(timed), 1)  # noqa: E731
    seqs = per_gpu_prompts * group * gpus
    new_tokens = mean("completion_len/mean") * seqs
    return {"gpus": gpus, "steps_timed": [r.get("step") for r in timed], "generate_s": mean("time/generate"),
            "train_s": mean("time/train"),
            # the step's wall (time/step_wall: the rollout gather's wait included); older runs: the phases' sum
            "step_s": mean("time/step_wall" if timed and "time/step_wall" in timed[0] else "time/step"), "completion_len": mean("completion_len/mean"),
            "rollout_tok_s_total": new_tokens / max(mean("time/generate"), 1e-9),
            "rollout_tok_s_per_gpu": new_tokens / max(mean("time/generate"), 1e-9) / gpus,
            "peak_mib": max((r.get("memory/peak_mb", 0.0) for r in rows), default=0.0),
            # every step's phases: a profiled step's slowdown, and whether later steps still pay for it
            "per_step": [{k: r.get(k) for k in ("step", "time/generate", "time/train", "time/step", "time/step_wall")} for r in rows],
            **({k: rows[-1][k] for k in rows[-1] if k.startswith("memory/")} if rows else {})}


def kv_pool_gib(shape: str, blocks: int) -> float:
    """Bytes of `blocks` KV blocks of 16 tokens: layers x (K, V) x kv heads x head_dim x bf16."""
    sh = SHAPES[shape] | COMMON_SHAPE
    return blocks * 16 * sh["num_hidden_layers"] * 2 * sh["num_key_value_heads"] * sh["head_dim"] * 2 / 2**30


def parse_scale_run(spec: str) -> tuple[str, int, dict[str, dict]]:
    """SHAPE:GPUS[:KEY=VALUE,...] -> (shape, gpus, recipe sections). A bare KEY is a
    distributed.* field (reshard_after_forward, reshard_after_backward, prefetch, grad_sync);
    a dotted one any recipe key (grpo.micro_batch_tokens=32768). Values are YAML."""
    import yaml

    parts = spec.split(":", 2)
    if len(parts) < 2 or parts[0] not in SHAPES or not parts[1].isdigit():
        raise SystemExit(f"--scale-runs {spec!r}: expected SHAPE:GPUS[:KEY=VALUE,...], SHAPE one of {sorted(SHAPES)}")
    sections: dict[str, dict] = {}
    for kv in (parts[2].split(",") if len(parts) == 3 and parts[2] else []):
        key, eq, val = kv.partition("=")
        if not eq:
            raise SystemExit(f"--scale-runs {spec!r}: {kv!r} is not KEY=VALUE")
        sec, _, field = key.rpartition(".")
        sections.setdefault(sec or "distributed", {})[field] = yaml.safe_load(val)
    return parts[0], int(parts[1]), sections


PROFILE_COLS = ("wall_s", "all_gather_s", "reduce_scatter_s", "all_reduce_s", "other_s", "compute_s",
                "exposed_comm_s", "idle_s", "host_sync_s")


def read_profile(run_dir: Path, step: int) -> dict:
    """The per-rank profile summaries of `step` (rlfuse.run.profile) -> {"ranks": [...], "max": {...},
    "rank0": {...}, "slowest_rank"}; {} when the run wrote none."""
    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "profile").glob(f"step{step}_rank*.json"),
                                                       key=lambda p: int(p.stem.rsplit("rank", 1)[1]))]
    if not ranks:
        return {}
    mx = {k: max(r[k] for r in ranks) for k in PROFILE_COLS}
    mx["counts"] = {k: max(r["counts"][k] for r in ranks) for k in ranks[0]["counts"]}
    slowest = max(ranks, key=lambda r: r["wall_s"])
    return {"ranks": ranks, "max": mx, "rank0": ranks[0], "slowest_rank": slowest["rank"]}


def trimmed_trace(path: Path, min_host_us: float = 20.0) -> bytes:
    """A profile trace cut for the trip back: metadata, device events (kernels, copies), annotations
    (FSDP's ranges, gloo's work), collectives and host events of at least `min_host_us`."""
    import gzip

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rlfuse.run.profile import collective_kind

    t = json.loads(gzip.decompress(path.read_bytes()))
    keep = ("kernel", "gpu_memcpy", "gpu_memset", "user_annotation", "gpu_user_annotation")
    t["traceEvents"] = [e for e in t.get("traceEvents", []) if e.get("ph") == "M" or e.get("cat") in keep
                        or collective_kind(e.get("name", "")) or e.get("dur", 0) >= min_host_us]
    t["rlfuse_trimmed"] = f"host events under {min_host_us} us dropped (the run folder keeps the whole trace)"
    return gzip.compress(json.dumps(t).encode(), compresslevel=3)


def pack_traces(out: Path, table: list[dict], work: Path, step: int, *, tar_limit: int = 15 * 2**20,
                tars: int = 3) -> list[str]:
    """$OUT/profile_traces_<i>.tar (at most `tars`, each under `tar_limit` bytes: the device call
    returns at most 8 files of 16 MiB): rank 0's trace of every profiled run, then the slowest
    rank's; a trace too large for a whole tar goes trimmed (`trimmed_trace`). Returns what
    was left out."""
    import io
    import tarfile

    want = [(s["name"], 0) for s in table if s.get("profile")]
    want += [(s["name"], s["profile"]["slowest_rank"]) for s in table
             if s.get("profile") and s["profile"]["slowest_rank"] != 0]
    left, files, sizes = [], [], []
    for name, rank in want:
        f = work / name / "profile" / f"step{step}_rank{rank}.trace.json.gz"
        if not f.exists():
            continue
        if len(sizes) == tars and min(sizes) > tar_limit - 2**20:  # full: skip the reading (and trimming)
            left.append(f"{name}_rank{rank}.trace.json.gz")
            continue
        data, arc = f.read_bytes(), f"{name}_rank{rank}.trace.json.gz"
        if len(data) > tar_limit - 2**16:
            data, arc = trimmed_trace(f), f"{name}_rank{rank}.trimmed.trace.json.gz"
        i = next((i for i, n in enumerate(sizes) if n + len(data) + 2**12 <= tar_limit), None)
        if i is None and len(sizes) < tars and len(data) + 2**12 <= tar_limit:
            i = len(sizes)
            sizes.append(0)
            files.append(tarfile.open(out / f"profile_traces_{i}.tar", "w"))
        if i is None:
            left.append(arc)
            continue
        info = tarfile.TarInfo(arc)
        info.size = len(data)
        files[i].addfile(info, io.BytesIO(data))
        sizes[i] += len(data) + 2**10
    for tf in files:
        tf.close()
    return left


def _settings_text(sections: dict[str, dict]) -> str:
    val = lambda v: v if isinstance(v, str) else json.dumps(v)  # noqa: E731  (YAML spellings: false, 2, last)
    return ",".join(f"{k}={val(v)}" if sec == "distributed" else f"{sec}.{k}={val(v)}"
                    for sec, kv in sections.items() for k, v in kv.items()) or "default"


def phase_scale(out: Path, work: Path, args) -> dict:
    J = Jobs(work, out, "scale")
    table = []
    prof_step = args.profile_train
    # 64 sequences x (128 + 1024) tokens = 4608 blocks; a fixed pool makes the KV bytes known
    blocks = 4800
    jobs = []
    for spec in args.scale_runs:  # every recipe written and checked before the first job starts
        shape, gpus, sections = parse_scale_run(spec)
        settings = _settings_text(sections)
        slug = "".join(c if c.isalnum() else "_" for c in settings) if sections else ""
        name = f"grpo_{shape}_{gpus}gpu" + (f"_{slug}" if slug else "")
        if prof_step:
            sections = {**sections, "logging": {**sections.get("logging", {}), "profile_step": prof_step}}
        # model.init keyed unless a run says otherwise: each rank draws only its rows (the 8B's build
        # ~10 s instead of 113 s with the whole-model stream draw); other weights, same timings
        sections = {**sections, "model": {"init": "keyed", **sections.get("model", {})}}
        cfg = recipe(work, name, "grpo", shape=shape, steps=args.scale_steps, prompts=8 * gpus, group=8, new=1024,
                     max_seqs=64, kv_blocks=blocks, **sections)
        try:
            load_config(cfg)
        except ValueError as e:
            raise SystemExit(f"--scale-runs {spec!r}: {e}") from None
        jobs.append((shape, gpus, settings, name, cfg))
    for shape, gpus, settings, name, cfg in jobs:
        r = J.run(name, J.argv("grpo", cfg, work / name, gpus, "--overwrite"), gpu=None if gpus > 1 else "0",
                  timeout=args.job_timeout)
        # the FSDP2 trade the run resolved (distributed.trade auto picks by memory; rlfuse logs it)
        trade = re.search(r"FSDP2 trade (\w+)", (J.logs / f"{name}.log").read_text(errors="replace"))
        settings = f"{settings} ({trade.group(1)} trade)" if trade else settings
        s = {"name": name, "shape": shape, "settings": settings, "rc": r["rc"], "wall_s": r["wall_s"],
             "errors": r["errors"], **summarize_scale(metrics(work / name, "grpo"), gpus, 8, 8,
                                                       skip=(prof_step,) if prof_step else ()),
             "kv_gib": kv_pool_gib(shape, blocks), "profile": read_profile(work / name, prof_step) if prof_step else {}}
        table.append(s)
        print(json.dumps({k: v for k, v in s.items() if k != "profile"}), flush=True)
        if s["profile"]:  # now, not only in the final table: a call cut short keeps what ran
            print("profile " + json.dumps({"name": name, "max": s["profile"]["max"], "rank0": {
                k: v for k, v in s["profile"]["rank0"].items() if k in (*PROFILE_COLS, "counts", "top_host_ops")}}),
                flush=True)
    for s in table:
        ones = [t for t in table if t["shape"] == s["shape"] and t["gpus"] == 1 and t["rc"] == 0]
        one = next((t for t in ones if t["settings"].startswith("default")), ones[0] if ones else None)
        s["efficiency"] = (one["step_s"] / s["step_s"]) if one and s["rc"] == 0 and s["step_s"] else None
        s["train_efficiency"] = (one["train_s"] / s["train_s"]) if one and s["rc"] == 0 and s["train_s"] else None
    left = pack_traces(out, table, work, prof_step) if prof_step else []
    J.finish({"table": table, "profile_step": prof_step, "traces_left_out": left})
    print("\n| shape | GPUs | settings | rc | generate s | train s | step s | rollout tok/s total | per GPU | "
          "efficiency (train) | peak MiB | KV GiB | params/grads/optim/gathered MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in table:
        mem = "/".join(f"{s.get(f'memory/{k}_mib', float('nan')):.0f}" for k in ("params", "grads", "optimizer", "gathered"))
        eff = f"{s['efficiency']:.3f} ({s['train_efficiency']:.3f})" if s.get("efficiency") else "-"
        print(f"| {s['shape']} | {s['gpus']} | {s['settings']} | {s['rc']} | {s['generate_s']:.2f} | "
              f"{s['train_s']:.2f} | {s['step_s']:.2f} | {s['rollout_tok_s_total']:.0f} | "
              f"{s['rollout_tok_s_per_gpu']:.0f} | {eff} | {s['peak_mib']:.0f} | {s['kv_gib']:.2f} | {mem} |")
    if prof_step:
        print_profiles(table, prof_step)
    if left:
        print(f"traces left out of profile_traces_*.tar (size): {left}")
    return {"table": table}


def print_profiles(table: list[dict], step: int) -> None:
    """The profiled train phase side by side: each cell max over ranks / rank 0, seconds."""
    cols = ("wall", "all-gather", "reduce-scatter", "all-reduce", "other coll.", "compute", "exposed comm",
            "idle", "host sync")
    print(f"\nprofiled phase of step {step} (train unless the settings set logging.profile_phase; s; max over "
          f"ranks / rank 0; collectives: counts AG/RS/AR/other, max over ranks)")
    print("| shape | GPUs | settings | " + " | ".join(cols) + " | collectives | slowest rank | top host ops, rank 0 (self s) |")
    print("|" + "---|" * (len(cols) + 6))
    for s in table:
        p = s.get("profile")
        if not p:
            print(f"| {s['shape']} | {s['gpus']} | {s['settings']} | " + " | ".join("-" * 1 for _ in cols) +
                  " | - | - | no profile |")
            continue
        cells = [f"{p['max'][k]:.3f} / {p['rank0'][k]:.3f}" for k in PROFILE_COLS]
        c = p["max"]["counts"]
        top = ", ".join(f"{o['name'][:40]} {o['self_s']:.3f}" for o in p["rank0"]["top_host_ops"][:4])
        print(f"| {s['shape']} | {s['gpus']} | {s['settings']} | " + " | ".join(cells) +
              f" | {c['all_gather']}/{c['reduce_scatter']}/{c['all_reduce']}/{c['other']} | {p['slowest_rank']} | {top} |")


def resume_from(src: Path, dst: Path, step: int) -> None:
    """A run folder holding `src`'s step checkpoint and metrics, to be continued with --resume."""
    name = f"step_{step:06d}"
    shutil.rmtree(dst, ignore_errors=True)  # a rerun in the same --work starts from the copy again
    if (src / "checkpoints" / name).exists():
        shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
        for f in ("metrics.jsonl", "config.yaml", "run.json"):
            if (src / f).exists():
                shutil.copy(src / f, dst / f)


def phase_faults(out: Path, work: Path, args) -> dict:
    J = Jobs(work, out, "faults")
    res = {}
    try:
        # resume: 4 steps uninterrupted on N GPUs (checkpoint at step 2), then from its step-2
        # checkpoint --resume on N GPUs (same N: bitwise expected) and on each smaller power of two
        # down to 1 (N -> M resharding: within the documented tolerance)
        n = args.fault_gpus
        if not args.faults_only:
            full = recipe(work, "res_full", "grpo", numerics="exact", steps=4, prompts=8, group=4, new=64,
                          ckpt_every=2)
            J.run(f"resume_full_{n}gpu", J.argv("grpo", full, work / "res_full", n))
            targets = [n]
            while targets[-1] > 1:
                targets.append(targets[-1] // 2)
            for m in targets:
                k = f"res_{n}to{m}"
                resume_from(work / "res_full", work / k, 2)
                J.run(f"resume_{n}to{m}", J.argv("grpo", full, work / k, m, "--resume"), gpu="0" if m == 1 else None)
                res[k] = {**metric_diff(metrics(work / k, "grpo"), metrics(work / "res_full", "grpo")),
                          "weights": weight_diff(work / k / "final", work / "res_full" / "final")}
        for mode in () if args.resume_only else ("raise", "kill", "kill_rank"):
            rw = [{"name": f"{work}/reward.py:faulty", "kwargs": {"mode": mode, "rank": n - 1, "call": 2}}]
            cfg = recipe(work, f"fault_{mode}", "grpo", rewards=rw, steps=4, prompts=8, group=4, new=64)
            r = J.run(f"fault_{mode}", J.argv("grpo", cfg, work / f"fault_{mode}", n, "--dist-timeout", "60"),
                      timeout=240)
            res[mode] = {"rc": r["rc"], "wall_s": r["wall_s"], "error_lines": r["errors"]}
    finally:
        J.finish({"faults": res})
    print("\n| job | rc | wall s |\n|---|---|---|")
    for r in J.results.values():
        print(f"| {r['name']} | {r['rc']} | {r['wall_s']} |")
    for k in ("raise", "kill", "kill_rank"):
        if k in res:
            print(f"fault {k}: {res[k]}")
    for k in (k for k in res if k.startswith("res_")):
        print(f"{k}: weights {res[k]['weights']}; steps " +
              "; ".join(f"{s['step']}: {s['max_rel_diff']:.1e} ({s['where']})" for s in res[k]["steps"]))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phases", nargs="+", choices=("env", "run", "scale", "faults", "kinds", "kinds2", "moe"))
    ap.add_argument("--work", default="/tmp/mgpu", help="run folders and logs (large: final weights)")
    ap.add_argument("--scale-runs", nargs="+", default=["0.6b:1", "0.6b:2"], metavar="SHAPE:GPUS[:KEY=VALUE,...]",
                    help=f"GRPO scaling runs, shape one of {sorted(SHAPES)}; optional settings: distributed.* "
                         f"fields by bare name (0.6b:4:reshard_after_forward=false,prefetch=2) or dotted recipe keys")
    ap.add_argument("--scale-steps", type=int, default=4, help="GRPO steps per scaling run (step 1 is warm-up)")
    ap.add_argument("--profile-train", type=int, nargs="?", const=3, default=0, metavar="STEP",
                    help="scale: profile the train phase of step STEP (default 3) on every rank "
                         "(logging.profile_step; left out of the means); a second table and profile_traces_<i>.tar")
    ap.add_argument("--job-timeout", type=float, default=300)
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="start no job later than this many seconds minus 60 after the start (fit a device call)")
    ap.add_argument("--kinds-gpus", type=int, default=2, help="kinds, kinds2: GPUs of the data-parallel jobs (2 or 4)")
    ap.add_argument("--kinds-slots", type=int, default=0,
                    help="kinds2: GPUs its jobs share (0: every visible GPU; --small: --kinds-gpus)")
    ap.add_argument("--moe-shape", default="moe-3b", help=f"moe: the MoE shape, one of {sorted(MOE_SHAPES)}")
    ap.add_argument("--moe-gpus", type=int, nargs="+", default=[1, 2],
                    help="moe: the GPU counts to run (1 is the reference; e.g. 1 2, then 4 in a second call)")
    ap.add_argument("--fault-gpus", type=int, default=2, choices=(2, 4),
                    help="faults: GPUs of the uninterrupted and faulty runs (resumed on N, N/2, ..., 1)")
    ap.add_argument("--resume-only", action="store_true", help="faults: only the resume jobs")
    ap.add_argument("--faults-only", action="store_true", help="faults: only the raise / kill jobs, no resume")
    ap.add_argument("--small", action="store_true", help="tiny fp32 model on CPU (gloo): a smoke test of this script")
    args = ap.parse_args()
    SMALL[0] = args.small
    DEADLINE[0] = time.time() + args.budget_s
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    setup(work)
    for ph in args.phases:
        t0 = time.perf_counter()
        {"env": lambda: phase_env(out, work), "run": lambda: phase_run(out, work, args),
         "scale": lambda: phase_scale(out, work, args), "faults": lambda: phase_faults(out, work, args),
         "kinds": lambda: phase_kinds(out, work, args), "kinds2": lambda: phase_kinds2(out, work, args),
         "moe": lambda: phase_moe(out, work, args)}[ph]()
        print(f"=== phase {ph}: {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
