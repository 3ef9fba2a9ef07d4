"""Tools: typed Python functions whose signature and docstring become a JSON schema.

    def add(a: int, b: int) -> int:
        '''Add two integers.

        Args:
            a: the first summand.
            b: the second summand.
        '''
        return a + b

    tool = Tool.from_function(add)   # tool.schema() -> {"type": "function", "function": {...}}
    tool.call({"a": 2, "b": 3})      # "5"; wrong / missing / unknown arguments raise ToolError

Types: int, float, str, bool, list[X], dict, Literal[...], X | None (optional). The first
docstring paragraph is the description, the `Args:` section describes the parameters; a
parameter without an annotation or a description is a ValueError naming the function (the
model only knows a tool by its schema). A tool returns anything `str()` can show; an
exception it raises becomes an error observation (`ToolError` for expected failures,
`ToolTimeout` for time limits, both counted by the environment).
Built-ins: `calculator` (safe arithmetic: an AST walk over numbers and operators, never
`eval`), `lookup` and `count` (the tools of the agent demo's builtin:lookup / builtin:count
tasks) and `python` (model-written code run isolated by bubblewrap, see
rlfuse.rollout.agent.sandbox). `load_tools(["calculator", "tools.py:fn"])`.
Test: python -m pytest -q tests/test_rollout_tools.py
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import operator
import re
import threading
import types
import typing
from typing import Any, Callable

from rlfuse.data import lookup_value
from rlfuse.rollout.agent.sandbox import make_sandbox
from rlfuse.run import load_function


class ToolError(Exception):
    """A tool call failed in a way the model should be told about (bad arguments, a crash)."""


class ToolTimeout(ToolError):
    """A tool call ran past its time limit."""


_SIMPLE = {int: "integer", float: "number", str: "string", bool: "boolean", dict: "object", list: "array"}


def _json_type(t, where: str) -> dict:
    if t in _SIMPLE:
        return {"type": _SIMPLE[t]}
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is list and len(args) == 1:
        return {"type": "array", "items": _json_type(args[0], where)}
    if origin is dict:
        return {"type": "object"}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _json_type(rest[0], where)
    raise ValueError(f"{where}: type {t!r} has no JSON schema (use int, float, str, bool, list[X], dict, "
                     "Literal[...] or X | None)")


def _doc_sections(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google-style docstring."""
    doc = inspect.cleandoc(doc or "")
    head, _, args = doc.partition("\nArgs:")
    description = " ".join(head.strip().split("\n\n")[0].split())
    params: dict[str, str] = {}
    name = None
    for line in args.split("\n"):
        if re.match(r"^\S", line) and line.strip():  # the next section (Returns:, Raises:)
            break
        m = re.match(r"^\s+(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
        if m:
            name = m.group(1)
            params[name] = m.group(3).strip()
        elif name and line.strip():
            params[name] += " " + line.strip()
    return description, params


def _check_value(v, t) -> bool:
    if t is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if t in (str, bool, dict, list):
        return isinstance(v, t)
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is list:
        return isinstance(v, list) and all(_check_value(x, args[0]) for x in v)
    if origin is dict:
        return isinstance(v, dict)
    if origin is typing.Literal:
        return v in args
    if origin in (typing.Union, types.UnionType):
        return any(v is None if a is type(None) else _check_value(v, a) for a in args)
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict
    """JSON schema of the arguments object."""
    fn: Callable[..., Any]
    types: dict = dataclasses.field(default_factory=dict)
    """Parameter name -> annotation (argument checks)."""

    @classmethod
    def from_function(cls, fn: Callable, name: str | None = None) -> "Tool":
        name = name or fn.__name__
        where = f"tool {name!r}"
        description, pdocs = _doc_sections(fn.__doc__ or "")
        if not description:
            raise ValueError(f"{where}: the function needs a docstring (its first paragraph describes the tool "
                             "to the model)")
        hints = typing.get_type_hints(fn)
        props, required, tps = {}, [], {}
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ValueError(f"{where}: *args / **kwargs have no schema; name every parameter")
            if p.name not in hints:
                raise ValueError(f"{where}: parameter {p.name!r} needs a type annotation")
            if p.name not in pdocs:
                raise ValueError(f"{where}: parameter {p.name!r} is not described in the docstring's Args: section")
            props[p.name] = {**_json_type(hints[p.name], f"{where} parameter {p.name!r}"),
                             "description": pdocs[p.name]}
            tps[p.name] = hints[p.name]
            if p.default is p.empty:
                required.append(p.name)
        schema = {"type": "object", "properties": props, "required": required}
        return cls(name=name, description=description, parameters=schema, fn=fn, types=tps)

    def schema(self) -> dict:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def call(self, arguments: dict) -> str:
        """Check `arguments` against the schema, call the function, return its result as text."""
        unknown = sorted(set(arguments) - set(self.types))
        if unknown:
            raise ToolError(f"{self.name}: unknown argument(s) {unknown}; expected {sorted(self.types)}")
        missing = [k for k in self.parameters["required"] if k not in arguments]
        if missing:
            raise ToolError(f"{self.name}: missing argument(s) {missing}")
        for k, v in arguments.items():
            if not _check_value(v, self.types[k]):
                raise ToolError(f"{self.name}: argument {k!r} must be {self.parameters['properties'][k]}, got {v!r}")
        try:
            out = self.fn(**arguments)
            return out if isinstance(out, str) else str(out)
        except ToolError:
            raise
        except Exception as e:  # a tool's own failure is the model's observation, not the run's crash
            raise ToolError(f"{self.name} raised {type(e).__name__}: {e}") from e
        except (SystemExit, KeyboardInterrupt) as e:
            # sys.exit() in a tool once ended the run with status 0, silently. On the main
            # thread a KeyboardInterrupt may be the user's Ctrl-C: that one stays the run's.
            if isinstance(e, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
                raise
            raise ToolError(f"{self.name} raised {type(e).__name__}({e})") from None


# ---------------------------------------------------------------------- calculator
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt}
_MAX_EXPR_CHARS = 500
_MAX_POW = 1000   # exponents beyond this would let 9**9**9 run for minutes
_MAX_INT_DIGITS = 4000


def _eval_node(node):
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and abs(b) > _MAX_POW:
            raise ToolError(f"calculator: exponent {b} is too large (at most {_MAX_POW})")
        r = _BINOPS[type(node.op)](a, b)
        if isinstance(r, int) and r.bit_length() > _MAX_INT_DIGITS * 3.33:
            raise ToolError(f"calculator: the result has more than {_MAX_INT_DIGITS} digits")
        return r
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_eval_node(node.operand))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
            and not node.keywords):
        return _FUNCS[node.func.id](*[_eval_node(a) for a in node.args])
    raise ToolError(f"calculator: {ast.dump(node)[:60]} is not allowed (numbers, + - * / // % **, parentheses "
                    f"and {sorted(_FUNCS)} only)")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay exact).

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "1234 * 5678".
    """
    if len(expression) > _MAX_EXPR_CHARS:
        raise ToolError(f"calculator: the expression is longer than {_MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"calculator: {expression!r} is not an arithmetic expression") from None
    try:
        r = _eval_node(tree)
    except ZeroDivisionError:
        raise ToolError("calculator: division by zero") from None
    except (OverflowError, ValueError, TypeError) as e:
        raise ToolError(f"calculator: {e}") from None
    if isinstance(r, float) and r.is_integer() and abs(r) < 2**53:
        r = int(r)
    return str(r)


def lookup(key: str) -> str:
    """Look a key up in the table (the builtin:lookup task's values).

    Args:
        key: the key, e.g. "qzmk".
    """
    return str(lookup_value(key))


def count(letter: str, word: str) -> str:
    """Count how often a letter occurs in a word.

    Args:
        letter: one character.
        word: the word to search.
    """
    if len(letter) != 1:
        raise ToolError(f"count: letter must be one character, got {letter!r}")
    return str(word.count(letter))


_PURE = {"calculator": calculator, "lookup": lookup, "count": count}


# ---------------------------------------------------------------------- python
def python_tool(*, timeout_s: float = 10.0, sandbox: str = "bwrap", check: bool = True, **limits) -> Tool:
    """The `python` built-in: runs code in a sandbox (rlfuse.rollout.agent.sandbox: bubblewrap
    isolation by default, `none`, or a SandboxFusion URL) and returns what it printed.
    `check`: fail closed now (a ValueError) if the sandbox cannot run code isolated."""
    box = make_sandbox(sandbox, timeout_s=timeout_s, **limits)
    if check:
        box.check()

    def python(code: str) -> str:
        """Run a Python program and return what it prints (stdout); print the values you need.

        Args:
            code: the program's source, run as a fresh script in an empty working folder.
        """
        r = box.run(code)
        if r.timed_out:
            raise ToolTimeout(f"python: timed out after {timeout_s:g} s" + (f"; output so far:\n{r.stdout}"
                                                                            if r.stdout else ""))
        if r.error:
            raise ToolError(f"python: {r.error}" + (f"\n{r.stdout}" if r.stdout else "") +
                            (f"\n{r.stderr}" if r.stderr else ""))
        return r.stdout

    return Tool.from_function(python)


# ---------------------------------------------------------------------- loading
def builtin_tool(name: str, *, timeout_s: float = 10.0, sandbox: str = "bwrap", check: bool = True) -> Tool:
    if name in _PURE:
        return Tool.from_function(_PURE[name])
    if name == "python":
        return python_tool(timeout_s=timeout_s, sandbox=sandbox, check=check)
    raise ValueError(f"unknown built-in tool {name!r} (built-ins: calculator, lookup, count, python; or FILE.py:FUNCTION)")


PYTHON_TOOL = "python:"
"""Prefix of a tool recorded by name only (`python:<name>`): a function the Python API was
given, which only that process can resolve (through `functions`)."""


def load_tools(specs, *, timeout_s: float = 10.0, what: str = "rollout.tools", sandbox: str = "bwrap",
               check: bool = True, functions: dict | None = None) -> list[Tool]:
    """Tools from names, FILE.py:FUNCTION specs, functions or Tools. `sandbox` / `check`:
    where the `python` built-in runs code, and whether to prove now that it can.
    `functions`: callables by spec (the Python API's tool functions, `python:<name>`)."""
    tools = []
    for i, s in enumerate(specs):
        w = f"{what}[{i}]"
        if isinstance(s, str) and functions and s in functions:
            tools.append(Tool.from_function(functions[s], name=s.removeprefix(PYTHON_TOOL)))
        elif isinstance(s, str) and s.startswith(PYTHON_TOOL):
            raise ValueError(f"{w}: {s!r} names a function given to the Python API, which only that process can "
                             f"resolve; pass the function again (tools=[...]) or name it FILE.py:FUNCTION")
        elif isinstance(s, Tool):
            tools.append(s)
        elif callable(s):
            tools.append(Tool.from_function(s))
        elif isinstance(s, str) and ":" not in s:
            if s == "python":  # its sandbox's failure names rollout.sandbox, not this entry
                tools.append(builtin_tool(s, timeout_s=timeout_s, sandbox=sandbox, check=check))
                continue
            try:
                tools.append(builtin_tool(s, timeout_s=timeout_s))
            except ValueError as e:
                raise ValueError(f"{w}: {e}") from None
        elif isinstance(s, str):
            obj = load_function(s, w)
            tools.append(obj if isinstance(obj, Tool) else Tool.from_function(obj))
        else:
            raise ValueError(f"{w}: expected a built-in name, FILE.py:FUNCTION or a function, got {s!r}")
    names = [t.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{what}: tool name(s) {dup} appear twice")
    return tools
