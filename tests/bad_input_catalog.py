"""The bad-input corpus's catalog: what each case fed and the exact text the user sees.

A corpus case is a test marked `@pytest.mark.bad_input("<category>")` (tests/test_bad_inputs.py).
While it runs, its helpers call `seen(fed, text)` for every message the user would get: an
`rlfuse: error: ...` line (a ValueError as the CLI prints it, or the CLI's own stderr line) or
the log line(s) that report a handled input. The texts are kept as they are, except the
pytest temporary folder of the case, shown as `<tmp>`, and a few other machine-specific parts
(`normalize`), so the catalog reads the same on every machine. A case that passes without
recording anything fails (tests/conftest.py checks it).

    python -m pytest -q tests/test_bad_inputs.py --bad-input-catalog docs/bad-inputs.md

writes the catalog (one table per category, one row per case); tests/test_bad_inputs.py
checks that the document lists exactly the collected cases, and every case run without
that option fails when its recorded text differs from its row in the document (`stale`,
called from tests/conftest.py): a changed message needs the catalog regenerated.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

COMMAND = "python -m pytest -q tests/test_bad_inputs.py --bad-input-catalog docs/bad-inputs.md"
REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "bad-inputs.md"

# category key (the marker's argument) -> section title, in the document's order
CATEGORIES = {
    "data": "Data files and prompts",
    "rewards": "Reward functions",
    "model-config": "Model config.json",
    "kernels-devices": "Kernels and devices",
    "config-ranges": "Run config: fields and ranges",
    "checkpoints-fs": "Checkpoints and the file system",
    "metrics-report": "Metrics and report",
    "non-finite": "Non-finite numbers in training",
    "cli": "Command line",
    "run-folders": "Run folders: start, resume, overwrite",
    "lora": "LoRA adapters",
    "serve": "The server (rlfuse serve)",
    "agents": "Tools, environments and the sandbox",
}

PROPERTY = "bad_input"  # the key of the (fed, text) entries in item.user_properties


@dataclass
class _Case:
    item: pytest.Item
    tmp_root: str  # pytest's base temporary folder; each case's own folder sits right under it


_current: _Case | None = None  # the corpus case running now (set by tests/conftest.py's autouse fixture)


def category(item: pytest.Item) -> str | None:
    """The item's corpus category, or None when it is not a corpus case (a mark without a
    valid category stops the session at collection: `check_mark`)."""
    mark = item.get_closest_marker("bad_input")
    return mark.args[0] if mark is not None and check_mark(item) is None else None


def check_mark(item: pytest.Item) -> str | None:
    """What is wrong with the item's bad_input mark, or None."""
    mark = item.get_closest_marker("bad_input")
    if mark is not None and (len(mark.args) != 1 or mark.args[0] not in CATEGORIES):
        return f"{item.nodeid}: @pytest.mark.bad_input needs one category of {list(CATEGORIES)}, got {mark.args}"
    return None


def case_id(nodeid: str) -> str:
    """The short form of a node id: `test_bad_data_file[missing-file]`."""
    return nodeid.split("::", 1)[1]


def begin(item: pytest.Item, tmp_root: Path) -> None:
    global _current
    _current = _Case(item, str(tmp_root))


def end() -> None:
    global _current
    _current = None


def normalize(text: str) -> str:
    """Machine-specific parts of a message replaced: the case's temporary folder -> <tmp>,
    this checkout -> <repo>, the free space of the disk -> <N> GiB free, process ids and this
    machine's host name (a run folder's lock) -> <pid>, <host>, and what other libraries'
    versions word differently (torch's version, pyarrow's own message), so that the catalog
    check (`stale`) fails on a changed rlfuse message, not on an upgraded dependency."""
    assert _current is not None
    text = re.sub(re.escape(_current.tmp_root) + r"/[^/\s'\"():,]+", "<tmp>", text)
    text = re.sub(r"\bpid \d+ on host " + re.escape(socket.gethostname()) + r"\b", "pid <pid> on host <host>", text)
    text = text.replace(str(REPO), "<repo>")
    text = re.sub(r"\(torch \d+\.\d+\S*, CUDA build: ", "(torch <version>, CUDA build: ", text)
    text = re.sub(r"(not a readable Parquet file) \(.*\)$", r"\1 (<pyarrow's message>)", text, flags=re.M)
    return re.sub(r"\b\d+(\.\d+)? GiB free", "<N> GiB free", text)


def seen(fed: str, text: str) -> None:
    """Record, for the running corpus case, that feeding `fed` shows the user `text`."""
    if _current is None:
        raise RuntimeError("seen() outside a corpus case: mark the test @pytest.mark.bad_input(<category>)")
    _current.item.user_properties.append((PROPERTY, (normalize(fed), normalize(text.rstrip("\n")))))


def recorded(item: pytest.Item) -> list[tuple[str, str]]:
    return [v for k, v in item.user_properties if k == PROPERTY]


