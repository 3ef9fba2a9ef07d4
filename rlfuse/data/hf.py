"""Hugging Face datasets as rlfuse rows, and the row transforms every source gets.

Sources (data.train / data.eval), besides the files and builtin tasks of the datasets module:
  hf:NAME[:CONFIG]   `datasets.load_dataset(NAME, CONFIG, split=...)`: from the local
                     cache, or downloaded when there is network. Without network a name
                     that is not cached fails with an error naming the cache it looked in.
  a folder           written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`
                     (`datasets.load_from_disk`); a DatasetDict gives one split.
The split is `data.split` for data.train and `data.eval_split` for data.eval. Needs the
optional dependency `datasets` (extra `datasets`); without it these sources are an error
saying so, and files and builtin tasks work as before.
Row transforms, in this order, on every source (files and builtin tasks too):
  data.columns  {dataset column: rlfuse column}, e.g. {question: prompt, solution: answer}:
                columns renamed before anything reads them (the `*_field` keys then
                name the renamed columns; the defaults are prompt, answer, completion, messages)
  data.map      `file.py:fn` or `module:fn`, fn(row: dict) -> dict, applied to every row
                (after the renames); a raise or a non-dict result names the row
Rows keep a `where` for errors: `hf:NAME[split] row i`, `FOLDER[split] row i`.
Test: python -m pytest -q tests/test_hf_data.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

HF_PREFIX = "hf:"


def is_hf_source(src: str) -> bool:
    """A hub name (hf:...) or a folder in datasets' save_to_disk layout (other folders stay
    errors of the file reader)."""
    folder = Path(src)
    return src.startswith(HF_PREFIX) or (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def _datasets(field: str, src: str):
    try:
        import datasets  # optional dependency (extra `datasets`)
    except ImportError:
        raise ValueError(f"{field}: {src}: reading a Hugging Face dataset needs the datasets package "
                         f"(pip install 'rlfuse[datasets]')") from None
    return datasets


def read_hf(src: str, split: str, field: str = "data.train") -> list[tuple[str, dict]]:
    """[(where, row)] of one split of a hub dataset (hf:NAME[:CONFIG]) or a save_to_disk folder."""
    datasets = _datasets(field, src)
    if src.startswith(HF_PREFIX):
        name, _, config = src.removeprefix(HF_PREFIX).partition(":")
        if not name:
            raise ValueError(f"{field}: {src!r}: expected hf:NAME or hf:NAME:CONFIG")
        try:
            ds = datasets.load_dataset(name, config or None, split=split)
        # datasets raises many types here (no network, not on the Hub, no such config or
        # split, a cache miss in offline mode); each becomes one error naming what was tried
        except Exception as e:  # noqa: BLE001 -- the datasets library raises many types; re-raised as one ValueError naming the dataset
            what = f"{name!r}" + (f" (config {config!r})" if config else "") + f", split {split!r}"
            raise ValueError(
                f"{field}: {src}: could not load {what}: {type(e).__name__}: {e}. A hub dataset is read from the "
                f"local cache {datasets.config.HF_DATASETS_CACHE} (Hub offline mode: "
                f"{'on' if datasets.config.HF_HUB_OFFLINE else 'off'}) or downloaded when there is network; "
                f"without network, download it once elsewhere into that cache, or save it with "
                f"Dataset.save_to_disk and give the folder") from None
        where = f"{src}[{split}]"
    else:
        try:
            ds = datasets.load_from_disk(src)
        except FileNotFoundError as e:
            raise ValueError(f"{field}: {src}: a folder, but not one written by save_to_disk ({e})") from None
        where = src
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{field}: {src}: the dataset has no split {split!r}; it has {sorted(ds)}")
            ds, where = ds[split], f"{src}[{split}]"
    rows = ds.to_list()
    if not rows:
        raise ValueError(f"{field}: {where}: no rows (expected at least one)")
    return [(f"{where} row {i}", row) for i, row in enumerate(rows)]


def transform_rows(pairs: list[tuple[str, dict]], columns: dict, row_map: Callable | None,
                   map_name: str = "data.map") -> list[tuple[str, dict]]:
    """`data.columns` renames, then `data.map`, on [(where, row)]; see the module docstring."""
    out = []
    for where, row in pairs:
        if columns:
            missing = [c for c in columns if c not in row]
            if missing:
                raise ValueError(f"{where}: data.columns renames {missing}, which the row does not have; "
                                 f"its columns are {sorted(row)}")
            clash = [v for k, v in columns.items() if v in row and v not in columns]
            if clash:
                raise ValueError(f"{where}: data.columns renames onto {clash}, which the row already has")
            row = {columns.get(k, k): v for k, v in row.items()}
        if row_map is not None:
            try:
                new = row_map(dict(row))
            # a user function: whatever it raises, the error names the row it failed on
            except Exception as e:
                raise ValueError(f"{where}: {map_name} raised {type(e).__name__}: {e}") from e
            if not isinstance(new, dict):
                raise ValueError(f"{where}: {map_name} must return a dict (the row), got {type(new).__name__}")
            row = new
        out.append((where, row))
    return out
