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
import logging
import sys

from tqdm.contrib.logging import logging_redirect_tqdm

from rlfuse import __version__
from rlfuse.cli import bench, check, demo, generate, report, serve
from rlfuse.cli import eval as eval_cmd
from rlfuse.cli.common import fail
from rlfuse.cli.train import TRAIN_COMMANDS

COMMANDS = {"demo": demo, **TRAIN_COMMANDS, "eval": eval_cmd, "generate": generate, "serve": serve, "report": report,
            "check": check, "bench": bench}
"""Subcommand name -> its module, in the order `--help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlfuse", description="RL post-training of LLMs on one shared copy of the weights.")
    p.add_argument("--version", action="version", version=f"rlfuse {__version__}")
    p.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show the engine's INFO lines (one per generate call; quiet by default)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, mod in COMMANDS.items():
        sp = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(sp)
        sp.set_defaults(handler=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
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
    try:
        with logging_redirect_tqdm():  # log lines go above the progress bar instead of through it
            return args.handler(args)
    except (ValueError, OSError) as e:  # user errors and file-system failures no command caught itself
        return fail(e)
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (which stops at a step instead)
        sys.stderr.write("\nrlfuse: interrupted\n")
        return 130