# ------------------------------------------------------------------ the document
def _code(text: str) -> str:
    """One line as Markdown inline code inside a table cell."""
    ticks = "`" * (max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    text = text.replace("|", r"\|")
    pad = " " if text.startswith("`") or text.endswith("`") else ""  # CommonMark strips one space each side
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _cell(text: str) -> str:
    return "<br>".join(_code(line) for line in text.splitlines() or [""])


def render(rows: list[tuple[str, str, list[tuple[str, str]] | str]]) -> str:
    """rows: (category, case id, [(fed, text)] or the reason the case did not run here)."""
    out = [
        "# What the user sees on bad input",
        "",
        f"Generated by `{COMMAND}`",
        "(the bad-input corpus, tests/test_bad_inputs.py; `tests/bad_input_catalog.py` records the messages).",
        "Do not edit by hand: regenerate after changing a message or a case. The test suite checks that",
        "this file lists exactly the corpus's cases, and a case fails when the text it sees differs from",
        "its row here (a changed message is reviewed here, in the diff of this file).",
        "",
        "Each row is one case: what was fed, and the exact text the user sees: the `rlfuse: error:` line",
        "(no traceback, exit status 2) or, for an input that is handled, the log line that reports it",
        "(as `LEVEL logger: message`, without the time stamp). `<tmp>` stands for the case's temporary",
        "folder, `<repo>` the checkout. Several inputs fed in one case are numbered. Not listed: a rank",
        "failing under torchrun (tests/test_distributed_run.py: every rank ends with one `rlfuse: error:` line",
        "carrying the failing rank's message), which needs a multi-process run.",
        "",
    ]
    by_cat: dict[str, list] = {c: [] for c in CATEGORIES}
    for cat, cid, entries in rows:
        by_cat[cat].append((cid, entries))
    out.append("| category | cases |")
    out.append("|---|---|")
    for cat, title in CATEGORIES.items():
        out.append(f"| {title} | {len(by_cat[cat])} |")
    out.append(f"| total | {len(rows)} |")
    for cat, title in CATEGORIES.items():
        out += ["", f"## {title}", "", "| case | fed | the user sees |", "|---|---|---|"]
        out += [render_row(cid, entries) for cid, entries in by_cat[cat]]
    return "\n".join(out) + "\n"


def render_row(cid: str, entries: list[tuple[str, str]] | str) -> str:
    """The document's table row of one case."""
    if isinstance(entries, str):
        return f"| {_code(cid)} | (not run here: {entries}) | |"
    feds = list(dict.fromkeys(f for f, _ in entries))
    if len(feds) == 1:
        fed, seen_ = _cell(feds[0]), "<br>".join(_cell(t) for _, t in entries)
    else:
        fed = "<br>".join(f"{i}. {_cell(f)}" for i, f in enumerate(feds, 1))
        seen_ = "<br>".join(f"{feds.index(f) + 1}. {_cell(t)}" for f, t in entries)
    return f"| {_code(cid)} | {fed} | {seen_} |"


def stale(item: pytest.Item) -> str | None:
    """What differs between the case's recorded messages and its row in docs/bad-inputs.md
    (None when they agree, or when the document does not list the case yet: the test of
    the list reports that)."""
    row = documented().get((category(item), case_id(item.nodeid)))
    got = render_row(case_id(item.nodeid), recorded(item))
    if row is None or row == got:
        return None
    return (f"{case_id(item.nodeid)}: the user now sees other text than docs/bad-inputs.md records; if the new "
            f"message is the intended one, regenerate the catalog with `{COMMAND}`\n  documented: {row}\n"
            f"  now:        {got}")


_DOCUMENTED: dict | None = None


def documented() -> dict[tuple[str, str], str]:
    """(category, case id) -> its row in docs/bad-inputs.md (read once)."""
    global _DOCUMENTED
    if _DOCUMENTED is None:
        titles = {t: c for c, t in CATEGORIES.items()}
        cat, _DOCUMENTED = None, {}
        for line in DOC.read_text().splitlines() if DOC.exists() else []:
            if line.startswith("## "):
                cat = titles.get(line[3:].strip())
            elif cat and (m := re.match(r"\| (`+) ?(.+?) ?\1 \|", line)):
                _DOCUMENTED[(cat, m.group(2).replace(r"\|", "|"))] = line
    return _DOCUMENTED


def listed(doc: str) -> set[tuple[str, str]]:
    """(category, case id) of every row of a rendered document."""
    titles = {t: c for c, t in CATEGORIES.items()}
    cat, out = None, set()
    for line in doc.splitlines():
        if line.startswith("## "):
            cat = titles.get(line[3:].strip())
        elif cat and (m := re.match(r"\| (`+) ?(.+?) ?\1 \|", line)):
            out.add((cat, m.group(2).replace(r"\|", "|")))
    return out
