"""The `rlfuse` command line: the only package that reads argv and the environment.

Each subcommand is a module here (`rlfuse/cli/<name>.py`) with `HELP` (one line),
`add_arguments(parser)` and `run(args) -> int`; `COMMANDS` lists them. `python -m rlfuse`
(rlfuse/__main__.py) runs the same `main`.

    rlfuse --help
    rlfuse demo                 # the embedded default: tiny model, SFT warm-up, GRPO, eval
    rlfuse sft CONFIG [--set a.b=v ...] [--resume]
    rlfuse grpo CONFIG [--set a.b=v ...] [--resume]
    rlfuse dpo CONFIG [--set a.b=v ...] [--resume]
    rlfuse check --tiny --numerics exact
"""

from __future__ import annotations

import argparse
import logging
import sys

from rlfuse.cli import bench, check, demo, dpo, generate, grpo, report, sft
from rlfuse.cli import eval as eval_cmd

COMMANDS = {"demo": demo, "sft": sft, "grpo": grpo, "dpo": dpo, "eval": eval_cmd, "generate": generate,
            "report": report, "check": check, "bench": bench}
"""Subcommand name -> its module, in the order `--help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlfuse", description="RL post-training of LLMs on one shared copy of the weights.")
    p.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, mod in COMMANDS.items():
        sp = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(sp)
        sp.set_defaults(handler=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "handler", None):
        parser.print_help()
        return 0
    return args.handler(args)
