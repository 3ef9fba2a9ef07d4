"""Data-parallel training over several processes: the process group, cross-rank sums,
metrics and failure handling (PyTorch's own stack). FSDP2 sharding and the engine's
gathered weights are in fsdp.py, DCP checkpoint I/O in dcp.py, beside this file.

Launch: `torchrun --nproc_per_node N ...`; the CLI reads torchrun's variables with
`launch_env(os.environ)` (only the CLI reads the environment) and passes the result to
`init_distributed`, which returns the `DistContext` everything below takes. Plain
single-process runs never call this module.

What lives where on each of N ranks (P parameters, see docs/distributed.md):
  * fp32 master weights, fp32 gradients, fp32 Adam moments: sharded (dim-0 shards of
    every parameter, FSDP2 `fully_shard`), 16 P / N bytes;
  * bf16 compute weights: all-gathered per decoder layer in forward / backward and freed
    after it (FSDP2 MixedPrecisionPolicy casts the fp32 shard to bf16 before the
    all-gather); for rollouts `gathered_weights(model)` keeps every layer gathered
    (2 P bytes) and the engine runs on exactly those tensors: no second copy and no
    separate weight-sync step, the all-gather IS the sync.
Rounding matches the one-process `MasterAdamW`: there the bf16 parameter is
round(fp32 master) after every step; here it is round(fp32 shard) at every all-gather.

Loss normalization contract: gradients are SUMMED across ranks (no division by N), so
each rank must weight its loss by its share of the GLOBAL normalizer (global token or
sequence counts, `global_sums`); then the sum over ranks is the one-process gradient.
Every rank must run the same number of forward/backward passes per optimizer step (each
one all-gathers and reduce-scatters): pad with zero-weight micro-batches up to
`max_across_ranks(number of local micro-batches)`.

Failures: a rank that raises inside `fail_together(ctx, phase)` (host-side phases with no
collective inside: rollouts, rewards, data) makes every rank raise `RankFailed` naming
that rank and its message. A rank that raises elsewhere exits; torchrun then stops the
other ranks (`record` on the entry point reports the failing rank's traceback), and the
process-group timeout bounds any wait in a collective.
Test: python -m pytest -q tests/test_distributed.py tests/test_distributed_launch.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

log = logging.getLogger(__name__)
T = TypeVar("T")


# ---------------------------------------------------------------------- launch
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LaunchEnv:
    """Where this process sits in a torchrun job (torchrun's environment variables)."""
    rank: int
    """RANK: this process among all processes of the job."""
    world_size: int
    """WORLD_SIZE: processes in the job (nodes x nproc_per_node)."""
    local_rank: int
    """LOCAL_RANK: this process on its node; picks the GPU."""
    master_addr: str
    """MASTER_ADDR: host of the rendezvous store."""
    master_port: int
    """MASTER_PORT: port of the rendezvous store."""
    use_agent_store: bool = False
    """TORCHELASTIC_USE_AGENT_STORE: torchrun's agent hosts the store (every rank is a client)."""


def launch_env(environ: Mapping[str, str]) -> LaunchEnv | None:
    """The LaunchEnv described by `environ` (the CLI passes os.environ), or None when the
    process was not started by torchrun (no WORLD_SIZE): a plain single-process run."""
    if "WORLD_SIZE" not in environ:
        return None

    def need_int(key: str, lo: int, hi: int | None = None) -> int:
        raw = environ.get(key)
        if raw is None:
            raise ValueError(f"environment: WORLD_SIZE is set but {key} is not (launch with torchrun)")
        try:
            v = int(raw)
        except ValueError:
            raise ValueError(f"environment: {key}={raw!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise ValueError(f"environment: {key}={v} must be in [{lo}, {hi if hi is not None else 'inf'}]")
        return v

    world = need_int("WORLD_SIZE", 1)
    rank = need_int("RANK", 0, world - 1)
    local = need_int("LOCAL_RANK", 0, world - 1)
    port = need_int("MASTER_PORT", 1, 65535)
    addr = environ.get("MASTER_ADDR")
    if not addr:
        raise ValueError("environment: WORLD_SIZE is set but MASTER_ADDR is not (launch with torchrun)")
    return LaunchEnv(rank=rank, world_size=world, local_rank=local, master_addr=addr, master_port=port,
                     use_agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DistContext:
    """This rank's place in the process group; passed to every function of this module."""
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    """1-D data-parallel mesh over all ranks (FSDP shards along it)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that prints, logs, writes metrics, samples and exports."""
        return self.rank == 0


def init_distributed(env: LaunchEnv, *, device_type: str, timeout_s: float = 600.0) -> DistContext:
    """Join the process group: NCCL on "cuda" (one GPU per local rank), gloo on "cpu".
    `timeout_s` bounds every collective: a rank that waits longer for a dead peer raises."""
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # The store torch's env:// rendezvous would build, from the typed fields (so torch does
    # not read the environment behind the CLI's back): under torchrun the agent hosts it.
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                          is_master=env.rank == 0 and not env.use_agent_store, timeout=timeout,
                          multi_tenant=True)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout,
                            device_id=device if device_type == "cuda" else None)
    mesh = init_device_mesh(device_type, (env.world_size,), mesh_dim_names=("dp",))
    ctx = DistContext(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank, device=device,
                      mesh=mesh)
    log.info("rank %d/%d on %s (%s, collective timeout %.0f s)", ctx.rank, ctx.world_size, device, backend,
             timeout_s)
    return ctx


def shutdown() -> None:
    """Leave the process group (end of a run; a failing rank just exits, see the module doc).
    A barrier first: no rank tears down its connections while a peer still uses them
    (seen once in 4-process CPU runs without it: rank 0 aborted at exit)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def quiet_non_main(ctx: DistContext, logger_name: str = "rlfuse") -> None:
    """Ranks other than 0 log warnings and errors only (rank 0 reports progress)."""
    if not ctx.is_main:
        logging.getLogger(logger_name).setLevel(logging.WARNING)


# ---------------------------------------------------------------------- data and metrics
def local_slice(items: Sequence[T], ctx: DistContext, *, what: str) -> list[T]:
    """This rank's contiguous block of a global batch: rank r of N gets items
    [r k, (r + 1) k), k = len / N. Prompts are split before generation, so a group's G
    completions are generated, scored and advantaged on one rank; concatenating the ranks'
    blocks in rank order gives the global order. `what` names the config field for the
    error when len(items) is not a multiple of N."""
    n, world = len(items), ctx.world_size
    if n % world:
        raise ValueError(f"{what} = {n} must be a multiple of the number of ranks ({world})")
    k = n // world
    return list(items[ctx.rank * k:(ctx.rank + 1) * k])


def global_sums(ctx: DistContext, values: Sequence[float]) -> list[float]:
    """Sums over ranks of host numbers (e.g. [sequences, loss tokens] of a mini-batch: the
    global normalizers). fp64 so integer counts stay exact."""
    t = torch.tensor(list(values), dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()  # host sync: the trainer's loss weights are host numbers


def max_across_ranks(ctx: DistContext, value: int) -> int:
    """Max over ranks (e.g. micro-batches per optimizer step: ranks with fewer pad)."""
    t = torch.tensor([value], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())  # host sync: a loop bound


def on_any_rank(ctx: DistContext, flag: torch.Tensor) -> torch.Tensor:
    """1 (a 0-d int32 tensor on ctx.device) when the 0-d bool tensor `flag` is true on any
    rank, else 0: one all_reduce (MAX), no host sync, so a decision taken on it (e.g. to
    skip an optimizer step) is the same on every rank."""
    t = flag.to(device=ctx.device, dtype=torch.int32).reshape(1)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.reshape(())


def mean_across_ranks(ctx: DistContext, t: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of a tensor of the same shape on every rank (a new tensor on t's
    device): one all_reduce (SUM), no host sync."""
    t = t.to(ctx.device, copy=True)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / ctx.world_size


_OPS = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def reduce_metrics(ctx: DistContext, metrics: Mapping[str, float | torch.Tensor], *,
                   ops: Mapping[str, str] | None = None, default: str = "mean") -> dict[str, float]:
    """Metrics (numbers or 0-d tensors) reduced across ranks, one collective per kind of
    reduction. Every rank passes the same keys. `ops[key]` picks "mean" (equal-weight mean
    of the ranks' values: right for per-rank means over equal shares), "sum" (partial sums,
    e.g. losses already weighted by the global normalizer), "max" or "min"."""
    ops = dict(ops or {})
    if default not in _OPS or any(v not in _OPS for v in ops.values()):
        raise ValueError(f"reduce_metrics: ops must be in {sorted(_OPS)}, "
                         f"got default {default!r} and {sorted(set(ops.values()))}")
    out: dict[str, float] = {}
    by_op: dict[str, list[str]] = {}
    for key in sorted(metrics):  # same order on every rank
        by_op.setdefault(ops.get(key, default), []).append(key)
    for op, keys in by_op.items():
        t = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float64).reshape(()).to(ctx.device) for k in keys])
        dist.all_reduce(t, op=_OPS[op])
        if op == "mean":
            t /= ctx.world_size
        out.update(zip(keys, t.tolist()))  # host sync: metrics are logged as numbers
    return out


