"""Run a test job on N local ranks (gloo on CPU) with torch.multiprocessing.spawn.

Each rank leaves with os._exit once its job returned: torch's teardown of a finished
gloo job can abort at interpreter exit ("terminate called without an active exception",
SIGABRT), seen on the loaded 2-core CI machine, and spawn reports that as a failed rank.
`rlfuse.cli.common.as_rank` ends torchrun ranks the same way. A job that raises still
reaches spawn's error reporting (the exception is raised before the exit)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_then_exit(rank: int, job, args: tuple) -> None:
    job(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def gloo_rank(rank: int, world: int, port: int, timeout_s: float = 120):
    """Inside a spawned job: join the gloo group on localhost as `rank` of `world`, one
    torch thread (the ranks share the CI machine's cores), non-main ranks' logs quieted ->
    the DistContext the trainers take as `dist`."""
    from rlfuse.run.distributed import context as D

    torch.set_num_threads(1)
    env = {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    ctx = D.init_distributed(D.launch_env(env), device_type="cpu", timeout_s=timeout_s)
    D.quiet_non_main(ctx)
    return ctx


def spawn_ranks(job, nprocs: int, *args) -> None:
    """job(rank, *args) on nprocs processes; raises if a rank fails."""
    mp.spawn(_run_then_exit, args=(job, args), nprocs=nprocs, join=True)


def run_ranks(job, world: int, out, label: str = "") -> None:
    """job(rank, port, out) on `world` gloo ranks (a fresh port); prints their wall time."""
    t0 = time.perf_counter()
    spawn_ranks(job, world, free_port(), str(out))
    print(f"\n{world}-rank {label + ' ' if label else ''}runs: {time.perf_counter() - t0:.1f} s")


@contextlib.contextmanager
def torch_threads(n: int = 1):
    """torch's intra-op threads set to n inside, restored after: the one-process reference runs
    use one thread as each rank does."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
