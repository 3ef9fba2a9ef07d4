"""Dataclass configs <-> YAML and `a.b=value` overrides, for any tree of frozen dataclasses.

Generic: nothing here knows which configs exist (those are in `rlfuse.run.config.run_config`).
    load(cls, "recipe.yaml", ["grpo.clip_high=0.28"])   YAML + overrides -> cls, type-checked
    to_dict(cfg) / from_dict(cls, data)                  plain data <-> dataclass
    save(cfg, path)                                      YAML that `load` reads back equal
    replace(cfg, **{"grpo.steps": 3})                    dotted-key copy, type-checked
    field_docs(cls) / describe(cls)                      field docstrings, one line per leaf key
Override values are parsed as YAML scalars/flow values, then checked against the field's
type; unknown keys raise ValueError with the list of valid ones; errors name the dotted
field (`grpo.clip_high`) and what was expected.
Test: python -m pytest -q tests/test_config.py
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import yaml


# ------------------------------------------------------------------ dict <-> dataclass
@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _section(tp):
    """The dataclass of a section field typed `X` or `X | None` (an optional section, e.g.
    model.lora), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def to_dict(cfg) -> Any:
    """Plain YAML-able data (tuples become lists)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(x) for x in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def from_dict(cls, data: Any, where: str = ""):
    """Build dataclass `cls` from nested dicts, checking keys and types; ValueError names
    the dotted field (`grpo.clip_high`) and what was expected."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {type(data).__name__} {data!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ValueError(f"{where + '.' if where else ''}{unknown[0]}: unknown key; valid keys"
                         f"{' of ' + where if where else ''}: {', '.join(names)}")
    hints = _hints(cls)
    kw = {k: _coerce(hints[k], v, f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        return cls(**kw)
    except TypeError as e:  # a required field is missing
        raise ValueError(f"{where or 'config'}: {e}") from None
    except ValueError as e:  # the dataclass's own checks (__post_init__)
        raise ValueError(_at(where, str(e), cls.__name__)) from None


def _at(where: str, msg: str, owner: str = "") -> str:
    """A section's own check placed at `where`. A check that names its field by the section's
    key or by its class (LoRAConfig: "lora.rank must be ...", EngineConfig: "EngineConfig.
    block_size must be ...", both right when built in Python) gets the full dotted path
    instead ("model.lora.rank must be ...", "engine.block_size must be ..."), not the path
    and then the name again; any other message is prefixed with the path."""
    if not where:
        return msg
    for name in (where.rpartition(".")[2], owner):
        if name and msg.startswith(name + "."):
            return where + msg[len(name):]
    return f"{where}: {msg}"


def _coerce(tp, v, where: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, v, where)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{where}: got {v!r}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, v, where)
    if origin is list:
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {v!r}")
        return [_coerce(args[0], x, f"{where}[{i}]") for i, x in enumerate(v)]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {v!r}")
        return tuple(_coerce(args[0], x, f"{where}[{i}]") for i, x in enumerate(v))
    if origin is tuple:
        if not isinstance(v, (list, tuple)) or len(v) != len(args):
            raise ValueError(f"{where}: expected a list of {len(args)} values, got {v!r}")
        return tuple(_coerce(a, x, f"{where}[{i}]") for i, (a, x) in enumerate(zip(args, v)))
    if tp is dict or origin is dict:
        if not isinstance(v, dict):
            raise ValueError(f"{where}: expected a mapping, got {v!r}")
        return dict(v)
    if tp is bool:
        if not isinstance(v, bool):
            raise ValueError(f"{where}: expected true or false, got {v!r}")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{where}: expected an integer, got {v!r}")
        return v
    if tp is float:
        if isinstance(v, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept what Python reads as a number
            try:
                v = float(v)
            except ValueError:
                raise ValueError(f"{where}: expected a number, got {v!r}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{where}: expected a number, got {v!r}")
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            raise ValueError(f"{where}: expected a string, got {v!r}")
        return v
    return v


# ------------------------------------------------------------------ overrides and files
class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (PyYAML keeps the last
    silently: a second `optim:` block would drop the first one's keys to their defaults)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: PyYAML's own error follows
                continue
            if first != key_node.start_mark.line + 1:
                raise ValueError(f"{key_node.start_mark.name}:{key_node.start_mark.line + 1}: key {key!r} is given "
                                 f"twice in one mapping (first at line {first}); YAML would keep only the last "
                                 f"one: merge the two into one")
        return super().construct_mapping(node, deep)


def read_yaml(path: Path):
    """The YAML file `path` parsed, with ValueErrors naming the file (and line) for invalid
    YAML and for a key given twice in one mapping."""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start})") from None


def apply_override(data: dict, item: str, cls=None) -> dict:
    """Set `a.b.c=value` in nested dict `data` (in place). With `cls`, unknown keys raise
    ValueError listing the valid ones. The value is parsed as a YAML scalar/flow value."""
    if "=" not in item:
        raise ValueError(f"override {item!r}: expected KEY=VALUE, e.g. grpo.clip_high=0.28")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ValueError(f"override {item!r}: value is not valid YAML ({e})") from None
    node, node_cls = data, cls
    for i, p in enumerate(parts):
        prefix = ".".join(parts[:i])
        if node_cls is not None:
            names = [f.name for f in dataclasses.fields(node_cls)]
            if p not in names:
                raise ValueError(f"override {key!r}: unknown key {p!r}"
                                 f"{' in ' + prefix if prefix else ''}; valid keys: {', '.join(names)}")
            node_cls = _section(_hints(node_cls)[p])
        if i == len(parts) - 1:
            node[p] = value
        else:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ValueError(f"override {key!r}: {'.'.join(parts[:i + 1])} is not a mapping")
            node = nxt
    return data


def load(cls, src: str | Path | dict | None = None, overrides: list[str] = (), prepare=None):
    """Dataclass `cls` from a YAML file (or dict) plus `a.b=value` overrides; ValueErrors
    name the file and the dotted field. `prepare(data)`, if given, rewrites the file's data
    in place before the overrides apply (e.g. paths relative to the file)."""
    where = "config"
    if src is None:
        data = {}
    elif isinstance(src, dict):
        data = to_dict(src)
    else:
        path = Path(src)
        where = str(path)
        if not path.exists():
            raise ValueError(f"{path}: no such config file")
        data = read_yaml(path) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        if prepare is not None:
            prepare(data)
    for item in overrides:
        apply_override(data, item, cls)
    try:
        return from_dict(cls, data)
    except ValueError as e:
        # the value an error names came from --set when its key is an override's: blame that
        msg = str(e)
        item = next((o for o in reversed(overrides) if re.match(rf"{re.escape(o.split('=', 1)[0].strip())}\b", msg)),
                    None)
        raise ValueError(f"--set {item}: {msg}" if item else f"{where}: {msg}") from None


def save(cfg, path: str | Path) -> Path:
    """Dataclass `cfg` as YAML (`to_dict`); `load` of the file gives an equal config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def replace(cfg, **changes):
    """A copy of dataclass `cfg` with dotted-key changes, type-checked like a loaded file:
    replace(cfg, **{"grpo.steps": 3, "rewards": [{"name": "arithmetic"}]})."""
    data = to_dict(cfg)
    for key, value in changes.items():
        node, parts = data, key.split(".")
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                raise ValueError(f"replace: {key!r}: {p!r} is not a section")
            node = node[p]
        node[parts[-1]] = to_dict(value)
    return from_dict(type(cfg), data)


# ------------------------------------------------------------------ help text
def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field), for --help."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            docs[a.target.id] = " ".join(b.value.value.split())
    return docs


REQUIRED = object()
"""The default of a field that has none (`Leaf.default`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Leaf:
    """One settable key of a config tree (see `leaves`)."""
    key: str
    """Dotted key as `--set` takes it; `rewards[].name` for fields of list items."""
    type: str
    default: Any
    """Plain data (`to_dict`), or REQUIRED."""
    doc: str


def _type_name(tp) -> str:
    if typing.get_origin(tp) is None and isinstance(tp, type):
        return tp.__name__
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+(\w+)", r"\1", str(tp))  # rlfuse.x.RewardSpec -> RewardSpec


def leaves(cls, prefix: str = "") -> list[Leaf]:
    """Every leaf key of dataclass `cls` in field order, nested dataclasses flattened
    (`grpo.clip_high`); a list of dataclasses gives its own leaf, then its items' fields."""
    out = []
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        key = prefix + f.name
        if dataclasses.is_dataclass(tp):
            out += leaves(tp, key + ".")
            continue
        optional = _section(tp)  # `X | None`: the key itself (null: off), then X's keys
        if f.default is not dataclasses.MISSING:
            default = to_dict(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = to_dict(f.default_factory())
        else:
            default = REQUIRED
        out.append(Leaf(key, _type_name(tp), default, docs.get(f.name, "")))
        if optional is not None:
            out += leaves(optional, key + ".")
        args = typing.get_args(tp)
        if typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
            out += leaves(args[0], key + "[].")
    return out


def describe(cls, prefix: str = "") -> list[str]:
    """One line per leaf key, for --help: `grpo.clip_high (float, default 0.2): doc`."""
    return [f"{x.key} ({x.type}, " + ("required" if x.default is REQUIRED else f"default {x.default!r}") + ")"
            + (f": {x.doc}" if x.doc else "") for x in leaves(cls, prefix)]
