"""`rlfuse report`: the headline leads, the held-out evaluation is plotted under its own
name, every axis has a unit, lines of different scale get separate axes, a torn last
metrics line does not stop it. Rendered from synthetic metrics (no training)."""

import json
import re

import pytest

from rlfuse.run import report


def _write(run, rows):
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _grpo_rows(steps=6):
    rows = [{"step": 0, "stage": "eval", "reward": 0.2, "accuracy": 0.25, "completion_len": 9.0, "num_problems": 40.0}]
    for s in range(1, steps + 1):
        rows.append({"step": s, "stage": "grpo", "reward/mean": 0.1 * s, "accuracy": 0.05 * s, "grad_norm": 2.0 + s,
                     "lr": 1e-6, "time/step": 3.0, "time/generate": 2.0, "time/score": 0.001, "loss": 0.01,
                     "my_metric": float(s)})
    rows.append({"step": steps, "stage": "eval", "reward": 0.6, "accuracy": 0.625, "completion_len": 7.0,
                 "num_problems": 40.0})
    return rows


def test_headline_leads_and_eval_is_plotted(tmp_path):
    _write(tmp_path / "sft", [{"step": s, "stage": "sft", "loss": 2.0 / s} for s in (1, 2, 3)]
           + [{"step": 3, "stage": "eval", "accuracy": 0.25, "reward": 0.2, "num_problems": 40.0}])
    _write(tmp_path / "grpo", _grpo_rows())
    page = report.render(tmp_path).read_text()
    first_img = page.index("<img")
    head = page[:first_img]
    # pipeline order (sft before grpo, not alphabetical) and the result before any plot
    assert head.index("<b>sft</b>: held-out accuracy 0.250 at step 3 on 40 problems") < \
        head.index("<b>grpo</b>: held-out accuracy 0.250 &rarr; 0.625 (+0.375) from step 0 to step 6 on 40 problems")
    assert (tmp_path / "report/grpo_eval.png").exists() and (tmp_path / "report/sft_eval.png").exists()
    assert "grpo_other.png" in page  # a metric no group knows is still plotted
    # no doubled titles: headings never repeat a word ("grpo grpo"), and a figure's panels
    # are not titled like the heading above them
    headings = re.findall(r"<h\d>([^<]*)</h\d>", page)
    assert headings and not [h for h in headings if re.search(r"\b(\w+) \1\b", h)]
    for gname, panels in report.GROUPS:
        assert gname not in [title for title, _, _ in panels]


def test_panels_have_units_distinct_names_and_split_scales():
    rows = _grpo_rows()
    series = report._series(rows, "grpo")
    axes = [a for _, panels in report.GROUPS for a in report._panels(series, panels)]
    assert all(ylabel for _, ylabel, _ in axes)
    by_key = {k: (title, ylabel) for title, ylabel, keys in axes for k in keys}
    assert by_key["lr"][0] != by_key["grad_norm"][0]                 # different units: different axes
    assert by_key["time/score"][0] != by_key["time/step"][0]         # same unit, 3000x smaller: own axis
    assert by_key["time/generate"][0] == by_key["time/step"][0]      # same unit and scale: shared
    assert report.LABELS["accuracy"] == "training accuracy, sampled"
    assert report.EVAL_LABELS["accuracy"] == "held-out accuracy, greedy"
    every_title = [t for t, _, _ in axes] + [t for t, _, _ in report.EVAL_PANELS]
    assert "held-out accuracy" in every_title and "training accuracy, sampled" in every_title


def test_headline_without_evaluation_uses_the_training_curve():
    rows = [{"step": s, "stage": "sft", "loss": 2.0 / s} for s in (1, 2, 4)]
    assert report.headline(rows) == "training loss 2 &rarr; 0.5 from step 1 to step 4 (no held-out evaluation logged)"
    assert report.headline([]) is None


def test_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, caplog):
    _write(tmp_path, _grpo_rows())
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "stage": "grpo", "reward/me')
    assert report.render(tmp_path).exists()
    assert "metrics.jsonl:9: dropping a torn last line" in caplog.text


def test_not_a_run_folder(tmp_path):
    with pytest.raises(ValueError, match="no metrics.jsonl here or in its subfolders"):
        report.render(tmp_path)


