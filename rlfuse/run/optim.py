"""AdamW with fp32 master weights written back into the live parameters in place,
a warmup + cosine learning-rate schedule and global grad-norm clipping.

Why in place: the inference engine captured pointers to these parameter tensors (CUDA
graphs, the model object it runs); replacing a Parameter or its storage would leave the
engine on stale weights. So the optimizer never rebinds `p.data`; it updates an fp32
master copy and `p.copy_(master)` under no_grad (a rounding cast for bf16/fp16 params).
For fp32 params the master IS the parameter (no second copy).

Update (decoupled weight decay, bias-corrected moments; the op order of
`torch.optim.AdamW`'s single-tensor path, so fp32 results match it bit for bit on CPU):
    w  <- w * (1 - lr * wd)
    m  <- lerp(m, g, 1 - b1)             v <- b2 v + (1 - b2) g^2
    w  <- w - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
Gradients of bf16/fp16 params are accumulated in fp32 buffers across backward passes
(a post-accumulate-grad hook moves each .grad into the buffer), so micro-batch sums do
not round to bf16; clip with `clip_grad_norm_(opt.grads(), ...)`. No host syncs in
`step`: the step count and lr are Python numbers kept on the host.
Update size: each step also measures ||w_new - w_old|| / ||w_old|| over all its
parameters (fp32 masters), on the device (a few reductions per parameter, reusing the
step's own scratch buffer); `pop_update_ratio()` gives the largest since the previous call
(the run loop logs it as `optim/update_ratio`). A healthy fine-tuning step moves weights
by about lr (1e-6 .. 1e-4 relative); a ratio near 1 means the step rewrote the weights.

`NonFiniteGuard` keeps NaN/inf out of the weights: a step whose loss or gradient norm is
not finite is skipped (weights, masters, moments and step count untouched), counted, and
after `max_consecutive` skips in a row the run stops with NonFiniteError. Data-parallel,
the decision is global: each rank holds only its share of the loss, so a rank that skipped
alone would leave its weight shards (and step count) behind the others'; one all_reduce
of the "not finite" flag makes every rank skip or step together.
`WeightNormWatch` warns when the weights' global L2 norm grows by an order of magnitude
over the run (a learning rate far too high diverges this way while the loss may still
read finite).
Test: python -m pytest -q tests/test_train_optim.py
"""

from __future__ import annotations

import logging
import math
import weakref

import torch
from torch.distributed.tensor import DTensor

from rlfuse.run.distributed.context import DistContext, on_any_rank
from rlfuse.run.distributed.fsdp import clip_sharded_grads_

log = logging.getLogger(__name__)


def _fp32_grad_hook(p: torch.Tensor) -> None:
    ref = getattr(p, "_rlfuse_grad_owner", None)
    opt = ref() if ref is not None else None
    if opt is not None and p.grad is not None:
        opt._accumulate(p)


