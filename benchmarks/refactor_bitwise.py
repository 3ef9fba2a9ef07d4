"""Bitwise evidence for a pure refactor: tiny SFT, GRPO (fast and exact), PPO and DPO runs
through the CLI of a source tree, with hashes of their metrics and final weights, plus
`rlfuse check --tiny --numerics exact`. Run it on the tree before and after a move and
compare the tables (issue 21's and issue 33's notes did so).

    python benchmarks/refactor_bitwise.py --tree . --out /tmp/after [--resume-from /tmp/before]

--resume-from DIR: also continue the run folders an earlier invocation (e.g. the code before
the move) wrote in DIR for 2 more steps with `--resume --force` and hash those final weights:
checkpoints written before a move must still resume.

The recipe: a 1-layer Qwen3-style model (hidden 32), char tokenizer, builtin:arithmetic
1-digit +, fp32 on CPU; sft 4 steps, grpo/ppo/dpo 3 steps; a checkpoint every 2 steps.
Hashes: sha256 over every numeric metrics.jsonl value except time/*, tokens_per_s* and
memory/*; sha256 of final/model.safetensors (16 hex digits shown).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

TINY_MODEL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
RECIPE = {
    "seed": 0,
    "model": {"random_init": TINY_MODEL, "tokenizer": "char", "dtype": "float32", "device": "cpu"},
    "data": {"train": "builtin:arithmetic", "task": {"digits": 1, "ops": "+"}, "train_size": 60,
             "eval_size": 10, "max_prompt_len": 8},
    "rewards": [{"name": "arithmetic"}, {"name": "length_penalty", "kwargs": {"max_len": 3}}],
    "optim": {"lr": 1e-2, "schedule": "constant"},
    "sft": {"steps": 4, "batch_size": 8},
    "grpo": {"steps": 3, "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 3},
    "ppo": {"steps": 3},
    "dpo": {"steps": 3, "batch_size": 4},
    "engine": {"max_num_seqs": 16},
    "logging": {"tensorboard": False, "progress": False},
    "checkpoint": {"every": 2, "keep_last": 2},
}
FROM_SFT = ["--set", "model.random_init=null"]
RUNS = {  # name: (command, extra args); the RL runs start from the SFT run's final weights
    "sft": ("sft", []),
    "grpo_fast": ("grpo", FROM_SFT),
    "grpo_exact": ("grpo", FROM_SFT + ["--set", "engine.numerics=exact", "--set", "grpo.loss_type=dapo"]),
    "ppo": ("ppo", FROM_SFT),
    "dpo": ("dpo", FROM_SFT + ["--set", "data.train=builtin:arithmetic_pref"]),
}
SKIP = ("time/", "memory/", "tokens_per_s")  # wall-clock and memory readings vary run to run


def metrics_hash(path: Path) -> tuple[int, str, float | None]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    h, last_loss = hashlib.sha256(), None
    for r in rows:
        for k in sorted(r):
            v = r[k]
            if k.startswith(SKIP) or k.endswith("tokens_per_s") or isinstance(v, bool):
                continue
            if isinstance(v, (int, float)):
                h.update(f"{k}={v!r};".encode())
        for k in ("loss", "train/loss", "sft/loss"):
            if isinstance(r.get(k), (int, float)):
                last_loss = r[k]
    return len(rows), h.hexdigest()[:16], last_loss


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def cli(tree: Path, args: list[str], cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "rlfuse", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"rlfuse {' '.join(args)} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return p.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, required=True, help="source tree whose rlfuse runs")
    ap.add_argument("--out", type=Path, required=True, help="folder for the recipe, run folders, table")
    ap.add_argument("--resume-from", type=Path, help="an earlier --out whose checkpoints to resume")
    a = ap.parse_args()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    recipe = out / "base.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    table = {}
    for name, (cmd, extra) in RUNS.items():
        run_dir = out / name
        shutil.rmtree(run_dir, ignore_errors=True)
        sft_final = ["--set", f"model.path={out / 'sft' / 'final'}"] if extra else []
        cli(a.tree, [cmd, str(recipe), "--run-dir", str(run_dir), *sft_final, *extra], out)
        rows, mh, loss = metrics_hash(run_dir / "metrics.jsonl")
        table[name] = {"rows": rows, "metrics": mh, "weights": file_hash(run_dir / "final" / "model.safetensors"),
                       "last_loss": loss}
        if a.resume_from:
            src = a.resume_from.resolve() / name
            res = out / f"{name}_resumed"
            shutil.rmtree(res, ignore_errors=True)
            shutil.copytree(src, res)
            steps = RECIPE[cmd]["steps"] + 2
            prev = ["--set", f"model.path={a.resume_from.resolve() / 'sft' / 'final'}"] if extra else []
            cli(a.tree, [cmd, str(recipe), "--run-dir", str(res), "--resume", "--force", *prev, *extra,
                         "--set", f"{cmd}.steps={steps}"], out)
            table[name]["resumed_weights"] = file_hash(res / "final" / "model.safetensors")
    check = cli(a.tree, ["check", "--tiny", "--numerics", "exact"], out)
    table["check_tiny_exact"] = [ln for ln in check.splitlines() if ln.strip()][-12:]
    (out / "table.json").write_text(json.dumps(table, indent=1))
    print("| run | metric rows | metrics hash | weights hash | last loss | resumed weights |")
    print("|---|---|---|---|---|---|")
    for name, r in table.items():
        if name != "check_tiny_exact":
            print(f"| {name} | {r['rows']} | {r['metrics']} | {r['weights']} | {r['last_loss']} | "
                  f"{r.get('resumed_weights', '')} |")
    print("\n".join(table["check_tiny_exact"]))


if __name__ == "__main__":
    main()
