"""Rows from a data source: `.jsonl`, `.json`, `.parquet` files, `builtin:<task>`, or a
Hugging Face dataset (rlfuse.data.hf: hf:NAME[:CONFIG], a save_to_disk folder), read,
decoded, renamed (data.columns), transformed (data.map) and validated. A malformed row
raises ValueError naming `file:line` (the row number for .json/.parquet) and the field; a
missing, empty, non-UTF-8 or non-JSON file names the file. The row formats are described
in rlfuse/data/prompts.py.
Test: python -m pytest -q tests/test_data.py tests/test_bad_inputs.py
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rlfuse.data.hf import is_hf_source, read_hf, transform_rows
from rlfuse.data.media import check_parts
from rlfuse.data.tasks import make_split
from rlfuse.run import load_function
from rlfuse.run.config import DataConfig

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ reading rows
def _read_bytes(path: Path) -> bytes:
    if not path.exists():
        where = "" if path.is_absolute() else f" (a relative path: looked in {Path.cwd()})"
        raise ValueError(f"{path}: no such data file{where}")
    if path.is_dir():
        raise ValueError(f"{path}: is a folder; expected a .jsonl, .json or .parquet file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the data file ({e.strerror or e})") from None
    if not data.strip():
        raise ValueError(f"{path}: the data file is empty (expected rows)")
    return data


def _decode(path: Path, data: bytes) -> str:
    """UTF-8 text (a leading BOM is dropped); undecodable bytes name the file and line."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{line}: not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start}); "
                         f"save the file as UTF-8") from None


CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles a chat row's messages may have."""


class _NonFinite(str):
    """What json.loads makes of NaN / Infinity / -Infinity (Python's json accepts them; JSON
    does not): kept as a marker, so the row's check can name the field (`_check_finite`)."""


def _loads(text: str):
    return json.loads(text, parse_constant=_NonFinite)


def _check_finite(where: str, value, field: str = "") -> None:
    if isinstance(value, _NonFinite):
        raise ValueError(f"{where}: field {field!r} is {value}, which is not a JSON number; expected a finite number "
                         f"(or null for a missing value)")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(where, v, f"{field}.{k}" if field else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(where, v, f"{field}[{i}]")


def _read_file(path: Path) -> list[tuple[str, dict]]:
    """[(where, row)] from a .jsonl / .json / .parquet file."""
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise ValueError(f"{path}: unsupported data file type {suffix!r} (expected .jsonl, .json or .parquet)")
    data = _read_bytes(path)
    out = []
    if suffix == ".jsonl":
        for i, line in enumerate(_decode(path, data).splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = _loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            out.append((f"{path}:{i}", row))
    elif suffix == ".json":
        try:
            data = _loads(_decode(path, data))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a list of rows (or an object with a 'data' list)")
        out = [(f"{path}: row {i}", row) for i, row in enumerate(data)]
    else:
        try:
            import pyarrow.parquet as pq  # optional dependency: only Parquet data needs it
        except ImportError:
            raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 -- pyarrow's own error types; the message says what is wrong
            raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
        out = [(f"{path}: row {i}", row) for i, row in enumerate(table.to_pylist())]
    if not out:
        raise ValueError(f"{path}: no rows in the data file (expected at least one row object)")
    for where, row in out:
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object (a row of fields), got {type(row).__name__}")
        _check_finite(where, row)
    return out


def _check_row(where: str, row: dict, cfg: DataConfig, need_target: bool) -> None:
    mf, pf = cfg.messages_field, cfg.prompt_field
    if mf in row:
        msgs = row[mf]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: field {mf!r} must be a non-empty list of messages")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                    not isinstance(m.get("content"), (str, list)):
                raise ValueError(f"{where}: field {mf}[{j}] must be an object with string 'role' and 'content' "
                                 f"(a string, or a list of content parts)")
            if isinstance(m["content"], list):
                check_parts(where, f"{mf}[{j}].content", m["content"])
            if m["role"] not in CHAT_ROLES:
                raise ValueError(f"{where}: field {mf}[{j}].role is {m['role']!r}; expected one of "
                                 f"{', '.join(CHAT_ROLES)}")
        if need_target and not any(m["role"] == "assistant" for m in msgs):
            raise ValueError(f"{where}: field {mf!r} has no assistant message to train on")
        return
    if pf not in row:
        raise ValueError(f"{where}: missing field {pf!r} (or {mf!r}); the row has fields {sorted(row)}")
    if not isinstance(row[pf], str):
        raise ValueError(f"{where}: field {pf!r} must be a string, got {type(row[pf]).__name__}")
    af = cfg.answer_field
    if af in row and not isinstance(row[af], (str, int, float)):
        raise ValueError(f"{where}: field {af!r} must be a string or a number, got {type(row[af]).__name__}")
    if need_target:
        cf = cfg.completion_field if cfg.completion_field in row else af
        if cf not in row:
            raise ValueError(f"{where}: missing field {cfg.completion_field!r} (the SFT target; "
                             f"{af!r} is used when it is absent)")
        if not isinstance(row[cf], (str, int, float)):
            raise ValueError(f"{where}: field {cf!r} must be a string, got {type(row[cf]).__name__}")


def load_rows(cfg: DataConfig, split: str = "train", need_target: bool = False) -> list[tuple[str, dict]]:
    """[(where, row)] of the train or eval split, validated."""
    src = cfg.train if split == "train" else (cfg.eval or (cfg.train if cfg.train.startswith("builtin:") else ""))
    if not src:
        raise ValueError(f"data.{split} is empty: give a .jsonl/.json/.parquet file, builtin:<task>, hf:NAME "
                         f"or a save_to_disk folder")
    if src.startswith("builtin:"):
        task = src.removeprefix("builtin:")
        # eval first: small and fixed, then train excluding its prompts (image tasks: its layouts)
        ev = make_split(task, cfg.eval_size, seed=cfg.seed + 10007, **cfg.task)
        if split == "eval":
            rows = ev
        else:
            rows = make_split(task, cfg.train_size, seed=cfg.seed, exclude={r.get("key", r["prompt"]) for r in ev}, **cfg.task)
        pairs = [(f"{src}[{split} {i}]", r) for i, r in enumerate(rows)]
    elif is_hf_source(src):
        pairs = read_hf(src, cfg.split if split == "train" else cfg.eval_split, f"data.{split}")
    else:
        pairs = _read_file(Path(src))
    if cfg.columns or cfg.map:
        row_map = load_function(cfg.map, "data.map") if cfg.map else None
        pairs = transform_rows(pairs, cfg.columns, row_map)
    for where, row in pairs:
        _check_row(where, row, cfg, need_target)
    return pairs