class MasterAdamW:
    """AdamW over `params` (an iterable of tensors with .grad) with fp32 master weights."""

    def __init__(self, params, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("MasterAdamW: no parameters require grad")
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.step_count = 0
        with torch.no_grad():
            self.master = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        self.exp_avg = [torch.zeros_like(m) for m in self.master]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.master]
        # fp32 gradient accumulation for low-precision params: each backward's grad is added
        # into an fp32 buffer and the bf16 .grad dropped, so micro-batch sums keep fp32 precision
        self.grad32: list[torch.Tensor | None] = [None] * len(self.params)
        self._update_ratio: torch.Tensor | None = None  # the largest since pop_update_ratio (0-d, on device)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # One hook per parameter for the parameter's lifetime, dispatching to the newest
        # MasterAdamW built on it (a weak reference): an SFT optimizer followed by a GRPO one
        # on the same weights must not leave a stale hook that eats the gradients (seen on a
        # GPU: the first hook cleared .grad and the second found None).
        for p in self.params:
            if p.dtype != torch.float32:
                p._rlfuse_grad_owner = weakref.ref(self)
                if not getattr(p, "_rlfuse_grad_hooked", False):
                    p.register_post_accumulate_grad_hook(_fp32_grad_hook)
                    p._rlfuse_grad_hooked = True

    def _accumulate(self, p: torch.Tensor) -> None:
        i = self._index[id(p)]
        with torch.no_grad():
            if self.grad32[i] is None:
                self.grad32[i] = p.grad.float()
            else:
                self.grad32[i].add_(p.grad)
        p.grad = None

    def grads(self) -> list[torch.Tensor]:
        """The fp32 gradients the next step uses (for clipping and norms)."""
        return [g for g in (self.grad32[i] if self.grad32[i] is not None else p.grad
                            for i, p in enumerate(self.params)) if g is not None]

    def pop_update_ratio(self) -> torch.Tensor | None:
        """The largest ||w_new - w_old|| / ||w_old|| of the steps since the previous call
        (a 0-d fp32 tensor on the parameters' device, no host sync), or None if none stepped."""
        r, self._update_ratio = self._update_ratio, None
        return r

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        lr = self.lr if lr is None else lr
        b1, b2 = self.betas
        self.step_count += 1
        bc1 = 1 - b1 ** self.step_count
        bc2_sqrt = math.sqrt(1 - b2 ** self.step_count)
        step_size = lr / bc1
        decay = lr * self.weight_decay
        w_norms, d_norms = [], []
        for i, (p, w, m, v) in enumerate(zip(self.params, self.master, self.exp_avg, self.exp_avg_sq)):
            g = self.grad32[i] if self.grad32[i] is not None else p.grad
            if g is None:
                continue
            g = g if g.dtype == torch.float32 else g.float()
            w_norms.append(torch.linalg.vector_norm(w))
            w.mul_(1 - decay)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / bc2_sqrt).add_(self.eps)
            w.addcdiv_(m, denom, value=-step_size)
            if w is not p:
                p.copy_(w)  # in place: the engine's pointers stay valid
            # w_old - w_new = (step_size u + decay w_new) / (1 - decay), u = m / denom; the
            # update itself stays the one addcdiv above (bitwise torch's), this is its size
            d = denom.reciprocal_().mul_(m)
            if 0 < decay < 1:
                d.mul_(step_size / (1 - decay)).add_(w, alpha=decay / (1 - decay))
            elif decay == 0:
                d.mul_(step_size)
            else:  # lr x weight_decay >= 1 zeroes or flips the weights each step: w_old is gone
                d.fill_(math.nan)
            d_norms.append(torch.linalg.vector_norm(d))
        if w_norms:
            r = torch.linalg.vector_norm(torch.stack(d_norms)) / torch.linalg.vector_norm(torch.stack(w_norms))
            self._update_ratio = r if self._update_ratio is None else torch.maximum(self._update_ratio, r)

    def zero_grad(self) -> None:
        for i, p in enumerate(self.params):
            p.grad = None
            self.grad32[i] = None

    def take_grads(self) -> list[torch.Tensor | None]:
        """The accumulated gradients (one per param, None where none), leaving none behind, so
        the next backward starts a fresh sum (grpo.overlap stream keeps micro-batches apart)."""
        out = [self.grad32[i] if self.grad32[i] is not None else p.grad for i, p in enumerate(self.params)]
        self.zero_grad()
        return out

    def put_grads(self, grads: list[torch.Tensor | None]) -> None:
        """Make `grads` (from take_grads) the accumulated gradients again, as they were."""
        for i, g in enumerate(grads):
            self._set_grad(i, g)

    def _set_grad(self, i: int, g: torch.Tensor | None) -> None:
        if self.params[i].dtype == torch.float32:
            self.params[i].grad = g
        else:
            self.grad32[i] = g

    @torch.no_grad()
    def add_grads(self, grads: list[torch.Tensor | None]) -> None:
        """Add one backward's gradients (from take_grads) to the accumulated ones exactly as
        that backward would have: the first sets the sum, later ones add in fp32."""
        for i, (p, g) in enumerate(zip(self.params, grads)):
            cur = p.grad if p.dtype == torch.float32 else self.grad32[i]
            if g is None:
                continue
            if cur is None:
                self._set_grad(i, g)
            else:
                cur.add_(g)

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        """Re-read master weights from the params (after loading weights into them)."""
        for p, w in zip(self.params, self.master):
            if w is not p:
                w.copy_(p)

    def state_dict(self) -> dict:
        return {"step": self.step_count, "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay,
                "master": [None if w is p else w for p, w in zip(self.params, self.master)],
                "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        if len(sd["exp_avg"]) != len(self.params):
            raise ValueError(f"optimizer state has {len(sd['exp_avg'])} tensors, the model {len(self.params)}")
        self.step_count = int(sd["step"])
        for i, p in enumerate(self.params):
            if tuple(sd["exp_avg"][i].shape) != tuple(p.shape):
                raise ValueError(f"optimizer state tensor {i}: shape {tuple(sd['exp_avg'][i].shape)}, "
                                 f"parameter {tuple(p.shape)}")
            self.exp_avg[i].copy_(sd["exp_avg"][i])
            self.exp_avg_sq[i].copy_(sd["exp_avg_sq"][i])
            src = sd["master"][i]
            if src is not None and self.master[i] is not p:
                self.master[i].copy_(src)
                p.copy_(self.master[i])


def clip_grad_norm_(grads, max_norm: float) -> torch.Tensor:
    """Global L2 norm of `grads` (tensors, e.g. MasterAdamW.grads(); fp32 result, no
    sync); scales them in place by min(1, max_norm / (norm + 1e-6)) when max_norm > 0."""
    grads = [g for g in grads if g is not None]
    if not grads:
        return torch.zeros(())
    if isinstance(grads[0], DTensor):  # FSDP2 shards (distributed.ShardedAdamW): the norm spans all ranks
        return clip_sharded_grads_(grads, max_norm)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return norm


SCHEDULES = ("cosine", "constant", "linear")
"""Learning-rate decays after the warmup (`lr_at`)."""


def lr_at(step: int, *, lr: float, total_steps: int, warmup_steps: int = 0, schedule: str = "cosine",
          min_lr_ratio: float = 0.0) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup over warmup_steps
    (step 0 gets lr / warmup_steps, not 0, so no step is wasted), then constant, linear or
    cosine decay reaching min_lr_ratio * lr at step total_steps - 1."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    span = max(total_steps - 1 - warmup_steps, 1)
    frac = min(max((step - warmup_steps) / span, 0.0), 1.0)
    if schedule == "linear":
        decay = 1.0 - frac
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * frac))
    else:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * decay)


