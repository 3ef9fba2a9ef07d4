"""Shared CLI plumbing for the training commands: CONFIG with --set overrides and --resume
(resolved by rlfuse.api.config), runtime set-up (threads, the process group under
torchrun), a key listing for --help, and the inference commands' engine options."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from rlfuse.api.config import load_run_config as api_config
from rlfuse.api.config import recipe_names
from rlfuse.engine import EngineConfig
from rlfuse.kernels.backend import NUMERICS
from rlfuse.run import Interrupted, choose_threads, data_lines, pick_device, read_jsonl, set_threads
from rlfuse.run.config import RunConfig, describe
from rlfuse.run.distributed import DistContext, init_distributed, launch_env, quiet_non_main, shutdown

log = logging.getLogger("rlfuse.cli")


ALGORITHMS = ("sft", "grpo", "ppo", "dpo")
"""The config sections of one algorithm each; a command's --help lists only its own."""


def add_config_arguments(p: argparse.ArgumentParser, *, resume: bool = True, uses: tuple[str, ...] = ()) -> None:
    """CONFIG, --set and the run options; the epilog lists the config keys the command
    reads: every section but the other algorithms' (`uses`: the algorithm sections, or
    single keys of another algorithm's section, it reads)."""
    p.add_argument("config", metavar="CONFIG",
                   help=f"recipe YAML file or built-in recipe name ({', '.join(recipe_names())})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set grpo.clip_high=0.28 (repeatable; see below)")
    p.add_argument("--run-dir", default=None, help="shorthand for --set logging.run_dir=PATH")
    if resume:
        p.add_argument("--resume", action="store_true",
                       help="continue from the latest complete checkpoint in the run folder (checkpoint.resume=auto)")
        p.add_argument("--overwrite", action="store_true",
                       help="replace the run already in the run folder (its metrics, checkpoints, final/)")
        p.add_argument("--force", action="store_true",
                       help="with --resume: accept changes of the model, data, seeds or algorithm")
    add_threads_argument(p)
    p.add_argument("--dist-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="under torchrun: how long a rank waits in a collective for the others before it fails")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    skip = tuple(f"{a}." for a in ALGORITHMS if a not in uses)
    keep = tuple(f"{k} " for k in uses if "." in k)
    keys = [ln for ln in describe(RunConfig) if not ln.startswith(skip) or ln.startswith(keep)]
    p.epilog = ("config keys this command reads (--set KEY=VALUE; all of them: docs/configuration.md):\n"
                + "\n".join("  " + ln for ln in keys))


def load_run_config(args) -> RunConfig:
    """CONFIG with --set, --run-dir and --resume applied (rlfuse.api.config)."""
    over = list(args.overrides)
    if getattr(args, "run_dir", None):
        over.append(f"logging.run_dir={args.run_dir}")
    if getattr(args, "resume", False):
        over.append("checkpoint.resume=auto")
    return api_config(args.config, over)


def run_flags(args) -> dict:
    """--resume / --overwrite / --force as the trainers' keywords (rlfuse.run.folder)."""
    return dict(resume=getattr(args, "resume", False), overwrite=getattr(args, "overwrite", False),
                force=getattr(args, "force", False), words="cli")


THREADS_HELP = ("torch CPU threads (default: automatic, logged: 1 for a model under 20M parameters, else the idle "
                "cores; RLFUSE_THREADS also sets it)")


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The model and engine options of the inference commands (generate, serve)."""
    add_threads_argument(p)
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="model dtype: float32, bfloat16 or float16 (default: the "
                                                 "checkpoint's)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt + completion (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences decoded together")
    p.add_argument("--gpu-memory-fraction", type=float, default=0.9,
                   help="share of the GPU's memory the engine may use (weights + KV cache)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--numerics", choices=NUMERICS, default="fast",
                   help="engine numerics: exact = batch-invariant kernels, each request's log-probs independent "
                        "of the batch it ran in (docs/numerics.md)")


def engine_config(args) -> EngineConfig:
    return EngineConfig(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        gpu_memory_fraction=args.gpu_memory_fraction, enforce_eager=args.enforce_eager,
                        numerics=args.numerics)


def resume_command(args) -> str:
    """The command line that continues this run: the same arguments, with --resume instead
    of --overwrite."""
    argv = [a for a in getattr(args, "argv", []) if a != "--overwrite"]
    if "--resume" not in argv:
        argv.append("--resume")
    return shlex.join(["rlfuse", *argv])


def stopped(args, e: Interrupted, ctx: DistContext | None = None) -> int:
    """A run stopped by a signal: where its steps are and the exact command that continues
    it; exit status 128 + the signal (130 SIGINT, 143 SIGTERM)."""
    if ctx is None or ctx.is_main:
        where = f"checkpoint {e.checkpoint}" if e.checkpoint else "no new checkpoint (no step since the last one)"
        torchrun = " (with the same torchrun options)" if ctx is not None else ""
        sys.stderr.write(f"rlfuse: stopped by {signal.Signals(e.signum).name} after step {e.step}; {where}; "
                         f"continue with: {resume_command(args)}{torchrun}\n")
        sys.stderr.flush()
    return e.exit_code


def print_summary(command: str, res: dict) -> None:
    """The closing lines of a training command: the held-out metric first -> last over the
    whole run (a resumed run's earlier evaluations are read from its metrics.jsonl), the run
    folder, then the data checks (rows kept / dropped per split)."""
    evals = run_evals(res)
    if evals:
        first, last = evals[0], evals[-1]
        key = "accuracy" if "accuracy" in last else "reward"
        change = (f"{first[key]:.4f} (step {first['step']}) -> {last[key]:.4f} (step {last['step']})"
                  if first["step"] != last["step"] else f"{last[key]:.4f} (step {last['step']})")
        print(f"{command} done: held-out {key} {change}; run folder {res['run_dir']}")
    else:
        print(f"{command} done; run folder {res['run_dir']}")
    print_data(res)


def run_evals(res: dict) -> list[dict]:
    """The held-out evaluations of the whole run: metrics.jsonl's eval rows (a resumed run's
    earlier ones included), else those of this process (res["evals"])."""
    return [r for r in read_jsonl(Path(res["run_dir"]) / "metrics.jsonl") if r.get("stage") == "eval"] or res["evals"]


def print_data(res: dict) -> None:
    """One `data` line per split: rows kept, dropped and truncated by reason (run_loop's "data")."""
    for line in data_lines(res.get("data", {})):
        print(f"data {line}")


def setup_threads(threads: int | None, *, model_decides: bool = False) -> None:
    """torch's CPU threads from --threads, else RLFUSE_THREADS (ValueError unless an integer
    >= 1), else the automatic choice (`rlfuse.run.choose_threads`: the idle cores), logged
    with its reason. `model_decides`: leave the automatic choice to the trainer, which knows
    the model's size (a tiny one takes 1 thread)."""
    what, raw = ("--threads", threads) if threads is not None else ("RLFUSE_THREADS", os.environ.get("RLFUSE_THREADS"))
    if raw is None:
        if not model_decides:
            set_threads(*choose_threads())
        return
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1 or str(raw).strip() != str(n):
        raise ValueError(f"{what}: expected an integer >= 1 (torch CPU threads), got {raw!r}")
    set_threads(n, what)


def fail(e: Exception) -> int:
    """User errors (ValueError) and file-system failures (OSError: the path and what
    happened) end the command with one `rlfuse: error: ...` line, no traceback, exit status 2."""
    if isinstance(e, OSError) and e.filename is not None:
        msg = f"{e.filename}: {e.strerror or e}"
    else:
        msg = str(e)
    # one write of the whole line: under torchrun every rank reports into one pipe, and a
    # write this small is atomic there, so the ranks' lines never interleave
    sys.stderr.write(f"rlfuse: error: {msg}\n")
    sys.stderr.flush()
    return 2


def as_rank(body: Callable[[], int]) -> Callable[[], int]:
    """A training command's body as run: unchanged in a plain process; under torchrun
    wrapped in torch's `record`, so torchrun's summary names the failing rank with its
    traceback, and ended with os._exit once the body returned (see below)."""
    if launch_env(os.environ) is None:
        return body

    def rank_main() -> int:
        try:
            rc = record(body)()
        except Exception as e:
            # errors outside the shared phases (those end with `fail`'s line on every rank):
            # one line naming this rank before torchrun's summary and traceback
            print(f"rlfuse: error: rank {os.environ.get('RANK', '?')} raised {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            raise
        # The run is over and its files are written and closed; torch's C++ teardown of a
        # finished gloo job can still abort at interpreter exit ("terminate called without an
        # active exception", seen in CPU tests), which torchrun reports as a failed rank.
        # Leave without running those destructors.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(rc)
    return rank_main


def start_distributed(args, cfg: RunConfig) -> DistContext | None:
    """Under torchrun (its variables in the environment): join the process group on the
    run's device type (NCCL on GPUs, gloo on CPU; collectives time out after
    --dist-timeout) and quiet the logs of ranks other than 0. A plain process: None,
    nothing distributed is set up."""
    env = launch_env(os.environ)
    if env is None:
        return None
    ctx = init_distributed(env, device_type=pick_device(cfg.model.device).type, timeout_s=args.dist_timeout)
    quiet_non_main(ctx)
    return ctx


def end_distributed(ctx: DistContext | None) -> None:
    """After a successful run: leave the process group (a failing rank just exits)."""
    if ctx is not None:
        shutdown()


def agent_flags(cfg) -> dict:
    """The trainer / session argument that runs rollout.agent's episodes, if the recipe has one."""
    if not cfg.rollout.agent:
        return {}
    # optional dependencies (the `serve` extra, and openai): imported only for an agent recipe
    from rlfuse.serve import agent_sampler
    return {"sampler_factory": agent_sampler}
