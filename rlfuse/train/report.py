"""`rlfuse report RUN_DIR`: PNG plots of metrics.jsonl and a one-page HTML summary.

Every folder at or below RUN_DIR (two levels; the demo writes sft/ and grpo/) holding a
metrics.jsonl gets a section: its config, the last logged values, the eval results and
one PNG per metric group (reward and accuracy, completion length, loss/clipping/KL/
entropy, optimizer, time split, throughput, log-prob mismatch, memory), plus the latest
sample completions. Output: RUN_DIR/report/index.html and RUN_DIR/report/*.png.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

GROUPS = [
    ("reward", ("reward/", "accuracy")),
    ("length", ("completion_len/", "truncated_frac")),
    ("policy", ("loss", "clip_frac", "kl", "entropy", "ratio_mean")),
    ("advantage", ("adv/", "groups/")),
    ("optimizer", ("grad_norm", "lr")),
    ("time", ("time/",)),
    ("throughput", ("tokens_per_s",)),
    ("mismatch", ("mismatch/",)),
    ("memory", ("memory/",)),
]


def _runs(run_dir: Path) -> list[Path]:
    found = [p.parent for p in sorted(run_dir.glob("metrics.jsonl"))]
    found += [p.parent for p in sorted(run_dir.glob("*/metrics.jsonl"))]
    found += [p.parent for p in sorted(run_dir.glob("*/*/metrics.jsonl"))]
    return found


def _series(rows: list[dict], stage: str) -> dict[str, tuple[list, list]]:
    out: dict[str, tuple[list, list]] = {}
    for r in rows:
        if r.get("stage") != stage:
            continue
        for k, v in r.items():
            if k in ("step", "stage") or v is None or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            xs, ys = out.setdefault(k, ([], []))
            xs.append(r["step"])
            ys.append(v)
    return out


def _plot(series: dict, prefixes, title: str, path: Path) -> bool:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in series if any(k == p or (p.endswith("/") and k.startswith(p)) or
                                     (not p.endswith("/") and k.startswith(p)) for p in prefixes)]
    if not keys:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=90)
    for k in keys:
        xs, ys = series[k]
        ax.plot(xs, ys, label=k, marker="o" if len(xs) < 3 else None)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _table(d: dict) -> str:
    cells = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{v:.4g}</td></tr>" if isinstance(v, float)
                    else f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in d.items())
    return f"<table>{cells}</table>"


def render(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    runs = _runs(run_dir)
    if not runs:
        raise ValueError(f"{run_dir}: no metrics.jsonl here or in its subfolders (is this a run folder?)")
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    parts = [f"<h1>rlfuse run {html.escape(str(run_dir))}</h1>"]
    for run in runs:
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        name = run.relative_to(run_dir).as_posix() if run != run_dir else "."
        parts.append(f"<h2>{html.escape(name)}</h2>")
        stages = list(dict.fromkeys(r.get("stage", "train") for r in rows))
        evals = [r for r in rows if r.get("stage") == "eval"]
        if evals:
            keys = [k for k in evals[0] if k != "stage"]
            head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
            body = "".join("<tr>" + "".join(f"<td>{r.get(k) if not isinstance(r.get(k), float) else f'{r[k]:.4g}'}</td>"
                                            for k in keys) + "</tr>" for r in evals)
            parts.append(f"<h3>evaluation</h3><table><tr>{head}</tr>{body}</table>")
        for stage in stages:
            if stage == "eval":
                continue
            last = [r for r in rows if r.get("stage") == stage][-1]
            parts.append(f"<h3>{html.escape(stage)}: last logged step {last['step']}</h3>")
            parts.append(_table({k: v for k, v in last.items() if k not in ("stage",)}))
            series = _series(rows, stage)
            for gname, prefixes in GROUPS:
                png = out / f"{name.replace('/', '_').strip('.') or 'run'}_{stage}_{gname}.png"
                if _plot(series, prefixes, f"{name} {stage}: {gname}", png):
                    parts.append(f'<img src="{png.name}" alt="{gname}">')
        samples = run / "samples.jsonl"
        if samples.exists():
            last = [json.loads(x) for x in samples.read_text().splitlines()[-6:]]
            items = "".join(f"<li><b>step {s.get('step')}, reward {s.get('reward')}</b><pre>"
                            f"{html.escape(str(s.get('prompt', '')))}<b>{html.escape(str(s.get('completion', '')))}</b>"
                            f"</pre></li>" for s in last)
            parts.append(f"<h3>latest samples</h3><ul>{items}</ul>")
        cfg = run / "config.yaml"
        if cfg.exists():
            parts.append(f"<details><summary>config.yaml</summary><pre>{html.escape(cfg.read_text())}</pre></details>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse;margin:6px 0}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}img{max-width:49%}pre{white-space:pre-wrap}")
    index = out / "index.html"
    index.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>rlfuse report</title>"
                     f"<style>{style}</style></head><body>{''.join(parts)}</body></html>")
    return index