class NonFiniteError(ValueError):
    """Training produced NaN/inf where it must not (a ValueError so the CLI reports it as
    `rlfuse: error: ...` without a traceback)."""


class NonFiniteGuard:
    """Skip optimizer steps whose loss or gradient norm is NaN/inf.

        if guard.step(opt, lr, loss=loss, grad_norm=grad_norm, where=f"step {s}"):
            ...                         # stepped
        opt.zero_grad()                 # always: a skipped step's gradients are dropped
        metrics["skipped_steps"] = guard.pop_skipped()

    A skipped step leaves the weights, the fp32 masters, the moments and the step count
    (hence bias correction and the schedule position the optimizer sees) exactly as they
    were. `max_consecutive` skips in a row raise NonFiniteError (0 = never). With `dist`
    (data-parallel) a step is skipped on every rank when the loss or gradient norm is not
    finite on any rank, so the counts, the skips and the error are the same everywhere."""

    def __init__(self, max_consecutive: int = 5, *, dist: DistContext | None = None):
        if max_consecutive < 0:
            raise ValueError(f"max_consecutive must be >= 0, got {max_consecutive}")
        self.dist = dist
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total_skipped = 0
        self._pending = 0

    def finite(self, loss: torch.Tensor | float, grad_norm: torch.Tensor | float, where: str = "") -> bool:
        """True when both are finite (data-parallel: on every rank); otherwise count a skip
        (and raise after too many)."""
        if self.dist is None:
            vals = torch.stack([torch.as_tensor(loss, dtype=torch.float32).detach().cpu().reshape(()),
                                torch.as_tensor(grad_norm, dtype=torch.float32).detach().cpu().reshape(())])
            ok = bool(torch.isfinite(vals).all())  # host sync: one per optimizer step, to decide the step
            loss_v, norm_v = vals.tolist()
        else:
            vals = torch.stack([torch.as_tensor(x, dtype=torch.float32).detach().to(self.dist.device).reshape(())
                                for x in (loss, grad_norm)])
            bad = on_any_rank(self.dist, ~torch.isfinite(vals).all())
            # host sync: one per optimizer step, to decide the step (the global flag and this rank's values)
            bad_v, loss_v, norm_v = torch.cat([bad.float().reshape(1), vals]).tolist()
            ok = not bad_v
        if ok:
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.total_skipped += 1
        self._pending += 1
        here = math.isfinite(loss_v) and math.isfinite(norm_v)  # data-parallel: another rank's were not
        log.warning("%sloss %s, grad norm %s: not finite%s; optimizer step skipped%s (weights unchanged; %d in a "
                    "row, %d in this run)", f"{where}: " if where else "", loss_v, norm_v,
                    " on another rank (these are this rank's)" if here else "",
                    " on every rank" if self.dist is not None else "", self.consecutive, self.total_skipped)
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"{where + ': ' if where else ''}{self.consecutive} optimizer steps in a row had a non-finite loss or "
                f"gradient norm (last: loss {loss_v}, grad norm {norm_v}); stopping (the limit is "
                f"{self.max_consecutive}). The weights are those of the last finite step; lower optim.lr, "
                f"check the data and rewards, or use float32")
        return False

    def step(self, optimizer: "MasterAdamW", lr: float | None = None, *, loss, grad_norm, where: str = "") -> bool:
        """optimizer.step(lr) when loss and grad_norm are finite; returns whether it stepped."""
        if not self.finite(loss, grad_norm, where):
            return False
        optimizer.step(lr)
        return True

    def pop_skipped(self) -> float:
        """Steps skipped since the previous call (for the per-step metric), then reset."""
        n, self._pending = self._pending, 0
        return float(n)

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "total_skipped": self.total_skipped}

    def load_state_dict(self, sd: dict) -> None:
        self.consecutive, self.total_skipped = int(sd["consecutive"]), int(sd["total_skipped"])


