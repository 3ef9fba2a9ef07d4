"""How long a data-parallel model takes to be ready (issue 39, "fast model building and loading").

Three torchrun jobs on --gpus GPUs, a Qwen3 shape (bench_multi_gpu.py's random recipes):
  random   model.init keyed: built on the meta device, each rank draws only its rows (build_sharded);
           then the final export: the weights gathered on rank 0 and written as an HF folder
  folder   that folder read back shard by shard (model.path, build_sharded)
Reported per job: the build (from the barrier after init_distributed to the last rank's model,
synchronized), the export where there is one, the launch-to-ready wall (torchrun start to
ready: imports, CUDA and NCCL set-up included) and when each stage before the build ended
(process start, imports, init_distributed, the first barrier). Targets: 8B on 4 GPUs ready in <= 20 s random,
<= 40 s from a folder.

    OUT=out python3 benchmarks/bench_ready.py --shape 8b --gpus 4 --work /tmp/ready
    OUT=out python3 benchmarks/bench_ready.py --small --gpus 2 --work /tmp/ready   # CPU, gloo
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))


def worker(cfg_path: str, folder: str, t_launch: float, export: bool) -> None:
    stages = {"start": time.time()}  # the seconds from launch at which each stage ended (rank 0's)
    import torch
    import torch.distributed as dist

    from rlfuse.run.build import build_sharded, build_tokenizer
    from rlfuse.run.checkpoint import export_model
    from rlfuse.run.config.run_config import load_config
    from rlfuse.run.distributed.context import init_distributed, launch_env, shutdown

    stages["imports"] = time.time()
    cfg = load_config(cfg_path)
    env = launch_env(os.environ)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    ctx = init_distributed(env, device_type=device_type)
    stages["init_distributed"] = time.time()
    tok = build_tokenizer(cfg.model)
    spec = cfg.model if export else dataclasses.replace(cfg.model, path=folder, random_init=None)
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    dist.barrier()  # the first collective: NCCL builds its communicator here
    t0 = stages["first_barrier"] = time.time()
    model = build_sharded(spec, tok, ctx, seed=cfg.seed)
    sync()
    dist.barrier()
    t1 = time.time()
    res = {"build_s": t1 - t0, "ready_wall_s": t1 - t_launch,
           "stages_s": {k: round(v - t_launch, 2) for k, v in stages.items()}}
    if device_type == "cuda":
        res["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    if export:
        export_model(folder, model, tok, dist=ctx, dtype=torch.bfloat16)
        dist.barrier()
        res["export_s"] = time.time() - t1
    if ctx.is_main:
        print("READY " + json.dumps(res), flush=True)
    shutdown()


def launch(J, name: str, gpus: int, cfg: Path, folder: Path, export: bool, timeout: float) -> dict:
    """One torchrun job through bench_multi_gpu.py's job runner (its log, time limit and the
    stop of a timed-out job's workers): its rc, wall and the READY line's times."""
    argv = ["torchrun", "--standalone", "--nproc_per_node", str(gpus), str(Path(__file__).resolve()), "--worker", str(cfg),
            "--folder", str(folder), "--t-launch", str(time.time())] + (["--export"] if export else [])
    r = J.run(name, argv, timeout=timeout)
    log = (J.logs / f"{name}.log").read_text(errors="replace").splitlines()
    ready = [ln for ln in log if ln.startswith("READY ")]
    return {"rc": r["rc"], "wall_s": r["wall_s"], **(json.loads(ready[-1][6:]) if ready else {}),
            **({"errors": r["errors"]} if r["rc"] else {})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker")
    ap.add_argument("--folder", default="")
    ap.add_argument("--t-launch", type=float, default=0.0)
    ap.add_argument("--export", action="store_true")
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--work", default="/tmp/bench_ready")
    ap.add_argument("--job-timeout", type=float, default=300)
    ap.add_argument("--small", action="store_true", help="tiny fp32 model on CPU (gloo): a smoke test of this script")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.folder, args.t_launch, args.export)
        return 0
    import multi_gpu_jobs as M

    M.SMALL[0] = args.small
    work = Path(args.work)
    M.setup(work)
    cfg = M.recipe(work, f"ready_{args.shape}", "grpo", shape=args.shape, model={"init": "keyed"})
    folder = work / f"folder_{args.shape}"
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    J = M.Jobs(work, out, "ready")
    rows = {"random": launch(J, "random", args.gpus, cfg, folder, True, args.job_timeout)}
    print(json.dumps(rows["random"]), flush=True)
    if rows["random"]["rc"] == 0:
        rows["folder"] = launch(J, "folder", args.gpus, cfg, folder, False, args.job_timeout)
        print(json.dumps(rows["folder"]), flush=True)
    J.finish({"shape": args.shape, "gpus": args.gpus, **rows})  # $OUT/bench_multi_gpu_ready.json + the logs
    print(f"\n| {args.shape} on {args.gpus} | rc | build s | launch-to-ready s | export s | peak MiB | "
          f"stages ended at (s from launch) |\n|---|---|---|---|---|---|---|")
    for k, r in rows.items():
        stages = ", ".join(f"{n} {t:.1f}" for n, t in r.get("stages_s", {}).items())
        print(f"| {k} | {r['rc']} | {r.get('build_s', float('nan')):.1f} | {r.get('ready_wall_s', float('nan')):.1f} | "
              f"{r.get('export_s', float('nan')):.1f} | {r.get('peak_mib', float('nan')):.0f} | {stages} |")
    return 0 if all(r["rc"] == 0 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
