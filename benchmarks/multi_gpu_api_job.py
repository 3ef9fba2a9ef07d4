"""The Python API under torchrun: the `kinds2` phase's `api` job (benchmarks/multi_gpu_kinds.py).

Builds a `GRPOTrainer` from RECIPE (a bench_multi_gpu.py recipe: random-weight model,
reward file) with the training rows passed in memory (the first --rows rows of
--rows-file: rank 0 writes them to RUN_DIR/data/train.jsonl, every rank reads that file),
generates greedily for --prompts prompts (`trainer.generate`, a collective), trains
(the recipe's steps, final save), generates again, and writes both lists of texts to
RUN_DIR/generated.json (rank 0). One process without torchrun, N with it:

    python3 benchmarks/multi_gpu_api_job.py RECIPE --run-dir DIR --rows-file prompts.jsonl
    torchrun --standalone --nproc_per_node 2 benchmarks/multi_gpu_api_job.py RECIPE --run-dir DIR ...

Like the CLI, this entry point is the one that reads the environment (torchrun's) and
joins the process group; the library's `dist=` argument takes the context.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlfuse.api import GRPOTrainer, load_run_config  # noqa: E402
from rlfuse.run.build import pick_device  # noqa: E402
from rlfuse.run.distributed import init_distributed, launch_env, quiet_non_main, shutdown  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--rows-file", required=True, help="JSONL rows with a 'prompt' field")
    ap.add_argument("--rows", type=int, default=256, help="rows passed in memory")
    ap.add_argument("--prompts", type=int, default=6, help="prompts for trainer.generate (an uneven split on 4)")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    rows = [json.loads(x) for x in Path(args.rows_file).read_text().splitlines()[:args.rows]]
    rows = [{"prompt": r["prompt"], "answer": r.get("answer", "")} for r in rows]
    env = launch_env(os.environ)
    ctx = None
    if env is not None:
        device = pick_device(load_run_config(args.recipe).model.device)
        ctx = init_distributed(env, device_type=device.type, timeout_s=300)
        quiet_non_main(ctx)
    t = GRPOTrainer(config=args.recipe, train_dataset=rows, run_dir=args.run_dir, overwrite=True, dist=ctx)
    prompts = [r["prompt"] for r in rows[-args.prompts:]]  # the last rows: a step of 8 prompts does not reach them
    before = t.generate(prompts, max_tokens=args.max_tokens)
    t.train()
    after = t.generate(prompts, max_tokens=args.max_tokens)
    if ctx is None or ctx.is_main:
        (Path(args.run_dir) / "generated.json").write_text(json.dumps({"before": before, "after": after}))
    if ctx is not None:
        shutdown()
        # as rlfuse.cli.common.as_rank: torch's C++ teardown of a finished gloo job can abort at
        # interpreter exit ("terminate called without an active exception", seen here on 2 CPU
        # ranks after every file was written), which torchrun reports as a failed rank
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