class WeightNormWatch:
    """Warns when the global L2 norm of `params` reaches GROWTH times its value at the first
    `check` (and again at each further GROWTH x). `check` costs one pass over the weights
    and one host sync (data-parallel: plus one all_reduce of the local shards' sums), so the
    run loop calls it at the logging cadence only; every rank calls it at the same steps."""

    GROWTH = 10.0
    """One order of magnitude: healthy fine-tuning moves the weight norm by percents."""

    def __init__(self, params, *, dist: DistContext | None = None):
        self.params = list(params)
        self.dist = dist
        self.start: tuple[int, float] | None = None
        self.next_warning = math.inf

    @torch.no_grad()
    def norm(self) -> float:
        local = [p.to_local() if isinstance(p, DTensor) else p for p in self.params]
        sq = torch.stack([t.detach().float().pow(2).sum() for t in local]).sum()
        if self.dist is not None:
            sq = sq.to(self.dist.device)
            torch.distributed.all_reduce(sq)
        return math.sqrt(float(sq))  # host sync: at the logging cadence only

    def check(self, step: int) -> float:
        n = self.norm()
        if self.start is None:
            self.start = (step, n)
            self.next_warning = n * self.GROWTH if n > 0 else math.inf
        elif math.isfinite(n) and n >= self.next_warning:
            s0, n0 = self.start
            log.warning("the weight norm grew from %.4g (step %d) to %.4g (step %d), %.0fx: the run may be "
                        "diverging; check optim.lr and the loss curve", n0, s0, n, step, n / n0)
            self.next_warning = n * self.GROWTH
        return n


@torch.no_grad()
def nonfinite_tensors(named_tensors) -> list[str]:
    """Names of the tensors holding NaN or inf, from (name, tensor) pairs; one host sync."""
    named = [(n, t) for n, t in named_tensors if t.is_floating_point()]
    if not named:
        return []
    dev = named[0][1].device
    flags = torch.stack([torch.isfinite(t).all().to(dev) for _, t in named])
    return [n for (n, _), ok in zip(named, flags.tolist()) if not ok]  # host sync: once per check
