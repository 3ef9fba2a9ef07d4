"""`rlfuse report RUN_DIR`: PNG plots of metrics.jsonl and a one-page HTML summary.

Every folder at or below RUN_DIR (two levels; the demo writes sft/ and grpo/) holding a
metrics.jsonl gets a section. The page leads with the headline result (held-out accuracy
before -> after, or held-out reward, or the final loss when there is no evaluation), then
per run: the data checks (rows kept, dropped and truncated by reason), the held-out
evaluation (plotted and tabulated), one PNG per metric group, the last logged values, the
latest sample completions and the config.

Plot rules: every axis has a y label with its unit; a panel holds metrics of one unit, and
lines whose magnitudes differ by more than SCALE_RATIO get separate axes; the page heads
each figure, the figure titles only its panels (no doubled titles). Accuracy measured on
the sampled training completions is "training accuracy, sampled (T=...)" (the run's
grpo.temperature); accuracy of greedy completions of the held-out prompts is "held-out
accuracy, greedy". A series of fewer than SPARSE points (held-out evaluations every many
steps) is drawn as markers only: a straight line between two evaluations would show values
nobody measured. A demo folder's demo.json (its before/after and the agent demo's no-tool
baseline) heads the page, and the baseline is a dashed line on the held-out accuracy panel.
Output: RUN_DIR/report/index.html and RUN_DIR/report/*.png.
Test: python -m pytest -q tests/test_report.py
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

import yaml
from matplotlib.figure import Figure  # no pyplot: no global figure state or display backend
from matplotlib.ticker import MaxNLocator

from rlfuse.run.folder import make_folder
from rlfuse.run.metrics import DATA_REASONS, DATA_STAGE, NOT_TRAINING, data_lines, read_jsonl

SCALE_RATIO = 10.0
"""Lines whose typical magnitudes differ by more than this factor go on separate axes."""
MIN_SPAN = 0.2
"""A y axis spans at least this share of its largest |value|, and at least NOISE_SPAN, so
that noise (a constant loss, a ratio of 0.99999994..1) does not read as a trend."""
NOISE_SPAN = 1e-6
"""Smallest span of a signed axis: a GRPO loss of +-4e-8 is float32 rounding around 0."""
FROM_ZERO = ("MiB", "tokens", "seconds", "tokens / s", "optimizer steps", "examples per step", "rollout steps",
             "groups", "nats per token", "nats per sequence", "nats", "|delta log p| (nats)",
             "L2 norm (before clipping)")
"""Units of amounts (>= 0) whose axis starts at 0 (376..400 MiB is flat, not a leak); so do
all fractions ("fraction ...")."""

# group -> panels (title, y label, metric-key patterns); "x/" matches keys under x/, "x_" keys
# starting with x_, anything else the exact key. The first panel claiming a key plots it.
GROUPS: list[tuple[str, list[tuple[str, str, tuple[str, ...]]]]] = [
    ("reward", [("training accuracy, sampled", "fraction correct (sampled completions)", ("accuracy",)),
                ("greedy accuracy on training problems", "fraction solved", ("dev/accuracy",)),
                ("reward (weighted total)", "reward", ("reward/mean", "reward/std")),
                ("normalized reward", "reward / running std", ("reward/normalized_mean",)),
                ("reward per function", "reward", ("reward/",)),
                ("reward errors", "examples per step", ("reward_errors/",))]),
    ("completions", [("completion length", "tokens", ("completion_len/",)),
                           ("truncated completions", "fraction", ("truncated_frac",))]),
    ("training objective", [("loss", "loss", ("loss",)),
                     ("clipped tokens", "fraction of tokens", ("clip_frac", "clip_frac_")),
                     ("importance ratio", "ratio", ("ratio_mean",)),
                     ("KL to the reference", "nats per token", ("kl",)),
                     ("KL to the reference per sequence", "nats per sequence", ("kl/seq",)),
                     ("KL coefficient", "coefficient", ("kl_coef",)),
                     ("entropy", "nats per token", ("entropy",))]),
    ("preference pairs", [("implicit reward accuracy", "fraction of pairs", ("rewards/accuracy",)),
                                ("implicit rewards", "beta x log-prob ratio", ("rewards/",)),
                                ("sequence log-probs", "nats per sequence", ("logps/",))]),
    ("advantage", [("advantage statistics", "advantage", ("adv/",)),
                   ("zero-variance groups", "fraction of groups", ("groups/zero_variance_frac",)),
                   ("groups trained", "groups", ("groups/kept",)),
                   ("no group trained: update skipped", "rollout steps", ("skipped_update",))]),
    ("critic", [("value loss", "loss", ("critic/value_loss",)),
                      ("values and returns", "return", ("values/mean", "returns/mean")),
                      ("explained variance", "fraction of return variance", ("critic/explained_variance",)),
                      ("clipped values", "fraction of tokens", ("critic/value_clip_frac",)),
                      ("critic gradient norm", "L2 norm (before clipping)", ("critic/grad_norm",)),
                      ("critic skipped updates", "optimizer steps", ("critic/skipped_steps",)),
                      ("critic update size", "||dW|| / ||W|| (largest of the step)", ("critic/update_ratio",))]),
    ("optimizer", [("gradient norm", "L2 norm (before clipping)", ("grad_norm",)),
                   ("learning rate", "learning rate", ("lr",)),
                   ("update size", "||dW|| / ||W|| (largest of the step)", ("optim/update_ratio",)),
                   ("skipped updates (non-finite)", "optimizer steps", ("optim/skipped_steps",))]),
    ("time", [("time per step", "seconds", ("time/",))]),
    ("throughput", [("tokens per second", "tokens / s", ("tokens_per_s", "tokens_per_s/")),
                    ("tokens per step", "tokens", ("tokens", "target_tokens"))]),
    ("rollout vs trainer log-probs", [("log-prob difference", "|delta log p| (nats)", ("mismatch/max_abs",
                                                                                         "mismatch/mean_abs")),
                                      ("mismatch KL (k3)", "nats", ("mismatch/kl_k3",)),
                                      ("largest ratio", "ratio", ("mismatch/ratio_max",))]),
    ("memory", [("peak memory", "MiB", ("memory/",)),
                ("training state LoRA does not keep (by formula)", "GiB", ("lora/saved_train_state_gib",)),
                ("LoRA: trained and frozen parameters", "parameters", ("lora/trainable_params",
                                                                       "lora/frozen_params"))]),
]
EVAL_PANELS = [("held-out accuracy", "fraction solved (greedy held-out; sampled training)", ("accuracy",)),
               ("held-out reward", "reward", ("reward",)),
               ("held-out completion length", "tokens", ("completion_len",)),
               ("truncated held-out completions", "fraction", ("truncated_frac",))]
EVAL_LABELS = {"accuracy": "held-out accuracy, greedy", "reward": "held-out reward, greedy",
               "completion_len": "held-out completion length", "truncated_frac": "held-out truncated fraction"}
LABELS = {"accuracy": "training accuracy, sampled", "dev/accuracy": "greedy accuracy on training problems"}
"""Legend names of training-stage keys that would be ambiguous next to the held-out ones."""
_FRACTIONS = ("fraction correct", "fraction solved")


def _matches(key: str, pattern: str) -> bool:
    if pattern.endswith(("/", "_")):
        return key.startswith(pattern)
    return key == pattern


def _runs(run_dir: Path) -> list[Path]:
    found = [p.parent for pat in ("metrics.jsonl", "*/metrics.jsonl", "*/*/metrics.jsonl")
             for p in sorted(run_dir.glob(pat))]
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


def _magnitude(ys: list[float]) -> float:
    return max((abs(y) for y in ys), default=0.0)


def _split_by_scale(keys: list[str], series: dict) -> list[list[str]]:
    """Keys grouped so that magnitudes within a group differ by at most SCALE_RATIO (all-zero
    lines join the first group)."""
    mags = sorted(((_magnitude(series[k][1]), k) for k in keys), reverse=True)
    groups: list[list[str]] = []
    top = 0.0
    for m, k in mags:
        if groups and (m == 0 or top / m <= SCALE_RATIO):
            groups[-1].append(k)
        else:
            groups.append([k])
            top = m
    return groups


def _panels(series: dict, panels) -> list[tuple[str, str, list[str]]]:
    """(title, y label, keys) per axis: panels of `panels` that have data, split by scale."""
    out, claimed = [], set()
    for title, ylabel, patterns in panels:
        keys = [k for k in series if k not in claimed and any(_matches(k, p) for p in patterns)]
        claimed.update(keys)
        for i, part in enumerate(_split_by_scale(keys, series) if keys else []):
            out.append((title if i == 0 else f"{title}: smaller values", ylabel, part))
    return out


SPARSE = 8
"""A series with fewer points is drawn as markers without a connecting line."""


def _figure(series: dict, axes: list[tuple[str, str, list[str]]], xlabel: str, path: Path, labels: dict,
            extra: dict | None = None, markers: int = 12) -> None:
    """One PNG: a grid of panels (two columns). `extra` maps a panel title to further
    (label, xs, ys, style) lines drawn on it; lines of fewer than `markers` points mark
    each point, and of fewer than SPARSE points draw no line between them."""
    n = len(axes)
    cols = 1 if n == 1 else 2
    rows = -(-n // cols)
    fig = Figure(figsize=(4.6 * cols, 2.9 * rows), dpi=90)
    grid = fig.subplots(rows, cols, squeeze=False)
    for ax, (title, ylabel, keys) in zip(grid.flat, axes):
        for k in keys:
            xs, ys = series[k]
            ax.plot(xs, ys, label=labels.get(k, k), marker="o" if len(xs) < markers else None, markersize=4,
                    linestyle="none" if len(xs) < SPARSE else "-")
        for label, xs, ys, style in (extra or {}).get(title, []):
            ax.plot(xs, ys, label=label, **style)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no "2.25" ticks on short runs
        if ylabel in _FRACTIONS:
            ax.set_ylim(-0.03, 1.03)
        else:
            _sensible_ylim(ax, [y for k in keys for y in series[k][1]]
                           + [y for _, _, ys, _ in (extra or {}).get(title, []) for y in ys], ylabel)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        if ax.get_yscale() == "linear":
            ax.ticklabel_format(axis="y", useOffset=False)  # "1e-7+1" offsets are hard to read
        ax.legend(fontsize=7)
    for ax in list(grid.flat)[n:]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path)


def _sensible_ylim(ax, ys: list[float], ylabel: str) -> None:
    """Widen an auto-scaled y axis to at least MIN_SPAN of its magnitude (centered on the
    data), and start amounts (FROM_ZERO units) at 0."""
    ys = [y for y in ys if math.isfinite(y)]
    if not ys:
        return
    lo, hi = min(ys), max(ys)
    if (ylabel in FROM_ZERO or ylabel.startswith("fraction")) and lo >= 0:
        ax.set_ylim(0, hi * 1.08 if hi > 0 else 1.0)
        return
    need = max(MIN_SPAN * max(abs(lo), abs(hi)), NOISE_SPAN)
    if hi - lo < need:
        mid = (lo + hi) / 2
        ax.set_ylim(mid - need / 2, mid + need / 2)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))


def _table(d: dict) -> str:
    cells = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{_fmt(v)}</td></tr>" for k, v in d.items())
    return f"<table>{cells}</table>"


def headline(rows: list[dict]) -> str | None:
    """One line with the run's result: held-out accuracy (else reward) first -> last
    evaluation, or the final training loss / reward when there was no evaluation."""
    evals = [r for r in rows if r.get("stage") == "eval"]
    key = next((k for k in ("accuracy", "reward") if any(isinstance(r.get(k), (int, float)) for r in evals)), None)
    if key is not None:
        pts = [r for r in evals if isinstance(r.get(key), (int, float))]
        first, last = pts[0], pts[-1]
        n = last.get("num_problems")
        on = f" on {int(n)} problems" if isinstance(n, (int, float)) else ""
        if len(pts) == 1:
            return f"held-out {key} {first[key]:.3f} at step {first['step']}{on}"
        return (f"held-out {key} {first[key]:.3f} &rarr; {last[key]:.3f} ({last[key] - first[key]:+.3f}) "
                f"from step {first['step']} to step {last['step']}{on}")
    train = [r for r in rows if r.get("stage") not in NOT_TRAINING]
    for k, what in (("reward/mean", "training reward"), ("loss", "training loss")):
        pts = [r for r in train if isinstance(r.get(k), (int, float))]
        if pts:
            return (f"{what} {pts[0][k]:.4g} &rarr; {pts[-1][k]:.4g} from step {pts[0]['step']} to step "
                    f"{pts[-1]['step']} (no held-out evaluation logged)")
    return None


def _data_section(row: dict) -> str:
    """The data checks of the run (its "data" row): rows kept, dropped and truncated by
    reason per split, with what each reason means."""
    stats = {k: v for k, v in row.items() if k not in ("step", "stage") and isinstance(v, (int, float))}
    lines = "".join(f"<li>{html.escape(line)}</li>" for line in data_lines(stats))
    reasons = dict.fromkeys(k.split("/", 1)[1] for k, v in stats.items() if k.count("/") == 2 and v)
    legend = "".join(f"<li><code>{html.escape(r.split('/', 1)[1])}</code> ({html.escape(r.split('/', 1)[0])}): "
                     f"{html.escape(DATA_REASONS.get(r, ''))}</li>" for r in reasons)
    return (f"<h3>data (checked before training)</h3><ul>{lines}</ul>"
            + (f"<details><summary>reasons</summary><ul>{legend}</ul></details>" if legend else ""))


def _temperature(run: Path) -> str | None:
    """The run's grpo.temperature as written in its config.yaml (None if it has none)."""
    cfg = run / "config.yaml"
    if not cfg.exists():
        return None
    try:
        t = (yaml.safe_load(cfg.read_text()) or {}).get("grpo", {}).get("temperature")
    except yaml.YAMLError:
        return None
    return f"{t:g}" if isinstance(t, (int, float)) else None


