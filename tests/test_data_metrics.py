"""The data checks' counts as run metrics: a tiny SFT and GRPO run on a data file with an
empty prompt and an over-long prompt write rows kept / dropped by reason once, at step 0
(metrics.jsonl, TensorBoard), a resumed run keeps that row and writes no second one, and
the report and the commands' summaries show them.
    python -m pytest -q tests/test_data_metrics.py
"""

import json

from tiny_sampler import TinySampler
from train_setup import tiny_cfg

from rlfuse.cli.common import print_summary
from rlfuse.data.preference import build_preference_pairs
from rlfuse.data.prompts import build_sft_examples
from rlfuse.data.rows import load_rows
from rlfuse.run.build import char_tokenizer
from rlfuse.run.config.algorithms import DPOConfig
from rlfuse.run.config.sections import DataConfig
from rlfuse.run.metrics import DATA_REASONS, data_lines
from rlfuse.run.report import render
from rlfuse.train.grpo import run_grpo
from rlfuse.train.session import open_session
from rlfuse.train.sft import run_sft

ALPHA = "0123456789+-= "
MAX_PROMPT = 12


def _data(tmp):
    train = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (0, 7), (4, 4)]]
    train.insert(2, {"prompt": "   ", "answer": "1"})                 # empty
    train.insert(5, {"prompt": "1+" * 20 + "1=", "answer": "21"})     # 41 tokens > MAX_PROMPT
    ev = [{"prompt": "2+3=", "answer": "5"}, {"prompt": "9" * 30 + "=", "answer": "9"},
          {"prompt": "1+1=", "answer": "2"}]
    paths = []
    for name, rows in (("train.jsonl", train), ("eval.jsonl", ev)):
        (tmp / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(tmp / name))
    return paths


def _cfg(tmp, run, *over, tb=False):
    train, ev = _data(tmp)
    return tiny_cfg(tmp / run, f"data.train={train}", f"data.eval={ev}", f"data.max_prompt_len={MAX_PROMPT}",
                    "rewards=[{name: arithmetic}]", f"logging.tensorboard={str(tb).lower()}", *over)


def _session(cfg, need_target=False):
    ses = open_session(cfg, tokenizer=char_tokenizer(ALPHA), need_target=need_target)
    ses._sampler = TinySampler(ses.model, ses.tokenizer)
    return ses


def _data_rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(x)["stage"] == "data"]


EXPECTED = {"train/rows": 8.0, "train/kept": 6.0, "train/dropped/empty_prompt": 1.0,
            "train/dropped/prompt_too_long": 1.0, "eval/rows": 3.0, "eval/kept": 2.0,
            "eval/dropped/prompt_too_long": 1.0}


def test_sft_run_writes_the_counts_once_to_metrics_tensorboard_and_report(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # test-only reader

    cfg = _cfg(tmp_path, "sft", "sft.steps=2", tb=True)
    res = run_sft(cfg, session=_session(cfg, need_target=True))
    (row,) = _data_rows(tmp_path / "sft")
    assert row == {"step": 0, "stage": "data", **EXPECTED}
    assert res["data"] == {k: int(v) for k, v in EXPECTED.items()}
    acc = EventAccumulator(str(tmp_path / "sft" / "tb")).Reload()
    assert {f"data/{k}" for k in EXPECTED} <= set(acc.Tags()["scalars"])
    assert acc.Scalars("data/train/dropped/empty_prompt")[0].value == 1.0
    index = render(tmp_path / "sft").read_text()
    assert "data (checked before training)" in index
    assert "train: 6 of 8 rows kept; dropped: 1 empty_prompt, 1 prompt_too_long" in index
    assert "eval: 2 of 3 rows kept; dropped: 1 prompt_too_long" in index
    assert DATA_REASONS["dropped/empty_prompt"] in index
    print_summary("sft", res)
    out = capsys.readouterr().out
    assert "data train: 6 of 8 rows kept; dropped: 1 empty_prompt, 1 prompt_too_long\n" in out


def test_grpo_resume_keeps_the_one_data_row(tmp_path):
    full = _cfg(tmp_path, "full", "checkpoint.every=1", "grpo.steps=3")
    run_grpo(full, session=_session(full))
    part = _cfg(tmp_path, "part", "checkpoint.every=1", "grpo.steps=3")
    run_grpo(part, session=_session(part), stop_after=1)
    resumed = _cfg(tmp_path, "part", "checkpoint.every=1", "grpo.steps=3", "checkpoint.resume=auto")
    res = run_grpo(resumed, session=_session(resumed))
    assert res["steps"] == 3
    for run in ("full", "part"):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert [(r["stage"], r["step"]) for r in rows][:2] == [("data", 0), ("eval", 0)]
        assert _data_rows(tmp_path / run) == [{"step": 0, "stage": "data", **EXPECTED}]
    assert "train: 6 of 8 rows kept" in render(tmp_path / "part").read_text()


def test_sft_truncation_and_preference_drops_have_stable_slugs(tmp_path):
    tok = char_tokenizer(ALPHA)
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "1+1=", "completion": "2", "chosen": "2", "rejected": "3"},
        {"prompt": "2+2=", "completion": "4" * 30, "chosen": "4", "rejected": "4"},
        {"prompt": "", "completion": "1", "chosen": "1", "rejected": "0"}]))
    cfg = DataConfig(train=str(p), max_prompt_len=8)
    for overlong, key in (("truncate", "truncated"), ("drop", "dropped")):
        stats = {}
        build_sft_examples(load_rows(cfg, need_target=True), tok, cfg, 16, overlong=overlong, stats=stats)
        assert stats == {"train/rows": 3, "train/kept": 2 if overlong == "truncate" else 1,
                         "train/dropped/empty_prompt": 1, f"train/{key}/sft_too_long": 1}
    stats = {}
    build_preference_pairs(load_rows(cfg), tok, cfg, DPOConfig(), stats=stats, split="eval_pairs")
    assert stats == {"eval_pairs/rows": 3, "eval_pairs/kept": 1, "eval_pairs/dropped/dpo_same_responses": 1,
                     "eval_pairs/dropped/empty_prompt": 1}
    assert data_lines(stats) == ["eval_pairs: 1 of 3 rows kept; dropped: 1 dpo_same_responses, 1 empty_prompt"]
    assert all(k.split("/")[0] in ("dropped", "truncated") for k in DATA_REASONS)
