"""Built-in synthetic tasks that need no download, with exact verifiers.

arithmetic: "a<op>b=" with operands of 1..digits digits and ops from `ops` ("+-*"); `pad`
    writes operands and answer zero-padded to fixed widths ("07+45=" -> "052");
    answer = the exact integer result; the SFT completion is the answer itself.
    Verifier: the integer in the last `\\boxed{...}` or `<answer>...</answer>` if there is
    one, else the whole stripped completion, must equal the answer (int comparison).
arithmetic_pref: the arithmetic problems (same options) as preference pairs for DPO:
    chosen = the answer, rejected = a wrong answer of the same form, the answer moved by
    +-1 (last digit), +-10 (a carry), +-9 or +-11 (both), never negative for + and *.
countdown: reach `target` from `numbers` with + - * / and parentheses, each number used
    exactly once (use_all) or at most once. Instances are generated from a random
    expression, so each has a solution (the SFT completion). Verifier: the expression in
    the last <answer>...</answer> (else the last line) parses to integer literals and
    + - * / only, uses an allowed multiset of numbers, and evaluates exactly (Fractions)
    to the target.
lookup: "<key>=" with a random key of `length` letters; answer = `lookup_value(key)`, a
    fixed pseudo-random 0..999 (a hash of the key): a held-out key's value cannot be
    inferred from training keys, only read with the agent demo's `lookup` tool.
count: "<letter> in <word>" with a random word of `length` letters from `letters`;
    answer = how often the letter occurs (the agent demo's `count` tool). Both are scored by
    the arithmetic verifier (integer answers).

`make_split(task, n, seed, exclude)` returns rows {prompt, answer, completion, ...}
that are distinct from the prompts (image tasks: the `key`s) in `exclude` (held-out eval sets are disjoint from
training sets). Deterministic in the seed.
Test: python -m pytest -q tests/test_data.py
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from collections import Counter
from fractions import Fraction

from rlfuse.data.image_tasks import IMAGE_TASKS

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
INT_RE = re.compile(r"^[+-]?\d+$")


def extract_answer(text: str) -> str:
    """The last \\boxed{...} or <answer>...</answer> content, else the stripped text."""
    for pat in (_BOXED, _ANSWER_TAG):
        found = pat.findall(text)
        if found:
            return found[-1].strip()
    return text.strip()


# ------------------------------------------------------------------ arithmetic
def arithmetic_rows(n: int, *, seed: int = 0, digits: int = 2, ops: str = "+", pad: bool = False,
                    exclude=()) -> list[dict]:
    if digits < 1 or not ops or any(o not in "+-*" for o in ops):
        raise ValueError(f"arithmetic task: digits must be >= 1 and ops a subset of '+-*', got {digits}, {ops!r}")
    rng = random.Random(seed)
    seen = set(exclude)
    rows = []
    hi = 10 ** digits - 1
    space = (hi + 1) ** 2 * len(ops)
    if n > space - len(seen):
        raise ValueError(f"arithmetic task: only {space} distinct problems with digits={digits}, ops={ops!r}")
    while len(rows) < n:
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(ops)
        prompt = f"{a:0{digits}d}{op}{b:0{digits}d}=" if pad else f"{a}{op}{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        v = a + b if op == "+" else a - b if op == "-" else a * b
        ans = _answer_text(v, op, digits, pad)
        rows.append({"prompt": prompt, "answer": ans, "completion": ans})
    return rows


def _answer_text(v: int, op: str, digits: int, pad: bool) -> str:
    if not pad:
        return str(v)
    # fixed-width answer too: digits + 1 for +, 2 * digits for *, digits for -
    w = {"+": digits + 1, "*": 2 * digits, "-": digits}[op]
    return f"{v:0{w}d}" if v >= 0 else f"-{-v:0{w}d}"


# how far a rejected answer is off, drawn uniformly (1 and 10 twice as often): the
# mistakes of the demo's SFT model on 2-digit addition, greedy, 300 held-out problems:
# +-10: 59, +-1: 49, +-9: 23, +-11: 6, others: 5
_WRONG_BY = (1, 1, 10, 10, 9, 11)


def arithmetic_pref_rows(n: int, *, seed: int = 0, digits: int = 2, ops: str = "+", pad: bool = False,
                         exclude=()) -> list[dict]:
    """arithmetic_rows plus `chosen` (the answer) and `rejected` (a plausible wrong answer)."""
    rows = arithmetic_rows(n, seed=seed, digits=digits, ops=ops, pad=pad, exclude=exclude)
    rng = random.Random(seed * 7919 + 1)
    for r in rows:
        op = next(c for c in r["prompt"][1:] if c in "+-*")  # the operator (operands are non-negative)
        v = int(r["answer"])
        while True:
            wrong = v + rng.choice((-1, 1)) * rng.choice(_WRONG_BY)
            if op == "-" or wrong >= 0:
                break
        r["chosen"], r["rejected"] = r["answer"], _answer_text(wrong, op, digits, pad)
    return rows


def verify_arithmetic(completion: str, answer: str) -> bool:
    got = extract_answer(completion)
    return bool(INT_RE.match(got)) and int(got) == int(answer)


# ------------------------------------------------------------------ countdown
def _random_expression(nums: list[int], rng: random.Random):
    """Combine nums (in random order) with random ops into (expr_str, value) with integer
    intermediate values; None if a division would be inexact."""
    items = [(str(x), Fraction(x)) for x in nums]
    rng.shuffle(items)
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (ea, va), (eb, vb) = items[i], items[j]
        op = rng.choice("+-*/")
        if op == "/" and (vb == 0 or va % vb != 0):
            op = "+"
        if op == "-" and va < vb:
            (ea, va), (eb, vb) = (eb, vb), (ea, va)
        val = {"+": va + vb, "-": va - vb, "*": va * vb, "/": va / vb if vb else None}[op]
        items = [x for k, x in enumerate(items) if k not in (i, j)] + [(f"({ea}{op}{eb})", val)]
    expr, val = items[0]
    return expr[1:-1] if expr.startswith("(") and expr.endswith(")") else expr, val


def countdown_rows(n: int, *, seed: int = 0, count: int = 3, max_number: int = 25, max_target: int = 200,
                   use_all: bool = True, exclude=()) -> list[dict]:
    if count < 2:
        raise ValueError(f"countdown task: count must be >= 2, got {count}")
    rng = random.Random(seed)
    seen = set(exclude)
    rows = []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise ValueError(f"countdown task: could not generate {n} distinct problems "
                             f"(count={count}, max_number={max_number}, max_target={max_target})")
        nums = [rng.randint(1, max_number) for _ in range(count)]
        expr, val = _random_expression(nums, rng)
        if val.denominator != 1 or not 0 < val <= max_target:
            continue
        target = int(val)
        prompt = f"Use {' '.join(map(str, nums))} to make {target}."
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "answer": str(target), "completion": f"<answer>{expr}</answer>",
                     "numbers": nums, "target": target, "use_all": use_all})
    return rows


def _eval_expr(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return Fraction(node.value), [node.value]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        (a, na), (b, nb) = _eval_expr(node.left), _eval_expr(node.right)
        if isinstance(node.op, ast.Add):
            return a + b, na + nb
        if isinstance(node.op, ast.Sub):
            return a - b, na + nb
        if isinstance(node.op, ast.Mult):
            return a * b, na + nb
        if b == 0:
            raise ZeroDivisionError
        return a / b, na + nb
    raise ValueError("not an arithmetic expression")


def verify_countdown(completion: str, numbers, target, use_all: bool = True) -> bool:
    found = _ANSWER_TAG.findall(completion)
    expr = found[-1] if found else (completion.strip().splitlines() or [""])[-1]
    expr = expr.split("=")[0].strip()
    if not expr or len(expr) > 200 or not re.fullmatch(r"[\d+\-*/() ]+", expr):
        return False
    try:
        value, used = _eval_expr(ast.parse(expr, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return False
    have, want = Counter(used), Counter(int(x) for x in numbers)
    ok_nums = have == want if use_all else all(have[k] <= want[k] for k in have)
    return ok_nums and value == Fraction(int(target))


# ------------------------------------------------------------------ tool tasks
def lookup_value(key: str) -> int:
    """The `lookup` table: a fixed pseudo-random value 0..999 for every key."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big") % 1000


