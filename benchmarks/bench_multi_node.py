"""A multi-node launch on one host (issue 39's "multi-node equivalence"): 2 "nodes" of G GPUs
each, as two torchrun agents meeting at a c10d rendezvous on 127.0.0.1, against one node of
2G GPUs (`torchrun --standalone`), on the same recipe, global batch and seed.

Jobs (the recipes of bench_multi_gpu.py: a Qwen3-0.6B-shaped random model, a character
tokenizer, 128-letter prompts, reward = share of even token ids; 3 steps):
  grpo   GRPO, bf16, exact numerics, 8 prompts x 4, 64 new tokens
  sft    SFT, fp32
Each job runs as one node and as two; reported per step: both losses, the largest relative
difference of any other metric (and which), each run's exact mismatch; then the final weights'
largest difference. The two launches differ only in how the processes met (rendezvous,
ranks spread over two agents); on one host NCCL still sees every GPU over NVLink, so this
checks the launch path and rank bookkeeping, not an inter-host network.

    OUT=out python benchmarks/bench_multi_node.py --gpus-per-node 2   # 4 GPUs: 2 x 2 vs 1 x 4
    OUT=out python benchmarks/bench_multi_node.py --gpus-per-node 1   # 2 GPUs: 2 x 1 vs 1 x 2
    python benchmarks/bench_multi_node.py --small                     # CPU (gloo) smoke test
Writes $OUT/bench_multi_node.json and $OUT/logs_nodes.tar.gz; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_multi_gpu as M  # noqa: E402  (the recipes, the job runner, the comparisons)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_argv(cmd: str, cfg: Path, run_dir: Path, per_node: int, port: int, node: int) -> list[str]:
    return ["torchrun", "--nnodes", "2", "--nproc_per_node", str(per_node), "--node_rank", str(node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_dir.name,
            "-m", "rlfuse", cmd, str(cfg), "--run-dir", str(run_dir)]


def _two_nodes(J: M.Jobs, name: str, cmd: str, cfg: Path, run_dir: Path, per_node: int, timeout: float) -> list[dict]:
    """Both agents at once, each with its own GPUs (node 0 the first `per_node` of the GPUs
    this script was given, node 1 the next)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(2 * per_node)]
    port, handles = _free_port(), []
    try:
        for node in (0, 1):
            if not M.SMALL[0]:
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[node * per_node:(node + 1) * per_node])
            handles.append(J.start(f"{name}_node{node}", _node_argv(cmd, cfg, run_dir, per_node, port, node),
                                   timeout=timeout))
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    return J.wait(*handles)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus-per-node", type=int, default=2, help="G: 2 x G GPUs against one node of 2G")
    ap.add_argument("--jobs", nargs="+", choices=("grpo", "sft"), default=["grpo", "sft"])
    ap.add_argument("--work", default="/tmp/mnode", help="run folders and logs")
    ap.add_argument("--job-timeout", type=float, default=300)
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="start no job later than this many seconds minus 60 after the start")
    ap.add_argument("--small", action="store_true", help="tiny fp32 model on CPU (gloo): a smoke test")
    args = ap.parse_args()
    M.SMALL[0] = args.small
    M.DEADLINE[0] = time.time() + args.budget_s
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    M.setup(work)
    G = 1 if args.small else args.gpus_per_node
    J = M.Jobs(work, out, "nodes")
    recipes = {"grpo": M.recipe(work, "grpo_nodes", "grpo", numerics="exact", prompts=8, group=4, new=64,
                                save_final=True),
               "sft": M.recipe(work, "sft_nodes", "sft", dtype="float32", save_final=True)}
    res = {}
    for job in args.jobs:
        one, two = work / f"{job}_1node", work / f"{job}_2nodes"
        J.run(f"{job}_1node", J.argv(job, recipes[job], one, 2 * G), timeout=args.job_timeout)
        _two_nodes(J, f"{job}_2nodes", job, recipes[job], two, G, args.job_timeout)
        res[job] = {**M.metric_diff(M.metrics(two, job), M.metrics(one, job)),
                    "weights": M.weight_diff(two / "final", one / "final")}
    J.finish({"gpus_per_node": G, "equivalence": res})
    (out / "bench_multi_node.json").write_text(json.dumps({"gpus_per_node": G, "jobs": J.results,
                                                           "equivalence": res}, indent=1, default=str))
    print(f"\n2 nodes x {G} against 1 node x {2 * G}\n\n| job | rc | wall s |\n|---|---|---|")
    for r in J.results.values():
        print(f"| {r['name']} | {r['rc']} | {r['wall_s']} |")
    for job, eq in res.items():
        print(f"\n{job}: final weights {eq['weights']}")
        print("| step | loss 1 node | loss 2 nodes | max rel metric diff (which) | mismatch max 1 / 2 nodes |")
        print("|---|---|---|---|---|")
        for s in eq["steps"]:
            print(f"| {s['step']} | {s['loss_1gpu']} | {s['loss_2gpu']} | {s['max_rel_diff']:.2e} ({s['where']}) | "
                  f"{s['mismatch_max_abs_1gpu']} / {s['mismatch_max_abs_2gpu']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
