"""`rlfuse demo`: the embedded default -- tiny Qwen3-style model, SFT warm-up, GRPO on
arithmetic, held-out accuracy before and after (rlfuse.recipes.demo). `--agent`: the same
tiny model learns to call a calculator on 3-digit multiplication (rlfuse.recipes.agent_demo).
`--vision`: a tiny Qwen3-VL learns to count red squares in images (rlfuse.recipes.vision_demo).
Nothing downloaded. The demo holds its folder's run lock (rlfuse.run.folder.RunLock, as the
training commands do) from before it replaces a previous demo until demo.json is written:
a second demo on the same folder is refused, naming the holder, with nothing removed."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from rlfuse.cli.common import fail, setup_threads
from rlfuse.kernels.backend import NUMERICS
from rlfuse.kernels.kv_quant import KV_CACHE_DTYPES
from rlfuse.recipes.agent_demo import HARNESSES, TASKS, run_agent_demo
from rlfuse.recipes.demo import MOE_MODEL, SIZES, run_demo
from rlfuse.recipes.vision_demo import run_vision_demo
from rlfuse.run import RunLock, clear_run, make_folder, remove_path, set_threads
from rlfuse.run.report import render

HELP = ("the embedded default: tiny Qwen3-style model (--hybrid: a Qwen3.5-style hybrid), SFT warm-up, GRPO on "
        "arithmetic, eval before/after")
log = logging.getLogger("rlfuse.cli")


def add_arguments(p):
    p.add_argument("--size", choices=SIZES, default=None,
                   help="cpu (~2 min on 2 CPU cores: docs/benchmarks.md), ci (shortened), gpu (larger); "
                        "default: gpu with CUDA, else cpu")
    p.add_argument("--run-dir", default=None,
                   help="run folder (default runs/demo, runs/agent_demo with --agent); a previous demo there is "
                        "replaced, and said so")
    p.add_argument("--agent", action="store_true",
                   help="multi-turn with a tool: SFT on calculator transcripts, then GRPO on episodes that call "
                        "it (3-digit multiplication), vs a no-tool baseline")
    p.add_argument("--harness", choices=HARNESSES, default="env",
                   help="with --agent: env (rlfuse's own episode loop) or an agent written against the OpenAI "
                        "client (openai_loop, agents_sdk, langgraph: rlfuse.recipes.agent_harnesses), trained "
                        "through the training process's own server (rollout.agent)")
    p.add_argument("--task", choices=tuple(TASKS), default="calculator",
                   help="with --agent: the tool task: calculator (3-digit multiplication), lookup (a random key's "
                        "value in the lookup tool's table) or count (a letter's count in a word, the count tool)")
    p.add_argument("--moe", action="store_true",
                   help="a tiny Qwen3-MoE model (4 experts, top-2, every layer sparse) instead of the dense one "
                        "(cpu and ci sizes)")
    p.add_argument("--hybrid", action="store_true",
                   help="the arithmetic demo on a tiny Qwen3.5-style hybrid model (Gated DeltaNet + gated attention)")
    p.add_argument("--vision", action="store_true",
                   help="a tiny Qwen3-VL learns to count the red squares in small images (cpu and ci sizes; "
                        "exact numerics)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--numerics", choices=NUMERICS, default="fast",
                   help="engine.numerics: exact makes every rollout log-prob equal the trainer's bitwise "
                        "(GRPO's mismatch/max_abs reads 0 at every step)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="engine.kv_cache_dtype: fp8_e4m3 stores K/V in fp8 (the trainer reads them quantized the "
                        "same way; docs/numerics.md)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default 1 for the CPU sizes: the ops of a 0.4M-parameter model "
                        "are too small to gain from intra-op threads)")


def replace_previous_demo(root: Path) -> None:
    """A re-run replaces the previous demo whole: its stage folders' files (metrics,
    TensorBoard, checkpoints, final/), its report/ and demo.json, so nothing stale or doubled
    is left; each removal is logged."""
    for stage in ("sft", "grpo", "no_tool"):  # no_tool: the agent demo's baseline
        if (root / stage).is_dir():
            clear_run(root / stage, "rlfuse demo (a re-run replaces the previous demo)")
    for name in ("report", "demo.json"):
        if remove_path(root / name):
            log.warning("rlfuse demo (a re-run replaces the previous demo): removed %s", root / name)


def run(args) -> int:
    if args.agent and args.hybrid:
        return fail(ValueError("demo: --hybrid runs the arithmetic demo; it does not combine with --agent"))
    if sum((args.moe, args.hybrid, args.vision, args.agent)) > 1:
        return fail(ValueError("demo: --agent, --moe, --hybrid and --vision pick different demos; give one"))
    if args.vision and args.size == "gpu":
        return fail(ValueError("demo: --vision runs at the cpu or ci size"))
    size = args.size or ("cpu" if args.vision or not torch.cuda.is_available() else "gpu")
    args.run_dir = args.run_dir or ("runs/agent_demo" if args.agent else "runs/demo_vision" if args.vision
                                    else "runs/demo")
    if args.size is None:
        log.info("demo size %s (%s)", size, "CUDA available" if size == "gpu" else "no CUDA device")
    try:
        if args.threads is not None or size == "gpu":
            setup_threads(args.threads)
        else:
            set_threads(1, "the demo's tiny model: intra-op threading costs more than it saves")
        root = make_folder(args.run_dir, "--run-dir")
        with RunLock(root).acquire():
            replace_previous_demo(root)
            if args.harness != "env" and not args.agent:
                raise ValueError("--harness runs with --agent")
            if args.moe and (args.agent or size == "gpu"):
                raise ValueError("demo: --moe runs the arithmetic demo at the cpu or ci size (not with --agent or "
                                 "--size gpu)")
            if args.task != "calculator" and not args.agent:
                raise ValueError("--task picks the tool task of --agent")
            extra = {"harness": args.harness, "task": args.task} if args.agent else {}
            run = run_agent_demo if args.agent else run_vision_demo if args.vision else run_demo
            overrides = {"engine.numerics": args.numerics, "engine.kv_cache_dtype": args.kv_cache_dtype}
            if args.moe:
                overrides["model.random_init"] = MOE_MODEL
            if args.hybrid:
                extra["hybrid"] = True
            res = run(size, args.run_dir, seed=args.seed, overrides=overrides, **extra)
            summary = {k: v for k, v in res.items() if k not in ("grpo_history",)}
            with open(root / "demo.json", "w") as f:
                json.dump(summary, f, indent=2)
    except ValueError as e:
        return fail(e)
    try:
        index = render(args.run_dir)  # the plots too: what `rlfuse report` writes
    except ValueError as e:  # a demo that logged no metrics (a stand-in run in tests): nothing to plot
        print(f"wrote {args.run_dir}/demo.json; no plots ({e})")
        return 0
    print(f"wrote {args.run_dir}/demo.json; plots and summary: {index}")
    return 0
