"""The `rlfuse` command line: the only package that reads argv and the environment.

Each subcommand with a real implementation lives in its own module here
(`rlfuse/cli/<name>.py`) exposing `add_arguments(parser)` and `run(args) -> int`;
`COMMANDS` maps the name to that module. Others answer "not yet implemented".

    rlfuse --help
    rlfuse demo                 # the embedded default: tiny model, SFT warm-up, GRPO, eval
    rlfuse sft CONFIG [--set a.b=v ...]
    rlfuse grpo CONFIG [--set a.b=v ...] [--resume]
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

SUBCOMMANDS = {
    "demo": "the embedded default: tiny Qwen3-style model, SFT warm-up, GRPO on arithmetic, eval before/after",
    "sft": "supervised fine-tuning from a recipe (YAML)",
    "grpo": "GRPO / DAPO / Dr. GRPO / GSPO training from a recipe (YAML)",
    "eval": "evaluate a checkpoint on a recipe's eval set",
    "generate": "generate completions for prompts with the built-in engine",
    "report": "render PNG plots and an HTML summary of a run folder",
    "check": "prove rollout log-probs equal training log-probs (exact numerics) or measure the drift (fast)",
    "bench": "benchmarks (generate, kernels)",
}

# name -> module under rlfuse.cli with add_arguments(parser) and run(args)
COMMANDS: dict[str, str] = {
    "demo": "demo",
    "sft": "sft",
    "grpo": "grpo",
    "eval": "eval",
    "report": "report",
    "generate": "generate",
    "check": "check",
    "bench": "bench",
}


def _not_yet(name):
    def run(args):
        print(f"rlfuse {name}: not yet implemented", file=sys.stderr)
        return 2
    return run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlfuse", description="RL post-training of LLMs on one shared copy of the weights.")
    p.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_ in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        if name in COMMANDS:
            mod = importlib.import_module(f"rlfuse.cli.{COMMANDS[name]}")
            mod.add_arguments(sp)
            sp.set_defaults(handler=mod.run)
        else:
            sp.set_defaults(handler=_not_yet(name))
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "handler", None):
        parser.print_help()
        return 0
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
