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
                  (kwargs: pattern= to use another regex, fullmatch)
  length_penalty  -coef * len(completion_ids) / max_len   (kwargs: coef=1.0, max_len=1000)
  overlong_penalty  DAPO's soft overlong punishment: 0 up to max_len - buffer tokens,
                  then linearly down to -1 at max_len (and -1 when truncated)
User functions: "package.module:function" or "path/to/file.py:function" (kwargs are bound).

`RewardSet.score(...)` returns (total (B,), per-function dict of (B,) lists). A function
that raises is re-run per example to find the first failing one; with
on_reward_error="raise" the run stops with a ValueError naming the function, the example
index, its prompt and completion; with "zero" failing examples score 0 and are counted
(metrics `reward_errors/<name>`) and logged once per function.
Test: python -m pytest -q tests/test_rewards.py
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import math
import re
import sys
from pathlib import Path
from typing import Callable

from rlfuse.train.config import RewardSpec
from rlfuse.train.tasks import _INT, extract_answer, verify_arithmetic, verify_countdown

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
        if not _INT.match(got):
            out.append(0.0)
            continue
        n = max(len(got), len(want))
        out.append(sum(x == y for x, y in zip(got[::-1], want[::-1])) / n)
    return out


def countdown(prompts, completions, numbers, target, use_all=None, **_):
    flags = use_all if use_all is not None else [True] * len(completions)
    return [1.0 if verify_countdown(c, n, t, u) else 0.0 for c, n, t, u in zip(completions, numbers, target, flags)]


_FORMAT = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"


def format_reward(prompts, completions, pattern: str = _FORMAT, **_):
    rx = re.compile(pattern, re.S)
    return [1.0 if rx.search(c) else 0.0 for c in completions]


def length_penalty(prompts, completions, completion_ids, coef: float = 1.0, max_len: int = 1000, **_):
    return [-coef * len(ids) / max_len for ids in completion_ids]


def overlong_penalty(prompts, completions, completion_ids, truncated, max_len: int = 1024,
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
# reward functions whose value is "the answer is right" (the accuracy metric)
CORRECTNESS = ("math_accuracy", "arithmetic", "countdown")


def resolve(name: str) -> Callable:
    """A built-in name, `module:function` or `file.py:function`."""
    if name in BUILTINS:
        return BUILTINS[name]
    if ":" not in name:
        raise ValueError(f"reward {name!r}: not a builtin ({', '.join(BUILTINS)}) and not module:function")
    mod_name, fn_name = name.rsplit(":", 1)
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        if not path.exists():
            raise ValueError(f"reward {name!r}: no such file {path}")
        spec = importlib.util.spec_from_file_location(f"rlfuse_user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            raise ValueError(f"reward {name!r}: cannot import module {mod_name!r} ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward {name!r}: module {mod_name!r} has no function {fn_name!r}")
    return fn


class RewardError(ValueError):
    pass


def _short(s: str, n: int = 300) -> str:
    s = str(s)
    return s if len(s) <= n else s[:n] + f"... [{len(s) - n} more chars]"


class RewardSet:
    """Weighted reward functions; see the module docstring."""

    def __init__(self, specs: list[RewardSpec], on_error: str = "raise"):
        if not specs:
            raise ValueError("rewards: the list is empty; add at least one reward function")
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_reward_error must be 'raise' or 'zero', got {on_error!r}")
        self.names, self.fns, self.weights = [], [], []
        for s in specs:
            base = s.name.rsplit(":", 1)[-1]
            name = base if base not in self.names else f"{base}_{len(self.names)}"
            self.names.append(name)
            self.fns.append(functools.partial(resolve(s.name), **s.kwargs) if s.kwargs else resolve(s.name))
            self.weights.append(float(s.weight))
        self.on_error = on_error
        self.error_counts = {n: 0 for n in self.names}
        self.correctness = next((n for n, s in zip(self.names, specs) if s.name in CORRECTNESS), None)

    def _call(self, name, fn, prompts, completions, columns) -> list[float]:
        n = len(completions)
        try:
            vals = fn(prompts, completions, **columns)
            return self._check(name, vals, n)
        except RewardError:
            raise
        except Exception as batch_err:  # user code: find the failing example(s)
            out = []
            for i in range(n):
                cols_i = {k: v[i:i + 1] for k, v in columns.items()}
                try:
                    out += self._check(name, fn(prompts[i:i + 1], completions[i:i + 1], **cols_i), 1)
                except RewardError:
                    raise
                except Exception as e:
                    if self.on_error == "raise":
                        raise RewardError(
                            f"reward function {name!r} raised {type(e).__name__}: {e}\n"
                            f"  on example {i}: prompt={_short(prompts[i])!r}\n"
                            f"  completion={_short(completions[i])!r}\n"
                            f"  (set on_reward_error: zero to score such examples 0 and continue)") from e
                    if self.error_counts[name] == 0:
                        log.warning("reward function %r raised %s: %s on example %r; scoring 0 "
                                    "(on_reward_error=zero)", name, type(e).__name__, e, _short(completions[i], 120))
                    self.error_counts[name] += 1
                    out.append(0.0)
            if len(out) != n:  # pragma: no cover - guarded by _check
                raise RewardError(f"reward function {name!r}: {batch_err}")
            return out

    @staticmethod
    def _check(name, vals, n) -> list[float]:
        if not isinstance(vals, (list, tuple)) or len(vals) != n:
            got = f"{type(vals).__name__} of length {len(vals)}" if hasattr(vals, "__len__") else repr(vals)
            raise RewardError(f"reward function {name!r} must return a list of {n} numbers, got {got}")
        out = []
        for v in vals:
            if v is None:
                out.append(math.nan)
            elif isinstance(v, (int, float)) and not isinstance(v, bool) or hasattr(v, "__float__"):
                out.append(float(v))
            else:
                raise RewardError(f"reward function {name!r} returned a non-number {v!r}")
        return out

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, list]):
        """(total [B floats], {name: [B floats (NaN = not applicable)]})."""
        per = {}
        for name, fn in zip(self.names, self.fns):
            per[name] = self._call(name, fn, prompts, completions, columns)
        total = [sum(w * v for w, v in zip(self.weights, vals) if not math.isnan(v))
                 for vals in zip(*per.values())]
        return total, per