def _distinct(n: int, draw, space: int, seen: set, what: str) -> list[str]:
    if n > space - len(seen):
        raise ValueError(f"{what}: only {space} distinct problems with these options")
    out = []
    while len(out) < n:
        p = draw()
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def lookup_rows(n: int, *, seed: int = 0, length: int = 4, letters: str = "abcdefghijklmnopqrstuvwxyz",
                exclude=()) -> list[dict]:
    if length < 1 or len(set(letters)) < 2:
        raise ValueError(f"lookup task: length must be >= 1 and letters hold 2 or more, got {length}, {letters!r}")
    rng = random.Random(seed)
    prompts = _distinct(n, lambda: "".join(rng.choice(letters) for _ in range(length)) + "=",
                        len(set(letters)) ** length, set(exclude), "lookup task")
    return [{"prompt": p, "answer": str(lookup_value(p[:-1])), "completion": str(lookup_value(p[:-1]))}
            for p in prompts]


def count_rows(n: int, *, seed: int = 0, length: int = 8, letters: str = "abcde", exclude=()) -> list[dict]:
    if length < 1 or len(set(letters)) < 2:
        raise ValueError(f"count task: length must be >= 1 and letters hold 2 or more, got {length}, {letters!r}")
    rng = random.Random(seed)
    prompts = _distinct(n, lambda: f"{rng.choice(letters)} in {''.join(rng.choice(letters) for _ in range(length))}",
                        len(set(letters)) ** (length + 1), set(exclude), "count task")
    return [{"prompt": p, "answer": str(p[5:].count(p[0])), "completion": str(p[5:].count(p[0]))} for p in prompts]