def test_every_metric_the_trainers_log_has_a_panel_with_a_unit(tmp_path):
    """One short run of each trainer (SFT, GRPO with a KL reference, PPO, DPO): every key
    they log lands in a known panel (none in "other metrics", whose y label is "value")."""
    from train_setup import one_thread, tiny_cfg, tiny_session

    from rlfuse.run.metrics import NOT_TRAINING, read_metrics
    from rlfuse.train.dpo import run_dpo
    from rlfuse.train.grpo import run_grpo
    from rlfuse.train.ppo import run_ppo
    from rlfuse.train.sft import run_sft

    small = ("sft.steps=2", "grpo.steps=2", "grpo.kl_coef=0.1", "ppo.steps=2", "ppo.prompts_per_step=4",
             "ppo.samples_per_prompt=2", "ppo.max_new_tokens=3", "ppo.kl_coef=0.1", "dpo.steps=2",
             "dpo.batch_size=6")
    runs = {"sft": (run_sft, {}), "grpo": (run_grpo, {}), "ppo": (run_ppo, {}),
            "dpo": (run_dpo, {"data": {"train": "builtin:arithmetic_pref", "train_size": 40}})}
    with one_thread():
        for name, (run, sections) in runs.items():
            cfg = tiny_cfg(tmp_path / name, *small, **sections)
            run(cfg, session=tiny_session(cfg, need_target=name == "sft"))
    for name in runs:
        rows = [r for r in read_metrics(tmp_path / name) if r["stage"] not in NOT_TRAINING]
        keys = {k for r in rows for k in r} - {"step", "stage"}
        unclaimed = [k for k in keys if not any(report._matches(k, p) for _, panels in report.GROUPS
                                                for _, _, pats in panels for p in pats)]
        assert not unclaimed, f"{name}: metrics no report panel knows: {unclaimed}"
    page = report.render(tmp_path).read_text()
    assert "other metrics" not in page and not list((tmp_path / "report").glob("*_other.png"))


@pytest.mark.parametrize("ys,ylabel,lo,hi", [
    ([2.5, 2.5, 2.5], "loss", 2.25, 2.75),                      # constant: +-10%, not +-0.04
    ([0.99999994, 1.0, 1.0], "ratio", 0.9, 1.1),                # rounding noise around 1
    ([-4e-8, 3e-8], "loss", -5.05e-7, 4.95e-7),                 # float32 noise around 0: NOISE_SPAN
    ([376.0, 400.0], "MiB", 0.0, 432.0),                        # an amount: from 0, not a "leak"
    ([0.0, 0.0], "fraction of tokens", 0.0, 1.0),               # an all-zero fraction
    ([0.2, 0.9], "reward", None, None),                          # a real trend: matplotlib's own limits
])
def test_axes_do_not_make_noise_look_like_a_trend(ys, ylabel, lo, hi):
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    ax.plot(range(len(ys)), ys)
    auto = ax.get_ylim()
    report._sensible_ylim(ax, ys, ylabel)
    got = ax.get_ylim()
    if lo is None:
        assert got == auto
    else:
        assert got == pytest.approx((lo, hi), rel=1e-6, abs=1e-12)


def test_no_doubled_file_names(tmp_path):
    _write(tmp_path / "demo" / "grpo", _grpo_rows())
    report.render(tmp_path)
    names = sorted(p.name for p in (tmp_path / "report").glob("*.png"))
    assert names and all(n.startswith("demo_grpo_") and "grpo_grpo" not in n for n in names), names


def test_sft_evaluates_at_step_zero(tmp_path):
    from train_setup import tiny_cfg, tiny_session

    from rlfuse.train import run_sft

    cfg = tiny_cfg(tmp_path, "sft.steps=2")
    res = run_sft(cfg, session=tiny_session(cfg, need_target=True))
    assert [e["step"] for e in res["evals"]] == [0, 2]


def test_sparse_held_out_points_labels_and_the_demos_baseline(tmp_path, monkeypatch):
    """Issue 37 #11: two held-out evaluations are two markers, not a line through steps
    nobody measured; the legend says greedy held-out vs sampled (T) training accuracy; a
    demo folder's demo.json heads the page and its no-tool baseline is on the accuracy panel."""
    import json

    _write(tmp_path / "grpo", _grpo_rows())
    (tmp_path / "grpo" / "config.yaml").write_text("grpo:\n  temperature: 0.7\n")
    (tmp_path / "demo.json").write_text(json.dumps({"accuracy_sft": 0.25, "accuracy_grpo": 0.625,
                                                    "accuracy_no_tool": 0.1}))
    drawn = []
    real = report._figure

    def spy(series, axes, xlabel, path, labels, extra=None, markers=12):
        drawn.append((series, axes, labels, extra))
        return real(series, axes, xlabel, path, labels, extra, markers)
    monkeypatch.setattr(report, "_figure", spy)
    page = report.render(tmp_path).read_text()
    assert page.index("demo (demo.json)") < page.index("<img") and "accuracy_no_tool" in page
    series, axes, labels, extra = next(d for d in drawn if "accuracy" in d[0] and d[3])
    assert len(series["accuracy"][0]) < report.SPARSE and labels["accuracy"] == "held-out accuracy, greedy"
    names = [x[0] for x in extra["held-out accuracy"]]
    assert "training accuracy, sampled (T=0.7, grpo)" in names
    base = next(x for x in extra["held-out accuracy"] if x[0].startswith("no-tool baseline"))
    assert base[2] == [0.1, 0.1]
    # the figure code: a sparse series is drawn without a connecting line
    from matplotlib.figure import Figure

    lines = []
    monkeypatch.setattr(Figure, "savefig", lambda self, path: lines.extend(self.axes[0].get_lines()))
    real({"accuracy": ([0, 6], [0.25, 0.625])}, [("held-out accuracy", "fraction", ["accuracy"])], "step",
         tmp_path / "x.png", report.EVAL_LABELS)
    assert lines[0].get_linestyle() == "None" and lines[0].get_marker() == "o"