# ---------------------------------------------------------------------- failures
class RankFailed(RuntimeError):
    """Raised on every rank when one rank raised inside `fail_together`."""


def _message(err: BaseException | None) -> str | None:
    return None if err is None else f"{type(err).__name__}: {err}"


def _raise_failed(phase: str, msgs: Sequence[str | None], err: BaseException | None) -> None:
    failed = [(r, m) for r, m in enumerate(msgs) if m is not None]
    if failed:
        r, m = failed[0]
        more = f" (also ranks {[x for x, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise RankFailed(f"{phase}: rank {r} raised {m}{more}") from err


@contextlib.contextmanager
def fail_together(ctx: DistContext, phase: str):
    """Run a host-side phase (no collectives inside: generation on the local engine,
    reward scoring, data loading). If it raises on any rank, every rank raises RankFailed
    "<phase>: rank r raised Type: message" (the lowest failing rank; all are listed), so
    all ranks stop at the same point instead of the healthy ones waiting in the next
    collective. One small all-gather per phase."""
    err = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 -- re-raised below on every rank, with this rank's message
        err = e
    msgs: list[str | None] = [None] * ctx.world_size
    dist.all_gather_object(msgs, _message(err))
    _raise_failed(phase, msgs, err)


def gather_results(ctx: DistContext, phase: str, fn, *args) -> list:
    """fail_together that also returns: `fn(*args)` on every rank, then one all-gather of
    (error, result); every rank gets all ranks' results in rank order, or RankFailed as
    in `fail_together`. Results are pickled: host objects (samples, scores, counts)."""
    err, out = None, None
    try:
        out = fn(*args)
    except Exception as e:  # noqa: BLE001 -- re-raised below on every rank, with this rank's message
        err = e
    got: list = [None] * ctx.world_size
    dist.all_gather_object(got, (_message(err), None if err is not None else out))
    _raise_failed(phase, [m for m, _ in got], err)
    return [r for _, r in got]


def on_main(ctx: DistContext, phase: str, fn, *args):
    """`fn(*args)` on rank 0 only (file-system work: resolving a resume, cleaning up);
    every rank gets its result, or RankFailed with rank 0's error."""
    return gather_results(ctx, phase, lambda: fn(*args) if ctx.is_main else None)[0]