def _demo(run_dir: Path) -> dict:
    """The demo's summary (demo.json at RUN_DIR), if this is a demo folder."""
    try:
        return json.loads((run_dir / "demo.json").read_text())
    except (OSError, ValueError):
        return {}


def _section(run: Path, name: str, rows: list[dict], out: Path, baseline: float | None = None) -> list[str]:
    parts = [f"<h2>{html.escape(name)}</h2>"]
    if line := headline(rows):
        parts.append(f"<p class='headline'>{line}</p>")
    stem = name.replace("/", "_").strip(".") or "run"
    stages = [s for s in dict.fromkeys(r.get("stage", "train") for r in rows) if s not in NOT_TRAINING]
    evals = [r for r in rows if r.get("stage") == "eval"]
    data = [r for r in rows if r.get("stage") == DATA_STAGE]
    if data:
        parts.append(_data_section(data[-1]))
    if evals:
        parts.append("<h3>held-out evaluation (greedy completions of the held-out prompts)</h3>")
        ev = _series(rows, "eval")
        axes = _panels(ev, EVAL_PANELS)
        # the training accuracy beside the held-out one: same unit, sampled rather than greedy
        train_acc = {s: _series(rows, s).get("accuracy") for s in stages}
        t = _temperature(run)
        extra = {"held-out accuracy": [(f"training accuracy, sampled ({'T=' + t if t else 'T of the run'}, {s})",
                                        *xy, dict(alpha=0.45, linewidth=1)) for s, xy in train_acc.items() if xy]}
        if baseline is not None and ev.get("accuracy"):
            xs = ev["accuracy"][0]
            extra["held-out accuracy"].append(("no-tool baseline, greedy (demo.json)", [xs[0], xs[-1]],
                                               [baseline, baseline], dict(linestyle="--", color="gray")))
        dev_acc = {s: _series(rows, s).get("dev/accuracy") for s in stages}
        extra["held-out accuracy"] += [(f"greedy accuracy on training problems ({s})", *xy,
                                        dict(alpha=0.6, linewidth=1, marker="s", markersize=3))
                                       for s, xy in dev_acc.items() if xy]
        if axes:
            png = out / f"{stem}_eval.png"
            _figure(ev, axes, "step", png, EVAL_LABELS, extra, markers=200)  # held-out points are few: mark each
            parts.append(f'<img src="{png.name}" alt="held-out evaluation">')
        keys = [k for k in evals[0] if k != "stage"]
        head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
        body = "".join("<tr>" + "".join(f"<td>{_fmt(r.get(k))}</td>" for k in keys) + "</tr>" for r in evals)
        parts.append(f"<table><tr>{head}</tr>{body}</table>")
    for stage in stages:
        series = _series(rows, stage)
        xlabel = f"{stage} step"
        # no doubled names: the run folder "grpo" (or "demo/grpo") of stage grpo -> grpo_*.png
        prefix = stem if stem == stage or stem.endswith(f"_{stage}") else f"{stem}_{stage}"
        for gname, panels in GROUPS:
            axes = _panels(series, panels)
            if not axes:
                continue
            png = out / f"{prefix}_{gname.replace(' ', '_')}.png"
            _figure(series, axes, xlabel, png, LABELS)
            parts.append(f"<h3>{html.escape(stage)}: {html.escape(gname)}</h3><img src='{png.name}' "
                         f"alt='{html.escape(gname)}'>")
        known = {k for _, panels in GROUPS for _, _, pats in panels for k in series if any(_matches(k, p) for p in pats)}
        others = [k for k in series if k not in known]
        if others:  # metrics no group knows: one panel each, so nothing logged goes unseen
            png = out / f"{prefix}_other.png"
            _figure(series, [(k, "value", [k]) for k in others], xlabel, png, {})
            parts.append(f"<h3>{html.escape(stage)}: other metrics</h3><img src='{png.name}' alt='other metrics'>")
        last = [r for r in rows if r.get("stage") == stage][-1]
        parts.append(f"<details><summary>{html.escape(stage)}: values at the last logged step ({last['step']})"
                     f"</summary>{_table({k: v for k, v in last.items() if k != 'stage'})}</details>")
    samples = read_jsonl(run / "samples.jsonl")[-6:]
    if samples:
        items = "".join(f"<li><b>step {s.get('step')}, reward {_fmt(s.get('reward'))}</b><pre>"
                        f"{html.escape(str(s.get('prompt', '')))}<b>{html.escape(str(s.get('completion', '')))}</b>"
                        f"</pre></li>" for s in samples)
        parts.append(f"<h3>latest sample completions (training)</h3><ul>{items}</ul>")
    cfg = run / "config.yaml"
    if cfg.exists():
        parts.append(f"<details><summary>config.yaml</summary><pre>{html.escape(cfg.read_text())}</pre></details>")
    return parts


