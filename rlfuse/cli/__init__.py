"""The `rlfuse` command line: the only package that reads argv and the environment.

Each subcommand has `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`: a
module here (`rlfuse/cli/<name>.py`), or, for the four training commands, a row of one
table (`rlfuse/cli/train.py`: TRAIN_COMMANDS); `COMMANDS` lists them. `python -m rlfuse`
(rlfuse/__main__.py) runs the same `main`.

    rlfuse --help
    rlfuse demo                 # the embedded default: tiny model, SFT warm-up, GRPO, eval
    rlfuse sft CONFIG [--set a.b=v ...] [--resume]
    rlfuse grpo CONFIG [--set a.b=v ...] [--resume]
    rlfuse ppo CONFIG [--set a.b=v ...] [--resume]
    rlfuse dpo CONFIG [--set a.b=v ...] [--resume]
    rlfuse check --tiny --numerics exact
    rlfuse serve MODEL_OR_RUN [--port 8000]
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Iterator, Mapping

from rlfuse import __version__

COMMAND_HELP = {
    "demo": ("the embedded default: tiny Qwen3-style model (--hybrid: a Qwen3.5-style hybrid), SFT warm-up, GRPO on "
             "arithmetic, eval before/after"),
    "sft": "supervised fine-tuning from a recipe (YAML)",
    "grpo": "GRPO / DAPO / Dr. GRPO / GSPO training from a recipe (YAML)",
    "ppo": "PPO with a critic (GAE, clipped value loss, KL-shaped reward) from a recipe (YAML)",
    "dpo": "DPO / IPO / conservative DPO on preference pairs from a recipe (YAML)",
    "eval": "evaluate a checkpoint on a recipe's eval set",
    "generate": "generate completions for prompts with the built-in engine",
    "serve": "serve a model or run over an OpenAI-compatible HTTP API (completions, chat)",
    "report": "render PNG plots and an HTML summary of a run folder",
    "check": "prove rollout log-probs equal training log-probs (exact numerics) or measure the drift (fast)",
    "bench": "benchmarks (generate)",
}
"""Subcommand name -> its help line, in the order `--help` lists them. Each command's module
says the same line as its HELP (tests/test_train_cli.py checks); the copy here lets
`rlfuse --help` and `--version` answer without importing torch (the modules import it)."""

_TRAIN = ("sft", "grpo", "ppo", "dpo")  # rows of rlfuse.cli.train.TRAIN_COMMANDS


def load_command(name: str):
    """The subcommand's module (or TrainCommand row): HELP, add_arguments(parser), run(args)."""
    if name in _TRAIN:
        return importlib.import_module("rlfuse.cli.train").TRAIN_COMMANDS[name]
    return importlib.import_module(f"rlfuse.cli.{name}")


class _Commands(Mapping):
    """COMMANDS: name -> the subcommand, imported on first access (the names need no import)."""

    def __getitem__(self, name: str):
        if name not in COMMAND_HELP:
            raise KeyError(name)
        return load_command(name)

    def __iter__(self) -> Iterator[str]:
        return iter(COMMAND_HELP)

    def __len__(self) -> int:
        return len(COMMAND_HELP)


COMMANDS = _Commands()
"""Subcommand name -> its module (imported on access), in the order `--help` lists them."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; `only`: set up that subcommand's arguments alone (the others list their
    help line), so that a run imports one command's module, and `--help` none."""
    p = argparse.ArgumentParser(prog="rlfuse", description="RL post-training of LLMs on one shared copy of the weights.")
    p.add_argument("--version", action="version", version=f"rlfuse {__version__}")
    p.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show the engine's INFO lines (one per generate call; quiet by default)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, line in COMMAND_HELP.items():
        sp = sub.add_parser(name, help=line, description=line)
        if only is None or name == only:
            mod = COMMANDS[name]
            mod.add_arguments(sp)
            sp.set_defaults(handler=mod.run)
    return p


def _command_in(argv: list[str]) -> str:
    """The subcommand argv names ('' when none comes before --help / --version)."""
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--log-level":
            skip = True
        elif a in ("-h", "--help", "--version"):
            return ""
        elif not a.startswith("-"):
            return a if a in COMMAND_HELP else ""
    return ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only=_command_in(argv) or "")
    args = parser.parse_args(argv)
    args.argv = argv  # a stopped run prints the command that continues it
    level = args.log_level.upper()
    if not isinstance(logging.getLevelName(level), int):
        parser.error(f"--log-level: {args.log_level!r} is not a level (DEBUG, INFO, WARNING, ERROR)")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the engine logs every generate call and sleep/wake at INFO: hundreds of lines between progress bars
    quiet = not args.verbose and logging.getLogger().getEffectiveLevel() > logging.DEBUG
    logging.getLogger("rlfuse.engine").setLevel(logging.WARNING if quiet else logging.NOTSET)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 0
    # a command runs: its module (torch and all) is loaded by now
    from tqdm.contrib.logging import logging_redirect_tqdm

    from rlfuse.cli.common import fail
    try:
        with logging_redirect_tqdm():  # log lines go above the progress bar instead of through it
            return args.handler(args)
    except (ValueError, OSError) as e:  # user errors and file-system failures no command caught itself
        return fail(e)
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (which stops at a step instead)
        sys.stderr.write("\nrlfuse: interrupted\n")
        return 130