TASKS = {"arithmetic": arithmetic_rows, "arithmetic_pref": arithmetic_pref_rows, "countdown": countdown_rows,
         "lookup": lookup_rows, "count": count_rows, **IMAGE_TASKS}
"""Text tasks here; image tasks (rows with an images column) in rlfuse/data/image_tasks.py."""


def task_alphabet(task: str, rows: list[dict]) -> str:
    """Every character of the prompts and completions (for a character-level tokenizer)."""
    chars = set()
    for r in rows:
        chars.update(r["prompt"])
        chars.update(r.get("completion", ""))
    if task in ("arithmetic", "arithmetic_pref", "lookup", "count"):
        chars.update("0123456789+-*=")
    if task in IMAGE_TASKS:
        chars.update("0123456789")
    return "".join(sorted(chars))


def rows_alphabet(rows: list[dict]) -> str:
    """Every character of every string in the rows (prompts, completions, answers, chat
    messages, any column): a character-level tokenizer for the user's own data file."""
    chars: set[str] = set()

    def walk(v) -> None:
        if isinstance(v, str):
            chars.update(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
    for r in rows:
        walk(r)
    return "".join(sorted(chars))


def make_split(task: str, n: int, *, seed: int, exclude=(), **kwargs) -> list[dict]:
    if task not in TASKS:
        raise ValueError(f"unknown builtin task {task!r}; builtin tasks: {sorted(TASKS)}")
    try:
        return TASKS[task](n, seed=seed, exclude=exclude, **kwargs)
    except TypeError as e:
        raise ValueError(f"builtin:{task}: bad task option ({e})") from None
