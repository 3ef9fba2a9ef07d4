"""The demo on the GPU in exact numerics: held-out accuracy before/after GRPO, and the
rollout-vs-trainer log-prob mismatch of every GRPO step (must be exactly 0).
    python benchmarks/exact_demo_check.py [--run-dir DIR]
Runs `rlfuse demo --size gpu --numerics exact`, then reads DIR/grpo/metrics.jsonl."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlfuse.cli import main as rlfuse_main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default="runs/demo_exact")
    args = ap.parse_args()
    rc = rlfuse_main(["demo", "--size", "gpu", "--numerics", "exact", "--run-dir", args.run_dir])
    if rc:
        return rc
    rows = [json.loads(line) for line in (Path(args.run_dir) / "grpo" / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    steps = [r for r in rows if "mismatch/max_abs" in r]
    worst = max(r["mismatch/max_abs"] for r in steps)
    demo = json.loads((Path(args.run_dir) / "demo.json").read_text())
    print(json.dumps({"grpo_steps_logged": len(steps), "max_mismatch_over_steps": worst,
                      "all_steps_zero": all(r["mismatch/max_abs"] == 0.0 for r in steps),
                      **{k: demo[k] for k in ("accuracy_sft", "accuracy_grpo") if k in demo}}))
    return 0 if worst == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
