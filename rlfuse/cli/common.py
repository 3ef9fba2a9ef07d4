"""Shared CLI plumbing for the training commands: CONFIG resolution, --set overrides,
--resume, run-folder and runtime set-up (threads), and a key listing for --help."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

from rlfuse.train.config import RunConfig, load_config
from rlfuse.train.config_io import describe

log = logging.getLogger("rlfuse.cli")
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def resolve_config_path(name: str) -> Path:
    """A YAML path, or the name of a built-in recipe (rlfuse/recipes/<name>.yaml)."""
    path = Path(name)
    if path.exists():
        return path
    builtin = RECIPES / (name if name.endswith(".yaml") else f"{name}.yaml")
    if builtin.exists():
        return builtin
    raise ValueError(f"config {name!r}: no such file and no built-in recipe of that name "
                     f"(built-in recipes: {', '.join(recipe_names())})")


def add_config_arguments(p: argparse.ArgumentParser, *, resume: bool = True) -> None:
    p.add_argument("config", metavar="CONFIG",
                   help=f"recipe YAML file or built-in recipe name ({', '.join(recipe_names())})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set grpo.clip_high=0.28 (repeatable; see below)")
    p.add_argument("--run-dir", default=None, help="shorthand for --set logging.run_dir=PATH")
    if resume:
        p.add_argument("--resume", action="store_true",
                       help="continue from the latest complete checkpoint in the run folder (checkpoint.resume=auto)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; RLFUSE_THREADS also sets it)")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "config keys (--set KEY=VALUE):\n" + "\n".join("  " + ln for ln in describe(RunConfig))


def load_run_config(args) -> RunConfig:
    over = list(args.overrides)
    if getattr(args, "run_dir", None):
        over.append(f"logging.run_dir={args.run_dir}")
    if getattr(args, "resume", False):
        over.append("checkpoint.resume=auto")
    return load_config(resolve_config_path(args.config), over)


def setup_threads(threads: int | None) -> None:
    n = threads if threads is not None else (int(os.environ["RLFUSE_THREADS"]) if "RLFUSE_THREADS" in os.environ
                                             else None)
    if n is not None:
        torch.set_num_threads(n)
        log.info("torch CPU threads: %d (--threads / RLFUSE_THREADS)", n)


def fail(e: Exception) -> int:
    """User errors end the command with their message (no traceback), exit status 2."""
    print(f"rlfuse: error: {e}", file=sys.stderr)
    return 2