def _order(item: tuple[Path, list[dict]]) -> tuple:
    # pipeline order: a folder that ran SFT before one that ran RL, then by name
    return ("sft" not in {r.get("stage") for r in item[1]}, item[0].as_posix())


def render(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    runs = _runs(run_dir)
    if not runs:
        raise ValueError(f"{run_dir}: no metrics.jsonl here or in its subfolders (is this a run folder?)")
    loaded = sorted(((run, read_jsonl(run / "metrics.jsonl")) for run in runs), key=_order)
    out = make_folder(run_dir / "report", "rlfuse report", "a folder for the plots")
    for old in out.glob("*.png"):  # plots of an earlier rendering (groups may have changed)
        old.unlink()
    names = [run.relative_to(run_dir).as_posix() if run != run_dir else "." for run, _ in loaded]
    heads = [(name, headline(rows)) for name, (_, rows) in zip(names, loaded)]
    summary = "".join(f"<li><b>{html.escape(n)}</b>: {h}</li>" for n, h in heads if h)
    parts = [f"<h1>rlfuse run {html.escape(str(run_dir))}</h1>"]
    demo = _demo(run_dir)
    if demo:  # the demo's own comparison first: before / after, and the agent demo's no-tool baseline
        nums = {k: v for k, v in demo.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        parts.append(f"<div class='summary'><h2>demo (demo.json)</h2>{_table(nums)}</div>")
    if summary:
        parts.append(f"<div class='summary'><h2>result</h2><ul>{summary}</ul></div>")
    baseline = demo.get("accuracy_no_tool")
    for name, (run, rows) in zip(names, loaded):
        if rows:
            parts += _section(run, name, rows, out, baseline if "grpo" in name else None)
        else:
            parts.append(f"<h2>{html.escape(name)}</h2><p>metrics.jsonl has no rows yet.</p>")
    style = ("body{font-family:sans-serif;max-width:1000px;margin:auto}table{border-collapse:collapse;margin:6px 0}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}img{max-width:100%}"
             "pre{white-space:pre-wrap}.summary{background:#f3f6fa;padding:4px 14px;border-radius:6px}"
             ".headline{font-size:17px}")
    index = out / "index.html"
    index.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>rlfuse report</title>"
                     f"<style>{style}</style></head><body>{''.join(parts)}</body></html>")
    return index
