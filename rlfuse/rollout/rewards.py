"""Reward functions: built-ins, user functions, weighted combination, error handling.

Signature (TRL's): fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]
where columns are the dataset's other fields, one list entry per completion (a prompt's
columns repeated for each of its G completions), plus `completion_ids` (token ids) and
`truncated` (bool, hit max_new_tokens). None means "does not apply" and counts as 0 in
the total (NaN-skipped in the per-function mean).

Built-ins (BUILTINS):
  math_accuracy   1.0 if math-verify finds the completion's answer (its last \\boxed{},
                  else the whole text) equal to the `answer` column, else 0.0
  arithmetic      1.0 if the completion's integer answer equals `answer` (exact)
  arithmetic_digits  partial credit: share of the answer's digit positions (from the
                  right) the completion's integer gets right (1.0 iff exact)
  countdown       1.0 if the completion's expression reaches `target` from `numbers`
  format          1.0 if the completion matches <think>...</think> <answer>...</answer>
                  (kwargs: pattern= another regex, searched with re.S)
  length_penalty  -coef * len(completion_ids) / max_len   (kwargs: coef=1.0, max_len=1000)
  overlong_penalty  DAPO's soft overlong punishment: 0 up to max_len - buffer tokens,
                  then linearly down to -1 at max_len (and -1 when truncated)
Model rewards (MODEL_REWARDS), built once per RewardSpec from its `path` and kwargs:
  reward_model    an HF *ForSequenceClassification checkpoint's score of the conversation,
                  under its own chat template (rlfuse.rollout.reward_model; kwargs: device,
                  dtype, batch_tokens, max_length, use_chat_template)
User functions: "package.module:function" or "path/to/file.py:function" (kwargs are bound).

`RewardSet.score(...)` returns (total (B,), per-function dict of (B,) lists). A function
that raises is re-run per example to find the first failing one. A returned NaN or +-inf is
a failure too (None is the way to say "does not apply"). With on_reward_error="raise" the
run stops with a ValueError naming the function, the example index, its prompt and
completion; with "zero" failing examples score 0 and are counted (metrics
`reward_errors/<name>`, per step) and logged once per function; a function that fails on
every example of a `score()` call is an error even then. With `timeout_s` > 0 (the run's
reward_timeout_s) user functions run in a worker process (rlfuse.rollout.reward_worker)
and a call that takes longer is stopped: the batch is re-run per example to find the one
that hangs, and a timed-out example is a failure like the others (each costs up to
timeout_s). Built-ins take their settings
(RewardSpec.kwargs) as keyword-only parameters; an unknown kwarg is an error at start.
Test: python -m pytest -q tests/test_rewards.py
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import re
from typing import Callable

from rlfuse.data import INT_RE, extract_answer, verify_arithmetic, verify_countdown
from rlfuse.rollout.reward_model import RewardModelReward
from rlfuse.rollout.reward_worker import RewardImportError, RewardTimeout, WorkerReward
from rlfuse.run import load_function
from rlfuse.run.config import ON_REWARD_ERROR, RewardSpec
from rlfuse.utils.user_code import check_kwargs as check_user_kwargs

log = logging.getLogger(__name__)


def math_accuracy(prompts, completions, answer, **_):
    from math_verify import parse, verify  # sympy-based; imported when used

    out = []
    for c, a in zip(completions, answer):
        gold = parse(f"${a}$") if not str(a).strip().startswith("$") else parse(str(a))
        pred = parse(c)
        out.append(1.0 if gold and pred and verify(gold, pred) else 0.0)
    return out


def arithmetic(prompts, completions, answer, **_):
    return [1.0 if verify_arithmetic(c, str(a)) else 0.0 for c, a in zip(completions, answer)]


def arithmetic_digits(prompts, completions, answer, **_):
    """Partial credit: share of digit positions (aligned from the right) that match the
    answer, over the longer of the two; 0 when the completion has no integer answer."""
    out = []
    for c, a in zip(completions, answer):
        got, want = extract_answer(c), str(a).strip()
        if not INT_RE.match(got):
            out.append(0.0)
            continue
        n = max(len(got), len(want))
        out.append(sum(x == y for x, y in zip(got[::-1], want[::-1])) / n)
    return out


def countdown(prompts, completions, numbers, target, use_all=None, **_):
    flags = use_all if use_all is not None else [True] * len(completions)
    return [1.0 if verify_countdown(c, n, t, u) else 0.0 for c, n, t, u in zip(completions, numbers, target, flags)]


_FORMAT = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"


def format_reward(prompts, completions, *, pattern: str = _FORMAT, **_):
    rx = re.compile(pattern, re.S)
    return [1.0 if rx.search(c) else 0.0 for c in completions]


def length_penalty(prompts, completions, completion_ids, *, coef: float = 1.0, max_len: int = 1000, **_):
    return [-coef * len(ids) / max_len for ids in completion_ids]


def overlong_penalty(prompts, completions, completion_ids, truncated, *, max_len: int = 1024,
                     buffer: int = 256, **_):
    out = []
    for ids, cut in zip(completion_ids, truncated):
        n = len(ids)
        if cut or n >= max_len:
            out.append(-1.0)
        elif n <= max_len - buffer:
            out.append(0.0)
        else:
            out.append((max_len - buffer - n) / buffer)
    return out


BUILTINS: dict[str, Callable] = {
    "math_accuracy": math_accuracy, "arithmetic": arithmetic, "arithmetic_digits": arithmetic_digits,
    "countdown": countdown,
    "format": format_reward, "length_penalty": length_penalty, "overlong_penalty": overlong_penalty,
}
# rewards that hold a model: the class is built once per RewardSpec (path + kwargs) and called
MODEL_REWARDS: dict[str, type] = {"reward_model": RewardModelReward}
# reward functions whose value is "the answer is right" (the accuracy metric)
CORRECTNESS = ("math_accuracy", "arithmetic", "countdown")


PYTHON_REWARD = "python:"
"""Prefix of a reward recorded by name only (`python:<name>`): a callable a Python API
caller passed in, which only that process holds (RewardSet's `functions`)."""


def resolve(name: str) -> Callable:
    """A built-in name, `module:function` or `file.py:function`."""
    if name in BUILTINS:
        return BUILTINS[name]
    if name.startswith(PYTHON_REWARD):
        raise ValueError(f"reward {name!r}: a Python function given to the API in another process (a lambda, or "
                         f"defined in a notebook or __main__); pass it again as reward_funcs=[...], or name a "
                         f"module:function / file.py:function")
    if ":" not in name:
        raise ValueError(f"reward {name!r}: not a builtin ({', '.join(BUILTINS)}) and not module:function")
    return load_function(name, "reward")


class RewardError(ValueError):
    pass


def _short(s: str, n: int = 300) -> str:
    s = str(s)
    return s if len(s) <= n else s[:n] + f"... [{len(s) - n} more chars]"


def check_kwargs(name: str, fn: Callable, kwargs: dict) -> None:
    """ValueError when `kwargs` (a RewardSpec's) cannot be bound to `fn`. Built-ins take
    their settings as keyword-only parameters (the rest are dataset columns), so those are
    the valid kwargs; a user function without **kwargs accepts only its named parameters."""
    if name not in BUILTINS and name not in MODEL_REWARDS:
        check_user_kwargs("reward", name, fn, kwargs)
        return
    valid = {k: p for k, p in inspect.signature(fn).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    check_user_kwargs("reward", name, fn, kwargs, valid)
    for k, v in kwargs.items():
        default = valid[k].default
        if isinstance(default, (int, float)) and not isinstance(default, bool) and \
                (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise ValueError(f"reward {name!r}: kwargs.{k} must be a number, got {v!r}")
        if isinstance(default, bool) and not isinstance(v, bool):
            raise ValueError(f"reward {name!r}: kwargs.{k} must be true or false, got {v!r}")
        if isinstance(default, str) and not isinstance(v, str):
            raise ValueError(f"reward {name!r}: kwargs.{k} must be a string, got {v!r}")


class RewardSet:
    """Weighted reward functions; see the module docstring.

    Error counts (on_reward_error="zero"): `error_counts` holds the counts of the latest
    `score()` call (one call per GRPO step, so it is the step's count); `pop_error_counts()`
    returns the counts summed since its previous call and resets them (for a step that
    scores in several calls); `total_error_counts` is the run's total."""

    def __init__(self, specs: list[RewardSpec], on_error: str = "raise",
                 functions: dict[str, Callable] | None = None, timeout_s: float = 0.0, allow_empty: bool = False):
        """`functions`: callables by spec name (the Python API's reward_funcs), used instead
        of resolving those names (they run in this process: no timeout). `allow_empty`: no
        functions is fine (an environment's own reward scores the episodes); totals are 0."""
        if not specs and not allow_empty:
            raise ValueError("rewards: the list is empty; add at least one reward function")
        if on_error not in ON_REWARD_ERROR:
            raise ValueError(f"on_reward_error must be {' or '.join(map(repr, ON_REWARD_ERROR))}, got {on_error!r}")
        self.names, self.fns, self.weights = [], [], []
        for s in specs:
            base = s.name.rsplit(":", 1)[-1]
            name = base if base not in self.names else f"{base}_{len(self.names)}"
            if s.name in MODEL_REWARDS:
                check_kwargs(s.name, MODEL_REWARDS[s.name], s.kwargs)
                fn = MODEL_REWARDS[s.name](s.path, **s.kwargs)
            elif s.path:
                raise ValueError(f"reward {s.name!r}: `path` is for model rewards ({', '.join(MODEL_REWARDS)}); "
                                 f"a function takes its settings in kwargs")
            elif (timeout_s > 0 and s.name not in BUILTINS and not (functions and s.name in functions)
                  and ":" in s.name and not s.name.startswith(PYTHON_REWARD)):
                # a user function: imported only in its worker, which also checks the kwargs,
                # so a module that hangs as it imports is stopped by the same timeout
                fn = WorkerReward(s.name, s.kwargs, timeout_s)
                try:
                    fn.start()
                except RewardTimeout as e:
                    raise ValueError(f"reward {s.name!r}: {e}; a module that takes this long to import needs a "
                                     f"larger reward_timeout_s") from None
            else:
                fn = functions[s.name] if functions and s.name in functions else resolve(s.name)
                check_kwargs(s.name, fn, s.kwargs)
                fn = functools.partial(fn, **s.kwargs) if s.kwargs else fn
            self.names.append(name)
            self.fns.append(fn)
            self.weights.append(float(s.weight))
        self.on_error = on_error
        self.error_counts = {n: 0 for n in self.names}
        self.total_error_counts = {n: 0 for n in self.names}
        self._pending_counts = {n: 0 for n in self.names}
        self._last_failure: dict[str, str] = {}
        self.correctness = next((n for n, s in zip(self.names, specs) if s.name in CORRECTNESS), None)
        self.text_only = [s.name in BUILTINS or s.name in MODEL_REWARDS for s in specs]
        """Per function: rlfuse's own (scores text); the others get chat rows as messages (`score`)."""

    def pop_error_counts(self) -> dict[str, int]:
        """Errors per function since the previous call (then reset to 0)."""
        out, self._pending_counts = self._pending_counts, {n: 0 for n in self.names}
        return out

    def _fail(self, name: str, i: int, what: str, prompts, completions, cause=None) -> float:
        """Example i of function `name` failed (raised, or returned a non-finite number):
        raise naming the function and the example, or count it and score 0."""
        if self.on_error == "raise":
            raise RewardError(
                f"reward function {name!r} {what}\n"
                f"  on example {i}: prompt={_short(prompts[i])!r}\n"
                f"  completion={_short(completions[i])!r}\n"
                f"  (set on_reward_error: zero to score such examples 0 and continue)") from cause
        if self.error_counts[name] == 0 and self.total_error_counts[name] == 0:
            log.warning("reward function %r %s on example %d (completion %r); scoring 0 (on_reward_error=zero), "
                        "counted in metrics reward_errors/%s", name, what, i, _short(completions[i], 120), name)
        self.error_counts[name] += 1
        self._last_failure[name] = f"example {i}: {what}"
        return 0.0

    def _finite(self, name, vals, raw, prompts, completions, offset: int = 0) -> list[float]:
        # None -> NaN means "does not apply"; a NaN or +-inf the function returned is an error
        return [self._fail(name, offset + i, f"returned {r!r} (expected a finite number or None)", prompts,
                           completions) if r is not None and not math.isfinite(v) else v
                for i, (v, r) in enumerate(zip(vals, raw))]

    def _call(self, name, fn, prompts, completions, columns) -> list[float]:
        n = len(completions)
        try:
            raw = fn(prompts, completions, **columns)
        except (RewardError, RewardImportError):
            raise
        except Exception:  # noqa: BLE001 -- user code (or its timeout): find the failing example(s)
            out = []
            for i in range(n):
                cols_i = {k: v[i:i + 1] for k, v in columns.items()}
                try:
                    raw_i = fn(prompts[i:i + 1], completions[i:i + 1], **cols_i)
                except (RewardError, RewardImportError):
                    raise
                except RewardTimeout as e:
                    out.append(self._fail(name, i, str(e), prompts, completions, e))
                    continue
                except Exception as e:  # noqa: BLE001 -- user code: counted and reported for this example, the run goes on
                    out.append(self._fail(name, i, f"raised {type(e).__name__}: {e}", prompts, completions, e))
                    continue
                out += self._finite(name, self._check(name, raw_i, 1, i), list(raw_i), prompts, completions, i)
            return out
        return self._finite(name, self._check(name, raw, n), list(raw), prompts, completions)

    @staticmethod
    def _check(name, vals, n, first: int = 0) -> list[float]:
        """vals as floats; `first`: the batch index of vals[0] (for the message)."""
        if not isinstance(vals, (list, tuple)) or len(vals) != n:
            got = f"{type(vals).__name__} of length {len(vals)}" if hasattr(vals, "__len__") else repr(vals)
            raise RewardError(f"reward function {name!r} must return a list of {n} numbers (one per completion), "
                              f"got {got}")
        out = []
        for i, v in enumerate(vals, first):
            if v is None:
                out.append(math.nan)
            elif isinstance(v, (int, float)) and not isinstance(v, bool) or hasattr(v, "__float__"):
                out.append(float(v))
            else:
                raise RewardError(f"reward function {name!r} returned a non-number {v!r} for example {i} "
                                  f"(expected a float, an int or None)")
        return out

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, list],
              chat: tuple[list, list] | None = None):
        """(total [B floats], {name: [B floats (NaN = not applicable)]}). `chat`: (prompts,
        completions) as message lists for chat rows, what user functions get then (TRL passes
        conversational data so); rlfuse's built-in rewards keep the text."""
        self.error_counts = {n: 0 for n in self.names}
        per = {}
        for name, fn, text_only in zip(self.names, self.fns, self.text_only):
            p, c = (prompts, completions) if chat is None or text_only else chat
            per[name] = self._call(name, fn, p, c, columns)
            failed = self.error_counts[name]
            self.total_error_counts[name] += failed
            self._pending_counts[name] += failed
            if completions and failed == len(completions):
                raise RewardError(f"reward function {name!r} failed on all {failed} examples of this batch, "
                                  f"e.g. {self._last_failure[name]} (on_reward_error=zero scores occasional "
                                  f"failures 0; a function that fails on every example is a bug to fix)")
        total = [sum(w * v for w, v in zip(self.weights, vals) if not math.isnan(v))
                 for vals in zip(*per.values())] if per else [0.0] * len(completions)
        return total, per
