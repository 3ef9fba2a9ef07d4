"""The bad-input corpus: each case feeds one bad input and asserts what the user sees.

Either an error naming the file, line or field and what was expected -- a ValueError (the
CLI prints those as one `rlfuse: error: ...` line, no traceback; a few cases run the CLI
itself) -- or, where the input is recoverable, that it is handled and reported (a
warning naming the file:line / checkpoint). Groups: data, rewards, model config.json,
kernels, checkpoints and the filesystem, metrics and report, non-finite numbers.

Each case is marked `@pytest.mark.bad_input(<category>)`, and its checks record what was fed
and what the user sees (tests/bad_input_catalog.py); docs/bad-inputs.md lists them all:
    python -m pytest -q tests/test_bad_inputs.py --bad-input-catalog docs/bad-inputs.md
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import re
import textwrap
from pathlib import Path

import bad_input_catalog as catalog
import pytest
import torch
import yaml

from rlfuse.cli.common import fail
from rlfuse.data.preference import build_preference_pairs
from rlfuse.data.prompts import build_prompts, build_sft_examples
from rlfuse.data.rows import load_rows
from rlfuse.kernels.attention.varlen import supports_head_dim as triton_attention_supports
from rlfuse.model import CausalLM, ModelConfig
from rlfuse.model.config import check_kernel_support
from rlfuse.model.weights import load_model as load_model_folder
from rlfuse.rollout.rewards import RewardSet
from rlfuse.run import checkpoint as ck
from rlfuse.run import metrics as mt
from rlfuse.run import resume as rs
from rlfuse.run.build import char_tokenizer
from rlfuse.run.config.algorithms import DPOConfig
from rlfuse.run.config.sections import DataConfig, RewardSpec
from rlfuse.run.optim import MasterAdamW, NonFiniteError, NonFiniteGuard
from rlfuse.run.report import render

ALPHA = "abcdefghijklmnopqrstuvwxyz0123456789 +-*=?.:"


def expect_error(fn, pattern: str, fed: str):
    """fn() raises a ValueError (one clean CLI line) whose message matches `pattern`; records
    the `rlfuse: error:` text the CLI prints for it (through the CLI's own `fail`)."""
    with pytest.raises(ValueError, match=pattern) as info:
        fn()
    assert "Traceback" not in str(info.value)
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert fail(info.value) == 2
    catalog.seen(fed, err.getvalue())
    return info.value


def expect_reported(caplog, text: str, fed: str, count: int | None = None) -> list[str]:
    """A handled input: log records containing `text` (`count` of them, if given) report it;
    records them as the CLI shows them (LEVEL logger: message) and returns them."""
    lines = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in caplog.records if text in r.getMessage()]
    assert lines if count is None else len(lines) == count, (text, caplog.text)
    for line in lines:
        catalog.seen(fed, line)
    return lines


def _short(content, limit: int = 70) -> str:
    """File content as fed, shown in the catalog."""
    r = repr(content)
    return r if len(r) <= limit else r[:limit - 3] + "..."


# ------------------------------------------------------------------ data files
def _file(tmp, name, content):
    p = tmp / name
    if isinstance(content, bytes):
        p.write_bytes(content)
    elif content is None:
        p.mkdir()
    else:
        p.write_text(content)
    return p


DATA_FILE_CASES = [
    # (id, file name, content (None = a folder), need_target, expected message)
    ("missing-file", "absent.jsonl", "SKIP", False, r"absent\.jsonl: no such data file"),
    ("folder", "d.jsonl", None, False, r"d\.jsonl: is a folder; expected a \.jsonl, \.json or \.parquet file"),
    ("empty-file", "d.jsonl", "", False, r"d\.jsonl: the data file is empty \(expected rows\)"),
    ("blank-lines-only", "d.jsonl", "\n \n\n", False, r"d\.jsonl: the data file is empty"),
    ("empty-json-list", "d.json", "[]", False, r"d\.json: no rows in the data file \(expected at least one row "
                                                  r"object\)"),
    ("latin1-bytes-jsonl", "d.jsonl", b'{"prompt": "a"}\n{"prompt": "\xe9t\xe9"}\n', False,
     r"d\.jsonl:2: not valid UTF-8 \(byte 0xe9 at offset \d+\); save the file as UTF-8"),
    ("latin1-bytes-json", "d.json", b'[\n{"prompt": "a"},\n{"prompt": "\xff"}]', False,
     r"d\.json:3: not valid UTF-8 \(byte 0xff"),
    ("bad-json-line", "d.jsonl", '{"prompt": "a"}\n{"prompt": "b",}\n', False, r"d\.jsonl:2: not valid JSON"),
    ("bad-json-file", "d.json", '[{"prompt": "a"},\n{"prompt" "b"}]', False, r"d\.json:2: not valid JSON"),
    ("json-object-without-data", "d.json", '{"rows": []}', False,
     r"d\.json: expected a list of rows \(or an object with a 'data' list\)"),
    ("row-not-object", "d.jsonl", '{"prompt": "a"}\n[1, 2]\n', False, r"d\.jsonl:2: expected an object \(a row of "
                                                                       r"fields\), got list"),
    ("missing-prompt-field", "d.jsonl", '{"question": "a"}\n', False,
     r"d\.jsonl:1: missing field 'prompt' \(or 'messages'\); the row has fields \['question'\]"),
    ("prompt-not-string", "d.jsonl", '{"prompt": 3}\n', False, r"d\.jsonl:1: field 'prompt' must be a string, got int"),
    ("answer-a-list", "d.jsonl", '{"prompt": "a", "answer": [1]}\n', False,
     r"d\.jsonl:1: field 'answer' must be a string or a number, got list"),
    ("messages-malformed", "d.jsonl", '{"messages": [{"role": "user"}]}\n', False,
     r"d\.jsonl:1: field messages\[0\] must be an object with string 'role' and 'content'"),
    ("messages-unknown-role", "d.jsonl", '{"messages": [{"role": "human", "content": "x"}]}\n', False,
     r"d\.jsonl:1: field messages\[0\]\.role is 'human'; expected one of system, user, assistant, tool"),
    ("nan-in-a-field", "d.jsonl", '{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": NaN}\n', False,
     r"d\.jsonl:2: field 'answer' is NaN, which is not a JSON number; expected a finite number \(or null"),
    ("infinity-nested-json", "d.json", '[{"prompt": "a", "meta": {"w": [1, -Infinity]}}]', False,
     r"d\.json: row 0: field 'meta\.w\[1\]' is -Infinity, which is not a JSON number"),
    ("messages-empty", "d.jsonl", '{"messages": []}\n', False,
     r"d\.jsonl:1: field 'messages' must be a non-empty list of messages"),
    ("sft-no-completion", "d.jsonl", '{"prompt": "a"}\n', True,
     r"d\.jsonl:1: missing field 'completion' \(the SFT target; 'answer' is used when it is absent\)"),
    ("sft-chat-no-assistant", "d.jsonl", '{"messages": [{"role": "user", "content": "x"}]}\n', True,
     r"d\.jsonl:1: field 'messages' has no assistant message to train on"),
    ("csv-file", "d.csv", "prompt\nx\n", False,
     r"d\.csv: unsupported data file type '\.csv' \(expected \.jsonl, \.json or \.parquet\)"),
    ("garbage-parquet", "d.parquet", b"not parquet at all", False,
     r"d\.parquet: (not a readable Parquet file|reading Parquet needs pyarrow)"),
]


@pytest.mark.bad_input("data")
@pytest.mark.parametrize("name,content,need_target,msg", [c[1:] for c in DATA_FILE_CASES],
                         ids=[c[0] for c in DATA_FILE_CASES])
def test_bad_data_file(tmp_path, name, content, need_target, msg):
    p = tmp_path / name if content == "SKIP" else _file(tmp_path, name, content)
    what = "no such file" if content == "SKIP" else "a folder" if content is None else _short(content)
    expect_error(lambda: load_rows(DataConfig(train=str(p)), need_target=need_target), msg,
                 f"{'SFT ' if need_target else ''}data.train: {p}: {what}")


@pytest.mark.bad_input("data")
def test_no_train_data_given():
    expect_error(lambda: load_rows(DataConfig()), r"data\.train is empty: give a \.jsonl/\.json/\.parquet file, "
                                                  r"builtin:<task>, hf:NAME or a save_to_disk folder", "no data.train")


@pytest.fixture
def tok():
    return char_tokenizer(ALPHA)


def _rows(tmp, rows):
    p = tmp / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


# handled and reported: (id, rows, build kwargs, {reason: count}, text in the warning)
DROP_CASES = [
    ("empty-prompt", [{"prompt": "1+1="}, {"prompt": "  "}], {}, {"empty": 1}, "1 empty (e.g. {p}:2)"),
    ("over-max-prompt-len", [{"prompt": "1+1="}, {"prompt": "9" * 30}], {},
     {"longer than data.max_prompt_len=20 tokens": 1}, "{p}:2 (30 tokens)"),
    ("would-fill-the-context", [{"prompt": "1+1="}, {"prompt": "9" * 24}], {"context_len": 24},
     {"longer than data.max_prompt_len=20 tokens": 1}, "{p}:2 (24 tokens)"),
]


@pytest.mark.bad_input("data")
@pytest.mark.parametrize("rows,kw,counts,text", [c[1:] for c in DROP_CASES], ids=[c[0] for c in DROP_CASES])
def test_prompts_dropped_counted_and_reported(tmp_path, tok, caplog, rows, kw, counts, text):
    p = _rows(tmp_path, rows)
    cfg = DataConfig(train=str(p), max_prompt_len=20)
    got = {}
    with caplog.at_level(logging.WARNING):
        prompts = build_prompts(load_rows(cfg), tok, cfg, counts=got, **kw)
    assert len(prompts) == 1 and got == counts
    fed = f"{p}: rows {json.dumps(rows)}, data.max_prompt_len=20" + (f", context {kw['context_len']} tokens"
                                                                    if kw else "")
    expect_reported(caplog, text.format(p=p), fed, count=1)


@pytest.mark.bad_input("data")
def test_rows_the_tokenizer_cannot_represent_are_counted_and_warned(tmp_path, tok, caplog):
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "3×4=", "completion": "12"},
            {"prompt": "5+5=", "completion": "10"}, {"prompt": "2+2=", "completion": "4"}]
    p = _rows(tmp_path, rows)
    cfg = DataConfig(train=str(p), max_prompt_len=20)
    stats = {}
    with caplog.at_level(logging.WARNING):
        prompts = build_prompts(load_rows(cfg), tok, cfg, stats=stats)
    assert len(prompts) == 4 and stats["train/kept/unknown_tokens"] == 1
    expect_reported(caplog, f"1 of 4 rows hold text the tokenizer cannot represent (encoded as <unk>), e.g. {p}:2; "
                            "characters: '×'", f"{p}: 4 rows, one with '×' outside the character tokenizer", count=1)
    assert mt.data_lines(stats) == ["train: 4 of 4 rows kept; 1 with unknown tokens"]


@pytest.mark.bad_input("data")
def test_most_rows_unrepresentable_is_an_error(tmp_path, tok):
    rows = [{"prompt": "Ünïcode?", "completion": "é"}, {"prompt": "3×4=", "completion": "12"},
            {"prompt": "1+1=", "completion": "2"}]
    p = _rows(tmp_path, rows)
    cfg = DataConfig(train=str(p), max_prompt_len=20)
    expect_error(lambda: build_sft_examples(load_rows(cfg, need_target=True), tok, cfg, 32),
                 rf"sft data train: 2 of 3 rows hold text the tokenizer cannot represent \(encoded as <unk>\), e\.g\. "
                 rf"{re.escape(str(p))}:1; characters: 'Ü' 'ï' 'é' '×'; the model would learn from <unk> tokens",
                 f"SFT data {p}: 2 of 3 rows with characters outside the character tokenizer")


@pytest.mark.bad_input("data")
def test_every_prompt_dropped_is_an_error(tmp_path, tok):
    rows = [{"prompt": ""}, {"prompt": "9" * 30}]
    p = _rows(tmp_path, rows)
    cfg = DataConfig(train=str(p), max_prompt_len=20)
    expect_error(lambda: build_prompts(load_rows(cfg), tok, cfg, "eval"),
                 r"data eval: no prompts left of 2 rows after the checks above \(1 empty, 1 longer than "
                 r"data\.max_prompt_len=20 tokens\)", f"eval data {p}: rows {json.dumps(rows)}, "
                                                       f"data.max_prompt_len=20")


@pytest.mark.bad_input("data")
def test_max_prompt_len_over_the_context(tmp_path, tok):
    p = _rows(tmp_path, [{"prompt": "1+1=", "completion": "2"}])
    cfg = DataConfig(train=str(p), max_prompt_len=512)
    msg = r"data\.max_prompt_len \(512\) does not fit in the model context \(64 tokens.*expected at most 63"
    expect_error(lambda: build_prompts(load_rows(cfg), tok, cfg, context_len=64), msg,
                 "data.max_prompt_len=512 with a 64-token model context (prompts for RL)")
    expect_error(lambda: build_sft_examples(load_rows(cfg, need_target=True), tok, cfg, 32, context_len=64), msg,
                 "data.max_prompt_len=512 with a 64-token model context (SFT examples)")


@pytest.mark.bad_input("data")
def test_prompt_template_with_an_unknown_field(tmp_path, tok):
    p = _rows(tmp_path, [{"prompt": "1+1="}])
    cfg = DataConfig(train=str(p), prompt_template="Q: {question}")
    expect_error(lambda: build_prompts(load_rows(cfg), tok, cfg),
                 r"d\.jsonl:1: data\.prompt_template 'Q: \{question\}' cannot be filled from the row's fields "
                 r"\['prompt'\]", 'data.prompt_template="Q: {question}" on rows {"prompt": ...}')


@pytest.mark.bad_input("data")
@pytest.mark.parametrize("overlong,counts", [("truncate", {"truncated to 16 tokens (sft.max_seq_len)": 1}),
                                             ("drop", {"dropped: longer than 16 tokens (sft.max_seq_len)": 1})],
                         ids=["truncate", "drop"])
def test_sft_sequence_over_the_limit_is_handled_and_counted(tmp_path, tok, caplog, overlong, counts):
    p = _rows(tmp_path, [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": "4" * 30}])
    cfg = DataConfig(train=str(p), max_prompt_len=8)
    got = {}
    ex = build_sft_examples(load_rows(cfg, need_target=True), tok, cfg, 16, overlong=overlong, counts=got)
    assert got == counts and len(ex) == (2 if overlong == "truncate" else 1)
    expect_reported(caplog, f"{p}:2 (35 tokens)", f"SFT row {p}:2 of 35 tokens, sft.max_seq_len=16, "
                                                  f"sft.overlong={overlong}", count=1)


# image rows: (id, row written to a .jsonl, data.max_prompt_len, error pattern); {p} is the file,
# {d} the folder holding the good image x.png (16 x 16: 4 image tokens with the test processor)
IMAGE_CASES = [
    ("missing-image", {"prompt": "<image>n?", "images": ["{d}/nope.png"]}, 20,
     r"{p}:1: field images\[0\]: no image file '{d}/nope.png'"),
    ("unreadable-image", {"prompt": "<image>n?", "images": ["{d}/bad.png"]}, 20,
     r"{p}:1: field images\[0\]: '{d}/bad.png' is not a readable image"),
    ("more-placeholders-than-images", {"prompt": "<image><image>n?", "images": ["{d}/x.png"]}, 20,
     r"{p}:1: field 'prompt' has 2 <image> placeholders but field 'images' has 1 images"),
    ("more-images-than-placeholders", {"messages": [{"role": "user", "content": [{"type": "image"}]}],
                                       "images": ["{d}/x.png", "{d}/x.png"]}, 20,
     r"{p}:1: field 'images' has 2 images but the row has 1 image parts"),
    ("image-too-large-for-the-context", {"prompt": "<image>n?", "images": ["{d}/x.png"]}, 3,
     r"{p}:1: field images\[0\]: the image \(16x16\) needs 4 tokens, more than data.max_prompt_len=3"),
]


@pytest.mark.bad_input("data")
@pytest.mark.parametrize("row,max_len,msg", [c[1:] for c in IMAGE_CASES], ids=[c[0] for c in IMAGE_CASES])
def test_bad_image_row(tmp_path, row, max_len, msg):
    from PIL import Image

    from rlfuse.data import IMAGE_TOKENS, ImageProcessor, VisionData
    Image.new("RGB", (16, 16), "red").save(tmp_path / "x.png")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    p = _rows(tmp_path, [json.loads(json.dumps(row).replace("{d}", str(tmp_path)))])
    tok = char_tokenizer(ALPHA, control=IMAGE_TOKENS)
    vision = VisionData.for_tokenizer(ImageProcessor(patch_size=4, merge_size=2, min_pixels=64, max_pixels=1024), tok)
    cfg = DataConfig(train=str(p), max_prompt_len=max_len)
    expect_error(lambda: build_prompts(load_rows(cfg), tok, cfg, vision=vision),
                 msg.format(p=re.escape(str(p)), d=re.escape(str(tmp_path))),
                 f"an image row: {_short(json.dumps(row))}")


@pytest.mark.bad_input("data")
def test_image_rows_for_a_text_model(tmp_path, tok):
    p = _rows(tmp_path, [{"prompt": "<image>n?", "images": ["x.png"]}])
    cfg = DataConfig(train=str(p))
    expect_error(lambda: build_prompts(load_rows(cfg), tok, cfg), rf"{re.escape(str(p))}:1: field images\[0\]: "
                 r"the row has images but the model has no vision tower", "an image row for a text-only model")


@pytest.mark.bad_input("data")
def test_image_preference_rows_for_a_text_model(tmp_path, tok):
    p = _rows(tmp_path, [{"prompt": "<image>n?", "images": ["x.png"], "chosen": "1", "rejected": "2"}])
    cfg = DataConfig(train=str(p))
    expect_error(lambda: build_preference_pairs(load_rows(cfg), tok, cfg, DPOConfig()),
                 rf"{re.escape(str(p))}:1: field images\[0\]: the row has images but the model has no vision tower",
                 "a DPO image row for a text-only model")


# ------------------------------------------------------------------ rewards
def _user_rewards(tmp):
    p = tmp / "myrewards.py"
    p.write_text(textwrap.dedent("""
        def boom(prompts, completions, **kw):
            return [1.0 / (len(c) - 1) for c in completions]
        def nan_on_b(prompts, completions, **kw):
            return [float("nan") if c == "b" else 1.0 for c in completions]
        def inf_on_b(prompts, completions, **kw):
            return [float("-inf") if c == "b" else 1.0 for c in completions]
        def short(prompts, completions, **kw):
            return [1.0]
        def words(prompts, completions, **kw):
            return ["good" for c in completions]
        def always_fails(prompts, completions, **kw):
            raise KeyError("answer")
        def strict(prompts, completions, scale=1.0):
            return [scale for c in completions]
    """))
    return p


REWARD_CASES = [
    # (id, spec names, kwargs, on_error, expected message)
    ("unknown-builtin", "acuracy", {}, "raise", r"reward 'acuracy': not a builtin \(math_accuracy, .*\) and not "
                                                r"module:function"),
    ("module-not-importable", "no_such_module_xyz:f", {}, "raise",
     r"reward 'no_such_module_xyz:f': cannot import module 'no_such_module_xyz'"),
    ("function-missing", "math:nope", {}, "raise", r"reward 'math:nope': module 'math' has no function 'nope'"),
    ("file-missing", "{tmp}/absent.py:f", {}, "raise", r"absent\.py:f': no such file .*absent\.py"),
    ("raises", "{user}:boom", {}, "raise", r"(?s)reward function 'boom' raised ZeroDivisionError: .*on example 1: "
                                           r"prompt='p1'.*completion='b'.*on_reward_error: zero"),
    ("returns-nan", "{user}:nan_on_b", {}, "raise",
     r"(?s)reward function 'nan_on_b' returned nan \(expected a finite number or None\).*on example 1"),
    ("returns-inf", "{user}:inf_on_b", {}, "raise", r"(?s)reward function 'inf_on_b' returned -inf .*on example 1"),
    ("wrong-length", "{user}:short", {}, "zero",
     r"reward function 'short' must return a list of 3 numbers \(one per completion\), got list of length 1"),
    ("non-number", "{user}:words", {}, "zero", r"reward function 'words' returned a non-number 'good' for example 0 "
                                               r"\(expected a float, an int or None\)"),
    ("zero-but-every-example-fails", "{user}:always_fails", {}, "zero",
     r"reward function 'always_fails' failed on all 3 examples of this batch, e\.g\. example 2: raised KeyError"),
    ("unknown-kwarg-builtin", "length_penalty", {"maxlen": 3}, "raise",
     r"reward 'length_penalty': unknown keyword argument 'maxlen' in kwargs \(valid kwargs of 'length_penalty': "
     r"coef, max_len\)"),
    ("kwarg-of-builtin-without-settings", "math_accuracy", {"strict": True}, "raise",
     r"reward 'math_accuracy': unknown keyword argument 'strict' .*valid kwargs of 'math_accuracy': none"),
    ("mistyped-kwarg-builtin", "overlong_penalty", {"max_len": "1k"}, "raise",
     r"reward 'overlong_penalty': kwargs\.max_len must be a number, got '1k'"),
    ("mistyped-pattern", "format", {"pattern": 3}, "raise", r"reward 'format': kwargs\.pattern must be a string"),
    ("unknown-kwarg-user", "{user}:strict", {"scal": 2}, "raise",
     r"unknown keyword argument 'scal' in kwargs \(valid kwargs of '.*strict': scale\)"),
    ("bad-on-error", "arithmetic", {}, "ignore", r"on_reward_error must be 'raise' or 'zero', got 'ignore'"),
]


def _reward_fed(name: str, kwargs: dict, on_error: str) -> str:
    fn = name.rpartition(":")[2]
    what = f" ({USER_REWARDS[fn]})" if ":" in name and fn in USER_REWARDS else ""
    return (f"rewards: [{{name: {name}{f', kwargs: {kwargs}' if kwargs else ''}}}]{what}, on_reward_error: "
            f"{on_error}; completions 'aa', 'b', 'cc'")


# what each function of _user_rewards does, for the catalog
USER_REWARDS = {"boom": "1 / (len(completion) - 1): divides by zero on 'b'", "nan_on_b": "NaN for 'b'",
                "inf_on_b": "-inf for 'b'", "short": "returns 1 score for 3 completions",
                "words": "returns strings", "always_fails": "raises KeyError on every example",
                "strict": "def strict(prompts, completions, scale=1.0)"}


@pytest.mark.bad_input("rewards")
@pytest.mark.parametrize("name,kwargs,on_error,msg", [c[1:] for c in REWARD_CASES], ids=[c[0] for c in REWARD_CASES])
def test_bad_reward(tmp_path, name, kwargs, on_error, msg):
    name = name.format(tmp=tmp_path, user=_user_rewards(tmp_path))

    def go():
        rs = RewardSet([RewardSpec(name=name, kwargs=kwargs)], on_error=on_error)
        rs.score(["p0", "p1", "p2"], ["aa", "b", "cc"], {"completion_ids": [[1], [1], [1]], "truncated": [False] * 3})

    expect_error(go, msg, _reward_fed(name, kwargs, on_error))


@pytest.mark.bad_input("rewards")
def test_empty_reward_list():
    expect_error(lambda: RewardSet([]), r"rewards: the list is empty; add at least one reward function", "rewards: []")


@pytest.mark.bad_input("rewards")
@pytest.mark.parametrize("fn", ["nan_on_b", "inf_on_b", "boom"])
def test_reward_failures_under_zero_are_counted_zeroed_and_reported(tmp_path, caplog, fn):
    rs = RewardSet([RewardSpec(name=f"{_user_rewards(tmp_path)}:{fn}")], on_error="zero")
    total, per = rs.score(["p0", "p1", "p2"], ["aa", "b", "cc"], {})
    assert per[fn][1] == 0.0 and total[1] == 0.0
    assert rs.error_counts == {fn: 1} and rs.pop_error_counts() == {fn: 1}
    assert "on example 1" in caplog.text
    expect_reported(caplog, f"reward function '{fn}'", _reward_fed(f"{tmp_path / 'myrewards.py'}:{fn}", {}, "zero"),
                    count=1)


@pytest.mark.bad_input("rewards")
@pytest.mark.parametrize("on_error", ["raise", "zero"])
def test_a_hung_reward_times_out_in_its_worker(tmp_path, caplog, on_error):
    import time

    p = tmp_path / "slow.py"
    p.write_text("import time\n"
                 "def hangs_on_b(prompts, completions, **kw):\n"
                 "    if 'b' in completions:\n"
                 "        time.sleep(3600)\n"
                 "    return [1.0 for c in completions]\n")
    rs = RewardSet([RewardSpec(name=f"{p}:hangs_on_b")], on_error=on_error, timeout_s=2.0)
    fed = (f"rewards: [{{name: {p}:hangs_on_b}}] (sleeps an hour on 'b'), reward_timeout_s: 2, on_reward_error: "
           f"{on_error}; completions 'aa', 'b', 'cc'")
    t0 = time.perf_counter()
    if on_error == "raise":
        expect_error(lambda: rs.score(["p0", "p1", "p2"], ["aa", "b", "cc"], {}),
                     r"(?s)reward function 'hangs_on_b' timed out after 2 s scoring \(reward_timeout_s\); its "
                     r"worker process was stopped.*on example 1: prompt='p1'", fed)
    else:
        total, _ = rs.score(["p0", "p1", "p2"], ["aa", "b", "cc"], {})
        assert total == [1.0, 0.0, 1.0] and rs.error_counts == {"hangs_on_b": 1}
        expect_reported(caplog, "timed out after 2 s", fed, count=1)
        assert rs.score(["p3"], ["dd"], {})[0] == [1.0]  # a fresh worker serves the next call
    assert time.perf_counter() - t0 < 60  # two timeouts and two worker starts, not an hour
    rs.fns[0].close()


@pytest.mark.bad_input("rewards")
def test_a_reward_exception_in_the_worker_is_reported_as_in_process(tmp_path):
    rs = RewardSet([RewardSpec(name=f"{_user_rewards(tmp_path)}:boom")], timeout_s=30.0)
    expect_error(lambda: rs.score(["p0", "p1", "p2"], ["aa", "b", "cc"], {}),
                 r"(?s)reward function 'boom' raised ZeroDivisionError: float division by zero.*on example 1",
                 _reward_fed(f"{tmp_path / 'myrewards.py'}:boom", {}, "raise") + ", in a worker (reward_timeout_s 30)")
    rs.fns[0].close()


@pytest.mark.bad_input("rewards")
def test_a_reward_module_that_hangs_as_it_imports_times_out(tmp_path):
    """The module is imported in the worker only, under reward_timeout_s: an import that
    never finishes is stopped at start like a hung call."""
    import time

    p = tmp_path / "slow_import.py"
    p.write_text("import time\ntime.sleep(3600)\ndef f(prompts, completions, **kw):\n    return [1.0]\n")
    t0 = time.perf_counter()
    expect_error(lambda: RewardSet([RewardSpec(name=f"{p}:f")], timeout_s=2.0),
                 r"reward '.*slow_import\.py:f': timed out after 2 s importing it \(reward_timeout_s\); its worker "
                 r"process was stopped; a module that takes this long to import needs a larger reward_timeout_s",
                 f"rewards: [{{name: {p}:f}}] (sleeps an hour as it imports), reward_timeout_s: 2")
    assert time.perf_counter() - t0 < 30


@pytest.mark.bad_input("rewards")
def test_a_worker_reward_is_imported_and_checked_in_its_worker_only(tmp_path):
    """With reward_timeout_s the trainer never imports the user's module: the worker checks
    the kwargs (the in-process message), and an exception whose class the module defines
    comes back by its name."""
    import os

    p = tmp_path / "once.py"
    p.write_text(textwrap.dedent("""
        import os, pathlib
        with pathlib.Path(__file__).with_suffix(".pids").open("a") as f:
            f.write(f"{os.getpid()}\\n")
        def strict(prompts, completions, scale=1.0):
            return [scale for c in completions]
        class Odd(Exception):
            pass
        def odd(prompts, completions, **kw):
            raise Odd("not this one")
    """))
    expect_error(lambda: RewardSet([RewardSpec(name=f"{p}:strict", kwargs={"scal": 2})], timeout_s=30.0),
                 r"reward '.*once\.py:strict': unknown keyword argument 'scal' in kwargs \(valid kwargs of "
                 r"'.*once\.py:strict': scale\)",
                 f"rewards: [{{name: {p}:strict, kwargs: {{scal: 2}}}}], def strict(prompts, completions, scale=1.0), "
                 f"in a worker (reward_timeout_s 30)")
    rs = RewardSet([RewardSpec(name=f"{p}:strict", kwargs={"scale": 2.0})], timeout_s=30.0)
    assert rs.score(["p0"], ["a"], {})[0] == [2.0]
    rs.fns[0].close()
    rs = RewardSet([RewardSpec(name=f"{p}:odd")], timeout_s=30.0)
    expect_error(lambda: rs.score(["p0"], ["a"], {}), r"(?s)reward function 'odd' raised Odd: not this one",
                 f"rewards: [{{name: {p}:odd}}] (raises its own exception class Odd), in a worker "
                 f"(reward_timeout_s 30)")
    rs.fns[0].close()
    pids = (tmp_path / "once.pids").read_text().split()
    assert len(pids) == 3 and str(os.getpid()) not in pids  # three workers, never this process


REWARD_IMPORT_CASES = [
    ("syntax-error", "def f(prompts, completions, **kw)\n    return [1.0]\n",
     r"reward '.*bad\.py:f': .*bad\.py:1: SyntaxError: expected ':'"),
    ("import-error", "import no_such_package_xyz\ndef f(prompts, completions, **kw):\n    return []\n",
     r"reward '.*bad\.py:f': importing .*bad\.py failed at .*bad\.py:1: ModuleNotFoundError: No module named "
     r"'no_such_package_xyz'"),
    ("raises-at-import", "X = 1\nTABLE = {}['missing']\n", r"reward '.*bad\.py:f': importing .*bad\.py failed at "
                                                          r".*bad\.py:2: KeyError: 'missing'"),
]


@pytest.mark.bad_input("rewards")
@pytest.mark.parametrize("source,msg", [c[1:] for c in REWARD_IMPORT_CASES], ids=[c[0] for c in REWARD_IMPORT_CASES])
def test_reward_file_that_fails_to_import(tmp_path, source, msg):
    p = tmp_path / "bad.py"
    p.write_text(source)
    expect_error(lambda: RewardSet([RewardSpec(name=f"{p}:f")]), msg, f"rewards: [{{name: {p}:f}}], bad.py = "
                                                                        f"{_short(source, 90)}")


# ------------------------------------------------------------------ model config.json
def _hf(**change):
    d = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64}
    for k, v in change.items():
        if v == "DELETE":
            d.pop(k)
        else:
            d[k] = v
    return d


CONFIG_CASES = [
    ("heads-zero", dict(num_attention_heads=0), r"field 'num_attention_heads' is 0; expected a positive integer"),
    ("heads-null", dict(num_attention_heads=None), r"field 'num_attention_heads' is null; expected a positive integer"),
    ("kv-heads-zero", dict(num_key_value_heads=0), r"field 'num_key_value_heads' is 0; expected a positive integer"),
    ("kv-heads-null", dict(num_key_value_heads=None), r"field 'num_key_value_heads' is null"),
    ("kv-heads-not-divisor", dict(num_key_value_heads=3), r"'num_attention_heads' \(2\) must be a multiple of "
                                                          r"'num_key_value_heads' \(3\)"),
    ("head-dim-zero", dict(head_dim=0), r"field 'head_dim' is 0; expected a positive integer"),
    ("head-dim-null", dict(head_dim=None), r"field 'head_dim' is null; expected a positive integer"),
    ("head-dim-negative", dict(head_dim=-16), r"field 'head_dim' is -16"),
    ("head-dim-odd", dict(head_dim=15), r"'head_dim' must be even for RoPE, got 15"),
    ("head-dim-underivable", dict(head_dim="DELETE", hidden_size=33),
     r"field 'head_dim' is missing and hidden_size \(33\) is not a multiple of num_attention_heads \(2\)"),
    ("eps-zero", dict(rms_norm_eps=0), r"field 'rms_norm_eps' is 0; expected a positive finite number"),
    ("eps-null", dict(rms_norm_eps=None), r"field 'rms_norm_eps' is null; expected a positive finite number"),
    ("eps-string", dict(rms_norm_eps="1e-6"), r"field 'rms_norm_eps' is '1e-6'; expected a positive finite number"),
    ("theta-zero", dict(rope_theta=0), r"field 'rope_theta' is 0; expected a positive finite number"),
    ("theta-null", dict(rope_theta=None), r"field 'rope_theta' is null"),
    ("theta-null-in-rope-parameters", dict(rope_parameters={"rope_type": "default", "rope_theta": None}),
     r"field 'rope_parameters\.rope_theta' is null"),
    ("llama3-factor-zero", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 0,
                                                 "low_freq_factor": 1, "high_freq_factor": 4,
                                                 "original_max_position_embeddings": 64}),
     r"field 'rope_parameters\.factor' is 0"),
    ("max-positions-zero", dict(max_position_embeddings=0), r"field 'max_position_embeddings' is 0; expected a "
                                                            r"positive integer"),
    ("max-positions-null", dict(max_position_embeddings=None), r"field 'max_position_embeddings' is null"),
    ("vocab-missing", dict(vocab_size="DELETE"), r"missing required field 'vocab_size' \(expected a positive integer\)"),
    ("layers-float", dict(num_hidden_layers=1.5), r"field 'num_hidden_layers' is 1\.5; expected a positive integer"),
    ("tie-not-bool", dict(tie_word_embeddings="yes"), r"field 'tie_word_embeddings' is 'yes'; expected true or false"),
    ("unknown-model-type", dict(model_type="gpt2"), r"field 'model_type' is 'gpt2'; rlfuse supports"),
    ("sliding-window", dict(use_sliding_window=True), r"field 'use_sliding_window' is true"),
    ("rope-type-unsupported", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
     r"field 'rope_parameters\.rope_type' is 'yarn'"),
    ("act-not-silu", dict(hidden_act="gelu"), r"'hidden_act' must be 'silu', got 'gelu'"),
]


def _hf_fed(change: dict) -> str:
    return "config.json with " + ", ".join("no " + k if v == "DELETE" else f"{k}: {json.dumps(v)}"
                                           for k, v in change.items())


@pytest.mark.bad_input("model-config")
@pytest.mark.parametrize("change,msg", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_bad_hf_config_names_file_and_field(tmp_path, change, msg):
    (tmp_path / "config.json").write_text(json.dumps(_hf(**change)))
    expect_error(lambda: ModelConfig.from_hf(tmp_path), rf"{tmp_path / 'config.json'}: .*{msg}", _hf_fed(change))


MOE = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
MOE_CONFIG_CASES = [
    ("moe-top-k-above-experts", dict(num_experts_per_tok=5), r"field 'num_experts_per_tok' is 5; it must be at most "
                                                             r"num_experts = 4"),
    ("moe-size-missing", dict(moe_intermediate_size="DELETE"), r"missing required field 'moe_intermediate_size'"),
    ("moe-mlp-only-layer-out-of-range", dict(mlp_only_layers=[1]), r"field 'mlp_only_layers' holds \[1\]; expected "
                                                                   r"layer indices in \[0, num_hidden_layers = 1\)"),
    ("moe-shared-experts", dict(shared_expert_intermediate_size=16), r"field 'shared_expert_intermediate_size' is 16; "
                                                                     r"shared experts are not supported"),
    ("moe-scoring-sigmoid", dict(scoring_func="sigmoid"), r"field 'scoring_func' is 'sigmoid'; only 'softmax'"),
    # Qwen3.5-MoE (a shared expert per block; transformers hard-codes the layer rule and the renormalization)
    ("qwen3_5_moe-no-shared-size", dict(model_type="qwen3_5_moe_text", intermediate_size="DELETE"),
     r"missing required field 'shared_expert_intermediate_size' \(a qwen3_5_moe_text config needs it\)"),
    ("qwen3_5_moe-norm-topk-false", dict(model_type="qwen3_5_moe_text", intermediate_size="DELETE",
                                         shared_expert_intermediate_size=8, norm_topk_prob=False),
     r"field 'norm_topk_prob' is False; qwen3_5_moe_text always has norm_topk_prob = True"),
    # Qwen3-Next (a shared expert per MoE block; the layer rule and norm_topk_prob read as Qwen3-MoE's)
    ("qwen3_next-no-shared-size", dict(model_type="qwen3_next"),
     r"missing required field 'shared_expert_intermediate_size' \(a qwen3_next config needs it\)"),
    ("qwen3_next-sparse-step-zero", dict(model_type="qwen3_next", shared_expert_intermediate_size=8,
                                         decoder_sparse_step=0),
     r"field 'decoder_sparse_step' must be a positive integer, got 0"),
]


@pytest.mark.bad_input("model-config")
@pytest.mark.parametrize("change,msg", [c[1:] for c in MOE_CONFIG_CASES], ids=[c[0] for c in MOE_CONFIG_CASES])
def test_bad_moe_config_names_file_and_field(tmp_path, change, msg):
    cfg = _hf(**MOE)
    for k, v in change.items():
        cfg.pop(k) if v == "DELETE" else cfg.__setitem__(k, v)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    expect_error(lambda: ModelConfig.from_hf(tmp_path), rf"{tmp_path / 'config.json'}: .*{msg}",
                 _hf_fed({**MOE, **change}))


def _moe_folder(tmp_path, edit):
    from safetensors.torch import load_file, save_file

    from rlfuse.model import CausalLM, save_model
    model = CausalLM(ModelConfig.from_hf(_hf(**MOE)))
    model.init_weights()
    save_model(model, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    return tmp_path / "m"


@pytest.mark.bad_input("model-config")
@pytest.mark.parametrize("fed,edit,msg", [
    ("a qwen3_moe folder without model.layers.0.mlp.experts.3.up_proj.weight",
     lambda t: t.pop("model.layers.0.mlp.experts.3.up_proj.weight"),
     r"missing tensor 'model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight' \(expert 3 of num_experts = 4\)"),
    ("a qwen3_moe folder whose expert 1 down_proj is (32, 7)",
     lambda t: t.update({"model.layers.0.mlp.experts.1.down_proj.weight": torch.zeros(32, 7)}),
     r"tensor 'model\.layers\.0\.mlp\.experts\.1\.down_proj\.weight' has shape \(32, 7\), the config expects "
     r"\(32, 8\)"),
], ids=["moe-expert-missing", "moe-expert-misshaped"])
def test_bad_moe_expert_tensors_name_the_tensor(tmp_path, fed, edit, msg):
    from rlfuse.model import load_model
    folder = _moe_folder(tmp_path, edit)
    expect_error(lambda: load_model(folder), rf"{folder}: {msg}", fed)


@pytest.mark.bad_input("model-config")
@pytest.mark.parametrize("content,msg", [("{oops", r"not valid JSON"), ("[1, 2]", r"expected a JSON object of config "
                                                                                  r"fields, got list")],
                         ids=["invalid-json", "not-an-object"])
def test_config_json_not_a_config(tmp_path, content, msg):
    (tmp_path / "config.json").write_text(content)
    expect_error(lambda: ModelConfig.from_hf(tmp_path), rf"config\.json: {msg}", f"config.json containing {content!r}")
    expect_error(lambda: ModelConfig.from_hf(tmp_path / "nowhere"), r"nowhere: no such file \(expected a config\.json, "
                                                                     r"or an HF model folder holding one\)",
                 "a model folder that does not exist")


@pytest.mark.bad_input("model-config")
def test_absent_optional_fields_follow_hf_and_are_logged(caplog):
    with caplog.at_level(logging.INFO):
        cfg = ModelConfig.from_hf(_hf(head_dim="DELETE", num_key_value_heads="DELETE", max_position_embeddings="DELETE"))
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.max_position_embeddings) == (16, 2, 4096)
    fed = "config.json without head_dim, num_key_value_heads, max_position_embeddings (optional in HF)"
    for text in ("no 'head_dim'; using hidden_size / num_attention_heads = 16",
                 "no 'num_key_value_heads'; using num_attention_heads = 2", "no 'max_position_embeddings'"):
        expect_reported(caplog, text, fed, count=1)


@pytest.mark.bad_input("model-config")
@pytest.mark.parametrize("field,value", [("rms_norm_eps", 0.0), ("rope_theta", float("nan")),
                                         ("max_position_embeddings", 0)])
def test_random_init_config_checked_too(tok, field, value):
    """A random model's fields (model.random_init in a recipe) are checked like a config.json's."""
    from rlfuse.run.build import build_model
    from rlfuse.run.config.sections import ModelSpec

    init = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, **{field: value})
    spec = ModelSpec(random_init=init, device="cpu", kernel_backend="torch")
    expect_error(lambda: build_model(spec, tok, torch.device("cpu")),
                 rf"model\.random_init: config field '{field}' must be a positive", f"model.random_init: {init}")


@pytest.mark.bad_input("model-config")
@pytest.mark.parametrize("change,msg", [
    ({"qk_norm": False}, r"'qk_norm' is False, but Qwen3ForCausalLM always has qk_norm = True"),
    ({"model_type": "qwen2", "attention_bias": False},
     r"'attention_bias' is False, but Qwen2ForCausalLM always has attention_bias = True"),
], ids=["qwen3-without-qk-norm", "qwen2-without-qkv-bias"])
def test_random_init_outside_its_architecture(tok, change, msg):
    """A random model that its HF class cannot build (transformers has no switch for Qwen3's
    q/k norms or Qwen2's q/k/v biases) is refused: its saved folder would not load back."""
    from rlfuse.run.build import build_model
    from rlfuse.run.config.sections import ModelSpec

    init = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, **change)
    spec = ModelSpec(random_init=init, device="cpu", kernel_backend="torch")
    expect_error(lambda: build_model(spec, tok, torch.device("cpu")), rf"model\.random_init: config field {msg}",
                 f"model.random_init: {init}")


def _hybrid_folder(tmp_path, **config_change) -> Path:
    """A tiny Qwen3.5 folder (3 linear-attention layers + 1 full) saved by rlfuse; its config.json
    then updated with `config_change`."""
    from tiny_hf import tiny_hybrid_model

    from rlfuse.model.weights import save_model

    folder = save_model(tiny_hybrid_model(seed=0), tmp_path / "q35")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **config_change}))
    return folder


@pytest.mark.bad_input("model-config")
def test_hybrid_layer_type_not_supported(tmp_path):
    types = ["linear_attention", "linear_attention", "sliding_attention", "full_attention"]
    folder = _hybrid_folder(tmp_path, layer_types=types)
    expect_error(lambda: ModelConfig.from_hf(folder),
                 r"q35/config\.json: config field 'layer_types': layer 2 has type 'sliding_attention', which rlfuse "
                 r"does not support; supported layer types: \['full_attention', 'linear_attention'\]",
                 f"Qwen3.5 config.json with layer_types {types}")


@pytest.mark.bad_input("model-config")
def test_hybrid_linear_attention_shapes_not_the_configs(tmp_path):
    """Weights of 4 linear-attention value heads under a config.json that says 2."""
    folder = _hybrid_folder(tmp_path, linear_num_value_heads=2)
    expect_error(lambda: load_model_folder(folder),
                 r"model\.safetensors: tensor 'model\.layers\.0\.linear_attn\.A_log' has shape \(4,\), the config "
                 r"expects \(2,\)",
                 "Qwen3.5 folder whose config.json says linear_num_value_heads 2, its weights 4")


@pytest.mark.bad_input("model-config")
def test_multimodal_qwen3_5_folder_loads_its_text_tower(tmp_path, caplog):
    """A Qwen3_5ForConditionalGeneration folder (text tower under model.language_model., a vision
    tower, an MTP head) loads as the text model; what is left out is said in one line each."""
    from safetensors.torch import load_file, save_file

    folder = _hybrid_folder(tmp_path)
    text = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                    "model_type": "qwen3_5", "text_config": text,
                                                    "vision_config": {"depth": 1}, "tie_word_embeddings": False}))
    tensors = {n.replace("model.", "model.language_model.", 1): t
               for n, t in load_file(folder / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3, 2, 2, 2)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="rlfuse.model.weights"):
        model = load_model_folder(folder, text_only=True)
    assert model.config.model_type == "qwen3_5_text"
    fed = "a Qwen3_5ForConditionalGeneration folder (vision tower, MTP head) loaded as a text model"
    expect_reported(caplog, "its vision tower (1 tensors) is not loaded", fed, count=1)
    expect_reported(caplog, "its multi-token-prediction head (1 tensors) is not loaded", fed, count=1)


def _vl_hf(text=None, vision=None, **outer):
    from rlfuse.model.arch.qwen3_vl import tiny_vl_fields
    d = ModelConfig(**tiny_vl_fields()).to_hf()
    d["text_config"].update(text or {})
    d["vision_config"].update(vision or {})
    d.update(outer)
    return {k: v for k, v in d.items() if v != "DELETE"}


VL_CONFIG_CASES = [
    ("vl-no-vision-config", dict(vision_config="DELETE"), r"a Qwen3-VL config needs a 'vision_config' object"),
    ("vl-deepstack-past-depth", dict(vision=dict(deepstack_visual_indexes=[0, 5])),
     r"\(vision_config\): vision config field 'deepstack_visual_indexes' must list block indices in \[0, 3\), "
     r"got \[0, 5\]"),
    ("vl-out-hidden-not-text-width", dict(vision=dict(out_hidden_size=48)),
     r"vision config field 'out_hidden_size' \(48\) must equal the text model's hidden_size \(64\)"),
    ("vl-mrope-section-sum", dict(text=dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                              "mrope_section": [4, 4, 4]})),
     r"'mrope_section' \[4, 4, 4\] must be three numbers summing to head_dim / 2 = 8"),
    ("vl-image-token-not-an-id", dict(image_token_id=-1), r"field 'image_token_id' is -1; expected a token id"),
    ("vl-image-token-past-vocab", dict(image_token_id=600),
     r"'image_token_id' is 600; it must be a token id below vocab_size \(512\)"),
]


@pytest.mark.bad_input("model-config")
@pytest.mark.parametrize("change,msg", [c[1:] for c in VL_CONFIG_CASES], ids=[c[0] for c in VL_CONFIG_CASES])
def test_bad_qwen3_vl_config(tmp_path, change, msg):
    (tmp_path / "config.json").write_text(json.dumps(_vl_hf(**change)))
    expect_error(lambda: ModelConfig.from_hf(tmp_path), rf"{tmp_path / 'config.json'}.*{msg}",
                 "Qwen3-VL config.json with " + json.dumps(change))


@pytest.mark.bad_input("model-config")
def test_image_processor_config_not_the_models(tmp_path):
    """A preprocessor_config.json whose patches do not fit the checkpoint's vision tower."""
    from rlfuse.model.arch.qwen3_vl import tiny_vl_fields
    from rlfuse.model.vision.processor import ImageProcessor
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14, "merge_size": 2}))
    where = str(tmp_path / "preprocessor_config.json")
    vision = ModelConfig(**tiny_vl_fields()).vision
    expect_error(lambda: ImageProcessor.from_folder(tmp_path).check_model(vision, where),
                 r"preprocessor_config\.json: field 'patch_size' is 14 but the model's vision_config\.patch_size is 4",
                 "preprocessor_config.json with patch_size 14 beside a model whose vision tower has patch_size 4")


# ------------------------------------------------------------------ kernels
@pytest.mark.bad_input("kernels-devices")
@pytest.mark.parametrize("backend,device", [("triton", "cpu"), ("auto", "cuda")])
def test_head_dim_the_triton_kernels_cannot_run(backend, device):
    cfg = ModelConfig.from_hf(_hf(head_dim=24, hidden_size=48))
    expect_error(lambda: check_kernel_support(cfg, backend, device, "m/config.json"),
                 r"m/config\.json: field 'head_dim' is 24; the Triton attention kernels need a power of two in "
                 r"\[16, 256\] .*set model\.kernel_backend: torch",
                 f"m/config.json with head_dim: 24, model.kernel_backend: {backend} on {device}")


@pytest.mark.parametrize("backend,device", [("auto", "cpu"), ("torch", "cuda")])
def test_head_dim_the_triton_kernels_cannot_run_is_fine_off_triton(backend, device):
    """The same model where the Triton kernels are not used: accepted, nothing to report."""
    check_kernel_support(ModelConfig.from_hf(_hf(head_dim=24, hidden_size=48)), backend, device, "m/config.json")


def test_head_dim_rule_agrees_with_the_kernels():
    from rlfuse.kernels.attention.paged import _check_cache
    from rlfuse.kernels.attention.varlen import _check

    for d in range(2, 300, 2):
        q = torch.zeros(1, 1, d)
        try:
            _check(q, q, q, torch.zeros(2, dtype=torch.int32))
            _check_cache(torch.zeros(1, 16, 1, d), torch.zeros(1, 16, 1, d), "paged")
            kernels_ok = True
        except ValueError:
            kernels_ok = False
        assert triton_attention_supports(d) == kernels_ok, d


# ------------------------------------------------------------------ checkpoints and the filesystem
def _tiny_model():
    cfg = ModelConfig(model_type="qwen3", vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=16, max_position_embeddings=32)
    model = CausalLM(cfg)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    return model


@pytest.fixture
def run(tmp_path):
    model = _tiny_model()
    opt = MasterAdamW(model.parameters(), lr=1e-3)
    for step in (1, 2):
        ck.save_checkpoint(tmp_path, step, model, opt, {"data": {"position": step}}, keep_last=3)
    return tmp_path, model, opt


def _truncate(path: Path, keep: int = 40):
    path.write_bytes(path.read_bytes()[:keep])


CKPT_CASES = [
    # (id, what was fed (in a run folder with checkpoints of steps 1 and 2), action, expected message)
    ("resume-not-a-checkpoint", "checkpoint.resume=<tmp>/elsewhere (a folder without a checkpoint)",
     lambda r: rs.resolve_resume(str(r / "elsewhere"), r),
     r"checkpoint\.resume: .*elsewhere is not a complete checkpoint folder \(no COMPLETE file\)"),
    ("resume-explicit-truncated-weights", "checkpoint.resume=step_000002 whose model.safetensors is cut to 40 bytes",
     lambda r: (_truncate(r / "checkpoints/step_000002/model/model.safetensors"),
                rs.resolve_resume(str(r / "checkpoints/step_000002"), r)),
     r"step_000002 is damaged \(model/model\.safetensors: \d+ bytes, \d+ when saved\)"),
    ("resume-explicit-missing-state", "checkpoint.resume=step_000002 without its state.pt",
     lambda r: ((r / "checkpoints/step_000002/state.pt").unlink(),
                rs.resolve_resume(str(r / "checkpoints/step_000002"), r)),
     r"step_000002 is damaged \(state\.pt: missing\)"),
    ("resume-all-damaged", "checkpoint.resume=auto, the optimizer.pt of both checkpoints cut to 40 bytes",
     lambda r: ([_truncate(r / f"checkpoints/step_00000{s}/optimizer.pt") for s in (1, 2)],
                rs.resolve_resume("auto", r)),
     r"checkpoints: no intact checkpoint to resume from \(step_000002: optimizer\.pt: 40 bytes, \d+ when saved; "
     r"step_000001: .*\); move them away to start afresh"),
    ("resume-weights-header-garbled-old-format",  # a checkpoint without the size manifest
     "checkpoint.resume=step_000002 (without a size manifest) whose model.safetensors is 64 bytes of 0xff",
     lambda r: ((r / "checkpoints/step_000002/COMPLETE").write_text("2\n"),
                (r / "checkpoints/step_000002/model/model.safetensors").write_bytes(b"\xff" * 64),
                rs.resolve_resume(str(r / "checkpoints/step_000002"), r)),
     r"step_000002 is damaged \(model/model\.safetensors: truncated or not a safetensors file \(64 bytes"),
    ("resume-torch-archive-garbled-old-format",
     "checkpoint.resume=step_000002 (without a size manifest) whose state.pt is b'garbage'",
     lambda r: ((r / "checkpoints/step_000002/COMPLETE").write_text("2\n"),
                (r / "checkpoints/step_000002/state.pt").write_bytes(b"garbage"),
                rs.resolve_resume(str(r / "checkpoints/step_000002"), r)),
     r"step_000002 is damaged \(state\.pt: unreadable \(File is not a zip file\)\)"),
]


@pytest.mark.bad_input("checkpoints-fs")
@pytest.mark.parametrize("fed,action,msg", [c[1:] for c in CKPT_CASES], ids=[c[0] for c in CKPT_CASES])
def test_bad_checkpoint(run, fed, action, msg):
    expect_error(lambda: action(run[0]), msg, fed)


@pytest.mark.bad_input("checkpoints-fs")
def test_damaged_newest_checkpoint_falls_back_and_says_so(run, caplog):
    r, model, opt = run
    _truncate(r / "checkpoints/step_000002/model/model.safetensors", 100)
    assert rs.resolve_resume("auto", r).name == "step_000001"
    [line] = expect_reported(caplog, "checkpoint step_000002 is damaged (model/model.safetensors: 100 bytes",
                             "checkpoint.resume=auto, the newest checkpoint's model.safetensors cut to 100 bytes",
                             count=1)
    assert "resuming from the previous intact checkpoint step_000001" in line


def _fail_with(monkeypatch, target, attr, err):
    def boom(*a, **k):
        raise err
    monkeypatch.setattr(target, attr, boom)


@pytest.mark.bad_input("checkpoints-fs")
@pytest.mark.parametrize("what", ["disk-full-torch-save", "disk-full-unexpected-pos", "disk-full-weights",
                                  "read-only-folder"])
def test_checkpoint_write_failure_names_path_and_keeps_the_previous(run, monkeypatch, what):
    r, model, opt = run
    fed = {"disk-full-torch-save": "saving checkpoint step 3: torch.save fails (RuntimeError: PytorchStreamWriter "
                                   "failed writing file data/0: file write failed)",
           "disk-full-unexpected-pos": "saving checkpoint step 3: torch.save fails (RuntimeError: [enforce fail at "
                                       "inline_container.cc:603] . unexpected pos 4096 vs 3980)",
           "disk-full-weights": "saving checkpoint step 3: writing the weights fails (OSError ENOSPC)",
           "read-only-folder": "saving checkpoint step 3: creating its folder fails (OSError EROFS)"}[what]
    if what == "disk-full-torch-save":
        _fail_with(monkeypatch, ck.torch, "save", RuntimeError("PytorchStreamWriter failed writing file data/0: "
                                                               "file write failed"))
        msg = (r"cannot write .*step_000003: no space left on device\? torch\.save could not write its data \(torch: "
               r"PytorchStreamWriter failed writing file")
    elif what == "disk-full-unexpected-pos":
        _fail_with(monkeypatch, ck.torch, "save", RuntimeError("[enforce fail at inline_container.cc:603] . "
                                                               "unexpected pos 4096 vs 3980"))
        msg = r"cannot write .*step_000003: no space left on device\? .*unexpected pos 4096 vs 3980"
    elif what == "disk-full-weights":
        _fail_with(monkeypatch, ck, "save_model", OSError(errno.ENOSPC, "No space left on device", "x.safetensors"))
        msg = r"cannot write .*step_000003: No space left on device \(x\.safetensors\); .*GiB free on that disk"
    else:
        _fail_with(monkeypatch, Path, "mkdir", PermissionError(errno.EROFS, "Read-only file system", str(r)))
        msg = r"cannot write .*step_000003: Read-only file system"
    expect_error(lambda: ck.save_checkpoint(r, 3, model, opt, {}, keep_last=1), msg + r".*the previous checkpoints "
                                                                                     r"are untouched", fed)
    monkeypatch.undo()
    assert [p.name for p in ck.list_checkpoints(r)] == ["step_000001", "step_000002"]
    assert rs.resolve_resume("auto", r).name == "step_000002"
    assert sorted(p.name for p in (r / "checkpoints").iterdir()) == ["step_000001", "step_000002"]


_SAFETENSORS_FULL = ('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                     '"No space left on device" })')


@pytest.mark.bad_input("checkpoints-fs")
@pytest.mark.parametrize("what", ["safetensors-disk-full", "tokenizer-writer"])
def test_every_checkpoint_writer_failure_is_the_same_clear_line(run, monkeypatch, what):
    """Before: a SafetensorError from a full disk was a traceback (only OSError and RuntimeError
    were caught); now every writer's failure ends in the same line, the previous checkpoints
    intact."""
    from safetensors import SafetensorError

    from rlfuse.model import weights

    r, model, opt = run
    tok = None
    if what == "safetensors-disk-full":
        _fail_with(monkeypatch, weights, "save_file", SafetensorError(_SAFETENSORS_FULL))
        fed = f"saving checkpoint step 3: safetensors' save_file fails (SafetensorError: {_SAFETENSORS_FULL})"
        msg = (r"cannot write .*step_000003: no space left on device\? safetensors could not write its data "
               r"\(safetensors: Error while serializing: IoError")
    else:
        class Tok:  # the tokenizers library reports a failed write as a bare Exception
            def save(self, folder):
                raise Exception("No space left on device (os error 28)")
        tok = Tok()
        fed = "saving checkpoint step 3: the tokenizer's save fails (Exception: No space left on device (os error 28))"
        msg = r"cannot write .*step_000003: no space left on device\? Exception could not write its data"
    expect_error(lambda: ck.save_checkpoint(r, 3, model, opt, {}, tokenizer=tok, keep_last=1),
                 msg + r".*the previous checkpoints are untouched", fed)
    monkeypatch.undo()
    assert sorted(p.name for p in (r / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert rs.resolve_resume("auto", r).name == "step_000002"


@pytest.mark.bad_input("checkpoints-fs")
def test_final_safetensors_failure_keeps_the_previous_final(run, monkeypatch):
    from safetensors import SafetensorError

    from rlfuse.model import weights

    r, model, _ = run
    ck.save_final(r, model)
    before = (r / "final/model.safetensors").read_bytes()
    _fail_with(monkeypatch, weights, "save_file", SafetensorError(_SAFETENSORS_FULL))
    expect_error(lambda: ck.save_final(r, model), r"cannot write .*final: no space left on device\? safetensors",
                 f"saving final/ over a previous one: safetensors' save_file fails (SafetensorError: "
                 f"{_SAFETENSORS_FULL})")
    assert (r / "final/model.safetensors").read_bytes() == before
    assert sorted(p.name for p in r.iterdir() if p.name.startswith(".final")) == []


@pytest.mark.bad_input("checkpoints-fs")
def test_final_write_failure_keeps_the_previous_final(run, monkeypatch):
    r, model, _ = run
    ck.save_final(r, model)
    before = (r / "final/model.safetensors").read_bytes()
    _fail_with(monkeypatch, ck, "save_model", OSError(errno.ENOSPC, "No space left on device"))
    expect_error(lambda: ck.save_final(r, model), r"cannot write .*final: No space left on device",
                 "saving final/ over a previous one: writing the weights fails (OSError ENOSPC)")
    assert (r / "final/model.safetensors").read_bytes() == before


@pytest.mark.bad_input("non-finite")
@pytest.mark.parametrize("where", ["checkpoint", "final"])
def test_non_finite_weights_never_written(run, where):
    r, model, opt = run
    with torch.no_grad():
        model.lm_head_weight[0, 0] = float("inf")
    save = (lambda: ck.save_checkpoint(r, 3, model, opt, {})) if where == "checkpoint" else \
        (lambda: ck.save_final(r, model))
    err = expect_error(save, r"refusing to write non-finite weights \(NaN/inf in 1 tensors, e\.g\. .*\); earlier "
                             r"checkpoints are kept", f"saving {where} weights holding an inf")
    assert isinstance(err, NonFiniteError)
    assert not (r / "checkpoints/step_000003").exists() and not (r / "final").exists()


@pytest.mark.bad_input("checkpoints-fs")
def test_leftover_temporary_folders_cleaned_at_start(run, caplog):
    r, _, _ = run
    (r / "checkpoints/.step_000003.tmp4242/model").mkdir(parents=True)
    (r / ".final.tmpxyz").mkdir()
    rs.resolve_resume("never", r)
    assert not (r / "checkpoints/.step_000003.tmp4242").exists() and not (r / ".final.tmpxyz").exists()
    expect_reported(caplog, "a temporary folder left by an interrupted save", "a run folder holding "
                    "checkpoints/.step_000003.tmp4242/ and .final.tmpxyz/ (saves cut short)", count=2)


@pytest.mark.bad_input("checkpoints-fs")
def test_half_deleted_checkpoint_of_a_cut_rotation_removed_at_start(tmp_path, caplog):
    model = _tiny_model()
    opt = MasterAdamW(model.parameters(), lr=1e-3)
    for step in (1, 2):
        ck.save_checkpoint(tmp_path, step, model, opt, {"data": {}}, keep_last=2)
    half = tmp_path / "checkpoints" / "step_000001"
    (half / "COMPLETE").unlink()  # what _rotate does first; a kill then leaves the rest
    (half / "optimizer.pt").unlink()
    rs.resolve_resume("auto", tmp_path)
    assert not half.exists() and [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_000002"]
    expect_reported(caplog, "whose deletion by the rotation", "checkpoints/step_000001/ without COMPLETE, partly "
                    "deleted, beside a complete step_000002/ (a rotation cut short)", count=1)
    # a step_* folder without COMPLETE that is the newest is not a rotation's: left alone
    (tmp_path / "checkpoints" / "step_000002" / "COMPLETE").unlink()
    assert rs.clean_temporary(tmp_path) == [] and (tmp_path / "checkpoints" / "step_000002").is_dir()


@pytest.mark.bad_input("checkpoints-fs")
def test_nothing_to_resume_said_plainly(tmp_path, caplog):
    assert rs.resolve_resume("auto", tmp_path) is None
    expect_reported(caplog, "checkpoint.resume=auto: nothing to resume (no complete checkpoint in",
                    "checkpoint.resume=auto in an empty folder", count=1)


# ------------------------------------------------------------------ metrics and report
def _metrics(tmp, text):
    (tmp / "metrics.jsonl").write_text(text)
    return tmp / "metrics.jsonl"


@pytest.mark.bad_input("metrics-report")
def test_torn_last_metrics_line_dropped_on_read_and_on_resume(tmp_path, caplog):
    good = "".join(json.dumps({"step": s, "stage": "sft", "loss": 1.0 / s}) + "\n" for s in (1, 2))
    p = _metrics(tmp_path, good + '{"step": 3, "stage": "sf')
    assert [r["step"] for r in mt.read_metrics(tmp_path)] == [1, 2]
    expect_reported(caplog, f"{p}:3: dropping a torn last line", "metrics.jsonl whose last line is cut short: "
                    '{"step": 3, "stage": "sf', count=1)
    mt.RunLog(tmp_path, tensorboard=False, progress=False, initial=2).close()  # a resume at step 2
    assert p.read_text() == good


@pytest.mark.bad_input("metrics-report")
def test_corrupt_metrics_line_in_the_middle(tmp_path):
    p = _metrics(tmp_path, '{"step": 1}\n{"step": 2,,}\n{"step": 3}\n')
    expect_error(lambda: mt.read_metrics(tmp_path), rf"{p}:2: not valid JSON .*in the middle of the file",
                 "metrics.jsonl with line 2 of 3 not JSON")
    _metrics(tmp_path, '{"step": 1}\n[1]\n')
    expect_error(lambda: mt.read_metrics(tmp_path), r"metrics\.jsonl:2: expected a JSON object per line, got list",
                 "metrics.jsonl with line 2 a JSON list")


@pytest.mark.bad_input("metrics-report")
@pytest.mark.parametrize("what", ["append-disk-full", "folder-read-only"])
def test_metrics_write_failure_names_the_file(tmp_path, monkeypatch, what):
    if what == "append-disk-full":
        log = mt.RunLog(tmp_path, tensorboard=False, progress=False)
        _fail_with(monkeypatch, Path, "open", OSError(errno.ENOSPC, "No space left on device"))
        expect_error(lambda: log.log(1, {"loss": 1.0}), rf"cannot write {tmp_path / 'metrics.jsonl'}: No space left "
                                                        r"on device; free space", "appending to metrics.jsonl fails "
                                                                                  "(OSError ENOSPC)")
    else:
        _fail_with(monkeypatch, Path, "mkdir", PermissionError(errno.EACCES, "Permission denied"))
        expect_error(lambda: mt.RunLog(tmp_path / "run", tensorboard=False, progress=False),
                     r"cannot write .*run: Permission denied", "creating the run folder fails (PermissionError EACCES)")


@pytest.mark.bad_input("metrics-report")
def test_report_with_a_torn_metrics_line_still_renders(tmp_path, caplog):
    _metrics(tmp_path, json.dumps({"step": 1, "stage": "sft", "loss": 1.0}) + "\n{\"step\": 2, \"lo")
    assert render(tmp_path).exists()
    expect_reported(caplog, "dropping a torn last line", "report of a run whose metrics.jsonl ends in a cut line",
                    count=1)


@pytest.mark.bad_input("metrics-report")
def test_report_of_a_folder_without_runs(tmp_path):
    expect_error(lambda: render(tmp_path), r"no metrics\.jsonl here or in its subfolders \(is this a run folder\?\)",
                 "report of an empty folder")


@pytest.mark.bad_input("non-finite")
def test_weight_norm_growing_by_orders_of_magnitude_is_warned(caplog):
    from rlfuse.run.optim import WeightNormWatch

    model = _tiny_model()
    watch = WeightNormWatch(model.parameters())
    n0 = watch.check(0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    assert watch.check(1) == pytest.approx(3 * n0, rel=1e-5) and not caplog.records  # x3: no warning
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0)
    with caplog.at_level(logging.WARNING):
        watch.check(2)
        watch.check(3)  # still x15: said once
    expect_reported(caplog, "the weight norm grew from", "weights scaled x15 between steps 0 and 2 (as a learning "
                    "rate far too high does)", count=1)


# ------------------------------------------------------------------ non-finite training numbers
@pytest.mark.bad_input("non-finite")
def test_consecutive_non_finite_steps_stop_with_a_clear_error(caplog):
    model = _tiny_model()
    opt = MasterAdamW(model.parameters(), lr=1e-3)
    guard = NonFiniteGuard(max_consecutive=3)
    nan = torch.tensor(float("nan"))
    fed = "a NaN loss in 3 optimizer steps in a row, optim.max_nonfinite_steps=3"
    for s in (1, 2):
        assert not guard.step(opt, loss=nan, grad_norm=torch.tensor(1.0), where=f"grpo step {s}")
    expect_reported(caplog, "not finite; optimizer step skipped", fed, count=2)
    expect_error(lambda: guard.step(opt, loss=nan, grad_norm=nan, where="grpo step 3"),
                 r"grpo step 3: 3 optimizer steps in a row had a non-finite loss or gradient norm .*lower optim\.lr",
                 fed)


# ------------------------------------------------------------------ through the CLI (today's `rlfuse sft` / `report`)
def _recipe(tmp, data: Path) -> Path:
    y = tmp / "r.yaml"
    y.write_text(textwrap.dedent(f"""
        model: {{random_init: {{hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, num_attention_heads: 1,
                 num_key_value_heads: 1, head_dim: 16, max_position_embeddings: 32}}, tokenizer: char,
                 device: cpu, kernel_backend: torch}}
        data: {{train: {data}, max_prompt_len: 8}}
        sft: {{steps: 1, batch_size: 2}}
        logging: {{run_dir: {tmp / 'run'}, tensorboard: false, progress: false}}
    """))
    return y


@pytest.mark.bad_input("cli")
@pytest.mark.parametrize("content,msg", [
    (b'{"prompt": "a", "completion": "b"}\n{"prompt": "\xe9"}\n', r"d\.jsonl:2: not valid UTF-8"),
    (b"", r"d\.jsonl: the data file is empty"),
    (b'{"prompt": "a"}\n', r"d\.jsonl:1: missing field 'completion'"),
], ids=["cli-undecodable", "cli-empty-file", "cli-no-target"])
def test_cli_data_errors_are_one_line(tmp_path, capsys, content, msg):
    data = tmp_path / "d.jsonl"
    data.write_bytes(content)
    argv = ["sft", str(_recipe(tmp_path, data))]
    rc, _, err = _cli(argv, capsys)
    cli_error_line(rc, err, msg, f"rlfuse {' '.join(argv)}, data.train: d.jsonl = {_short(content)}")


@pytest.mark.bad_input("cli")
def test_cli_report_errors_and_torn_lines(tmp_path, capsys, caplog):
    rc, _, err = _cli(["report", str(tmp_path)], capsys)
    cli_error_line(rc, err, rf"{tmp_path}: no metrics\.jsonl here or in its subfolders",
                   f"rlfuse report {tmp_path} (an empty folder)")
    _metrics(tmp_path, json.dumps({"step": 1, "stage": "sft", "loss": 1.0}) + "\n{\"ste")
    rc, _, err = _cli(["report", str(tmp_path)], capsys)
    assert rc == 0 and "Traceback" not in err, err
    expect_reported(caplog, "dropping a torn last line", f"rlfuse report {tmp_path}, metrics.jsonl ending in a cut "
                                                         "line", count=1)


# ------------------------------------------------------------------ run config: every numeric field's range
RANGE_CASES = [
    # (override, the message: the field and its valid range)
    ("optim.lr=0", r"optim\.lr must be in \(0, 1\], got 0\.0"),
    ("optim.lr=-1e-3", r"optim\.lr must be in \(0, 1\], got -0\.001"),
    ("optim.lr=.nan", r"optim\.lr must be in \(0, 1\], got nan"),
    ("optim.lr=.inf", r"optim\.lr must be in \(0, 1\], got inf"),
    ("optim.lr=1e10", r"optim\.lr must be in \(0, 1\], got 10000000000\.0"),
    ("optim.lr=1e38", r"optim\.lr must be in \(0, 1\], got 1e\+38"),
    ("ppo.critic_lr=2", r"ppo\.critic_lr must be in \(0, 1\], got 2"),
    ("optim.betas=[0.9, 1.0]", r"optim\.betas\[1\] must be in \[0, 1\), got 1\.0"),
    ("optim.betas=[-0.1, 0.99]", r"optim\.betas\[0\] must be in \[0, 1\), got -0\.1"),
    ("optim.eps=0", r"optim\.eps must be a finite number > 0, got 0\.0"),
    ("optim.weight_decay=-0.1", r"optim\.weight_decay must be a finite number >= 0, got -0\.1"),
    ("optim.warmup_steps=-1", r"optim\.warmup_steps must be an integer >= 0, got -1"),
    ("optim.min_lr_ratio=1.5", r"optim\.min_lr_ratio must be in \[0, 1\], got 1\.5"),
    ("optim.max_grad_norm=-1", r"optim\.max_grad_norm must be a finite number >= 0, got -1\.0"),
    ("optim.max_nonfinite_steps=-1", r"optim\.max_nonfinite_steps must be an integer >= 0, got -1"),
    ("sft.steps=0", r"sft\.steps must be an integer > 0, got 0"),
    ("sft.batch_size=0", r"sft\.batch_size must be an integer > 0, got 0"),
    ("sft.micro_batch_tokens=0", r"sft\.micro_batch_tokens must be an integer > 0, got 0"),
    ("sft.max_seq_len=-5", r"sft\.max_seq_len must be an integer > 0, got -5"),
    ("sft.eval_every=-1", r"sft\.eval_every must be an integer >= 0, got -1"),
    ("sft.overlong=cut", r"sft\.overlong must be one of \['truncate', 'drop'\], got 'cut'"),
    ("grpo.steps=0", r"grpo\.steps must be an integer > 0, got 0"),
    ("grpo.prompts_per_step=0", r"grpo\.prompts_per_step must be an integer > 0, got 0"),
    ("grpo.group_size=1", r"grpo\.group_size must be >= 2 for group-relative advantages, got 1"),
    ("grpo.max_new_tokens=0", r"grpo\.max_new_tokens must be an integer > 0, got 0"),
    ("grpo.temperature=-0.5", r"grpo\.temperature must be a finite number >= 0, got -0\.5"),
    ("grpo.top_p=0", r"grpo\.top_p must be in \(0, 1\], got 0\.0"),
    ("grpo.top_p=1.5", r"grpo\.top_p must be in \(0, 1\], got 1\.5"),
    ("grpo.top_k=-1", r"grpo\.top_k must be an integer >= 0, got -1"),
    ("grpo.clip_low=1.0", r"grpo\.clip_low must be in \[0, 1\), got 1\.0"),
    ("grpo.clip_high=-0.1", r"grpo\.clip_high must be a finite number >= 0, got -0\.1"),
    ("grpo.kl_coef=-0.01", r"grpo\.kl_coef must be a finite number >= 0, got -0\.01"),
    ("grpo.adv_eps=0", r"grpo\.adv_eps must be a finite number > 0, got 0\.0"),
    ("grpo.mu=0", r"grpo\.mu must be an integer > 0, got 0"),
    ("grpo.mini_batches=0", r"grpo\.mini_batches must be an integer > 0, got 0"),
    ("grpo.micro_batch_tokens=0", r"grpo\.micro_batch_tokens must be an integer > 0, got 0"),
    ("grpo.sample_every=-2", r"grpo\.sample_every must be an integer >= 0, got -2"),
    ("data.max_prompt_len=0", r"data\.max_prompt_len must be an integer > 0, got 0"),
    ("data.eval_size=0", r"data\.eval_size must be an integer > 0, got 0"),
    ("data.train_size=-3", r"data\.train_size must be an integer > 0, got -3"),
    ("logging.log_every=0", r"logging\.log_every must be an integer >= 1, got 0"),
    ("logging.num_samples=-1", r"logging\.num_samples must be an integer >= 0, got -1"),
    ("logging.profile_step=-1", r"logging\.profile_step must be an integer >= 0, got -1"),
    ("distributed.prefetch=-2", r"distributed\.prefetch must be an integer >= 0, got -2"),
    ("checkpoint.every=-1", r"checkpoint\.every must be an integer >= 0, got -1"),
    ("checkpoint.keep_last=-1", r"checkpoint\.keep_last must be an integer >= 0, got -1"),
    ("seed=-1", r"seed must be an integer >= 0, got -1"),
    ("rewards=[{name: arithmetic, weight: .inf}]", r"rewards\[0\]\.weight must be a finite number, got inf"),
    # choices
    ("on_reward_error=ignore", r"on_reward_error must be one of \['raise', 'zero'\], got 'ignore'"),
    ("model.dtype=float8", r"model\.dtype must be one of \['float32', 'bfloat16', 'float16'\], got 'float8'"),
    ("grpo.loss_type=ppo", r"grpo\.loss_type must be one of \['grpo', 'dapo', .*\], got 'ppo'"),
    ("logging.profile_phase=backward", r"logging\.profile_phase must be one of \['train', 'generate', 'score'\], "
                                       r"got 'backward'"),
    ("distributed.grad_sync=never", r"distributed\.grad_sync must be one of \['every', 'last'\], got 'never'"),
    ("distributed.trade=fast", r"distributed\.trade must be one of \['auto', 'memory', 'communication'\], got 'fast'"),
    # engine parameters (EngineConfig checks its own fields; the section is named)
    ("engine.block_size=12", r"engine\.block_size must be a power of two, got 12"),
    ("engine.max_num_seqs=0", r"engine\.max_num_seqs must be a positive integer, got 0"),
    ("engine.max_num_batched_tokens=-1", r"engine\.max_num_batched_tokens must be a positive integer"),
    ("engine.max_model_len=0", r"engine\.max_model_len must be a positive integer, got 0"),
    ("engine.num_kv_blocks=0", r"engine\.num_kv_blocks must be a positive integer, got 0"),
    ("engine.gpu_memory_fraction=1.5", r"engine\.gpu_memory_fraction must be in \(0, 1\], got 1\.5"),
    ("engine.cpu_kv_cache_gib=0", r"engine\.cpu_kv_cache_gib must be > 0, got 0"),
    ("engine.numerics=bitwise", r"engine\.numerics must be one of \('fast', 'exact'\), got 'bitwise'"),
    ("engine.cuda_graph_batch_sizes=[0]", r"engine\.cuda_graph_batch_sizes\[\] must be a positive integer"),
    ("model.kernel_backend=cuda", r"model\.kernel_backend must be one of \['auto', 'torch', 'triton'\], got 'cuda'"),
]


@pytest.mark.bad_input("config-ranges")
@pytest.mark.parametrize("override,msg", RANGE_CASES, ids=[c[0].split("=")[0] + "=" + c[0].split("=", 1)[1][:12]
                                                           for c in RANGE_CASES])
def test_config_value_out_of_range(override, msg):
    from rlfuse.run.config.run_config import load_config

    expect_error(lambda: load_config(None, [override]), msg, f"--set {override}")


@pytest.mark.bad_input("config-ranges")
def test_config_range_error_names_the_recipe_file(tmp_path):
    from rlfuse.run.config.run_config import load_config

    p = tmp_path / "r.yaml"
    p.write_text("optim:\n  betas: [0.9, 1.5]\n")
    expect_error(lambda: load_config(p), rf"{p}: optim\.betas\[1\] must be in \[0, 1\), got 1\.5",
                 f"recipe {p}: optim: {{betas: [0.9, 1.5]}}")


def test_every_numeric_config_field_has_a_range():
    """A new numeric field without an entry in RANGES fails here (so it is checked at load)."""
    from rlfuse.run.config.io import leaves
    from rlfuse.run.config.run_config import RANGES, RunConfig

    numeric = {x.key for x in leaves(RunConfig) if x.type in ("int", "float", "tuple[float, float]")
               and not x.key.startswith("engine.")}
    listed = {k.split("[")[0] if not k.startswith("rewards") else k.replace("[]", "[]") for k in RANGES}
    # optional knobs with their own checks (None = off): dual_clip, tis_cap, mis/icepop bounds
    own_checks = {"grpo.dual_clip", "grpo.tis_cap", "grpo.mis_bounds", "grpo.icepop_bounds", "grpo.group_size"}
    missing = sorted(numeric - listed - own_checks)
    assert not missing, f"add these to rlfuse.run.config.run_config.RANGES: {missing}"


# ------------------------------------------------------------------ through the CLI: one line, no traceback
def _cli(argv, capsys):
    from rlfuse.cli import main

    rc = main(["--log-level", "WARNING", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def cli_error_line(rc, err, pattern, fed: str):
    """The CLI ended with exit status 2 and one `rlfuse: error:` line matching `pattern`, no
    traceback; records that line."""
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("rlfuse: error:")]
    assert len(lines) == 1 and re.search(pattern, lines[0]), err
    catalog.seen(fed, lines[0])
    return lines[0]


def _tiny_recipe(tmp, **change) -> Path:
    cfg = {
        "model": {"random_init": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                  "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 16,
                                  "max_position_embeddings": 32},
                  "tokenizer": "char", "device": "cpu", "kernel_backend": "torch"},
        "data": {"train": "builtin:arithmetic", "task": {"digits": 1, "ops": "+"}, "train_size": 40,
                 "eval_size": 4, "max_prompt_len": 8},
        "rewards": [{"name": "arithmetic"}],
        "sft": {"steps": 2, "batch_size": 4},
        "grpo": {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 2},
        "engine": {"max_num_seqs": 8},
        "logging": {"run_dir": str(tmp / "run"), "tensorboard": False, "progress": False},
        "checkpoint": {"save_final": True},
    }
    for key, v in change.items():
        section, _, field = key.partition("__")
        if field:
            cfg[section][field] = v
        else:
            cfg[section] = v
    p = tmp / "recipe.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


CLI_CONFIG_CASES = [
    # (recipe changes (section__field), --set overrides, expected error line)
    ({}, ["optim.lr=1e38"], r"--set optim\.lr=1e38: optim\.lr must be in \(0, 1\], got 1e\+38"),
    ({}, ["sft.steps=1.5"], r"--set sft\.steps=1\.5: sft\.steps: expected an integer, got 1\.5"),
    ({}, ["logging.log_every=0"], r"logging\.log_every must be an integer >= 1, got 0"),
    ({"optim": {"betas": [0.9, 1.0]}}, [], r"recipe\.yaml: optim\.betas\[1\] must be in \[0, 1\), got 1\.0"),
    ({}, ["engine.block_size=24"], r"engine\.block_size must be a power of two, got 24"),
    ({}, ["engine.max_model_len=8"], r"data\.max_prompt_len \(8\) does not fit in the model context \(8 tokens: "
                                     r"engine\.max_model_len.*expected at most 7"),
    ({}, ["data.max_prompt_len=40"], r"data\.max_prompt_len \(40\) does not fit in the model context \(32 tokens"),
    ({}, ["model.device=tpu"], r"model\.device: 'tpu' is not a device; expected auto, cpu, cuda or cuda:N"),
    ({}, ["model.device=meta"], r"model\.device: 'meta' is not supported; expected auto, cpu, cuda or cuda:N"),
    ({"model": {"path": "no/such/model_dir", "device": "cpu"}}, [],
     r"model\.path: .*no/such/model_dir: no such model folder \(expected an HF folder with config\.json"),
    ({"model": {"path": "recipe.yaml", "device": "cpu"}}, [],
     r"model\.path: .*recipe\.yaml is a file; expected an HF model folder"),
    ({"model": {"path": "m", "tokenizer": "tok_dir", "device": "cpu"}}, [],
     r"model\.tokenizer: .*tok_dir: no such model folder"),
    ({"data": {"train": "absent.jsonl"}}, [], r"absent\.jsonl: no such data file"),
    ({}, ["sft.overlong=trim"], r"sft\.overlong must be one of \['truncate', 'drop'\], got 'trim'"),
    ({}, ["model.random_init.head_dim=24", "model.kernel_backend=triton"],
     r"model\.kernel_backend: 'triton' on cpu runs only under Triton's interpreter|model\.random_init: field "
     r"'head_dim' is 24; the Triton attention kernels need"),
]


@pytest.mark.bad_input("cli")
@pytest.mark.parametrize("change,over,msg", CLI_CONFIG_CASES, ids=[
    "lr-overflow", "set-type-error-blames-the-override", "log-every-zero", "beta-one-in-file", "engine-block-size", "engine-context-below-prompt",
    "max-prompt-len-over-model", "device-unknown", "device-meta", "model-folder-missing", "model-path-a-file",
    "tokenizer-folder-missing", "relative-data-file-missing", "overlong-choice", "head-dim-triton"])
def test_cli_config_errors(tmp_path, capsys, change, over, msg):
    argv = ["sft", str(_tiny_recipe(tmp_path, **change)), *[a for o in over for a in ("--set", o)]]
    rc, _, err = _cli(argv, capsys)
    recipe = ", ".join(f"{k}: {json.dumps(v)}" for section in change.values() for k, v in section.items())
    line = cli_error_line(rc, err, msg, f"rlfuse {' '.join(argv)}" + (f" (the recipe with {recipe})" if change else ""))
    if "absent.jsonl" in msg:  # a relative path in a recipe resolves against the recipe's folder
        assert str(tmp_path / "absent.jsonl") in line


@pytest.mark.bad_input("config-ranges")
def test_greedy_grpo_is_refused_with_the_reason():
    from rlfuse.run.config import load_config

    expect_error(lambda: load_config(None, ["grpo.temperature=0"]),
                 r"grpo\.temperature must be > 0, got 0: greedy rollouts make every completion of a group the same, "
                 r"so every advantage is 0", "--set grpo.temperature=0")


SAMPLING_CASES = [
    ("temperature-inf", {"temperature": float("inf")},
     r"SamplingParams\.temperature must be a finite number >= 0 \(0 = greedy\), got inf"),
    ("temperature-nan", {"temperature": float("nan")}, r"SamplingParams\.temperature must be a finite number >= 0"),
    ("stop-token-ids-an-int", {"stop_token_ids": 5},
     r"SamplingParams\.stop_token_ids must be a list of token ids \(e\.g\. \[5\]\), got int 5"),
    ("adapter-negative", {"adapter": -1},
     r"SamplingParams\.adapter must be None \(the base model\) or a bank slot >= 0, got -1"),
]


@pytest.mark.bad_input("config-ranges")
@pytest.mark.parametrize("kw,msg", [c[1:] for c in SAMPLING_CASES], ids=[c[0] for c in SAMPLING_CASES])
def test_bad_sampling_params(kw, msg):
    from rlfuse.engine import SamplingParams

    expect_error(lambda: SamplingParams(**kw), msg, f"SamplingParams({', '.join(f'{k}={v!r}' for k, v in kw.items())})")


@pytest.mark.bad_input("config-ranges")
def test_grpo_max_new_tokens_over_the_room_a_prompt_leaves_is_warned(tmp_path, capsys, caplog):
    """Issue 37: max_new_tokens 256 on a 64-token model learned nothing, silently."""
    recipe = _tiny_recipe(tmp_path)
    with caplog.at_level(logging.WARNING):
        rc, _, err = _cli(["grpo", str(recipe), "--set", "grpo.max_new_tokens=30"], capsys)
    assert rc == 0, err
    expect_reported(caplog, "grpo.max_new_tokens=30 exceeds the room a prompt of data.max_prompt_len=8 tokens "
                    "leaves in the 32-token context (24)", "rlfuse grpo with grpo.max_new_tokens=30, "
                    "data.max_prompt_len=8 and a 32-token model context", count=1)


@pytest.mark.bad_input("config-ranges")
def test_grpo_max_new_tokens_over_the_context_is_warned(tmp_path, capsys, caplog):
    recipe = _tiny_recipe(tmp_path)
    with caplog.at_level(logging.WARNING):
        rc, _, err = _cli(["grpo", str(recipe), "--set", "grpo.max_new_tokens=40"], capsys)
    assert rc == 0, err
    expect_reported(caplog, "grpo.max_new_tokens=40 is not below the model context (32 tokens",
                    "rlfuse grpo with grpo.max_new_tokens=40 and a 32-token model context", count=1)


@pytest.mark.bad_input("cli")
def test_cli_recipe_with_a_key_given_twice(tmp_path, capsys):
    recipe = _tiny_recipe(tmp_path)
    text = recipe.read_text() + "optim:\n  warmup_steps: 2\n"
    recipe.write_text("optim:\n  lr: 0.001\n" + text)
    n = len(text.splitlines()) + 1  # the second optim: is the file's second-to-last line
    _cli_case(tmp_path, capsys, ["sft", str(recipe)], rf"recipe\.yaml:{n}: key 'optim' is given twice in one mapping "
              rf"\(first at line 1\); YAML would keep only the last one: merge the two into one",
              " (the recipe with two optim: blocks, lines 1 and %d)" % n)


def _cli_case(tmp_path, capsys, argv, pattern, fed=""):
    """Runs `rlfuse ARGV` expecting one error line; records it with the command line."""
    rc, _, err = _cli(argv, capsys)
    return cli_error_line(rc, err, pattern, f"rlfuse {' '.join(argv)}{fed}")


@pytest.mark.bad_input("kernels-devices")
@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA on a machine without it")
@pytest.mark.parametrize("device", ["cuda", "cuda:3"])
def test_cli_device_the_machine_does_not_have(tmp_path, capsys, device):
    _cli_case(tmp_path, capsys, ["sft", str(_tiny_recipe(tmp_path)), "--set", f"model.device={device}"],
              rf"model\.device: '{device}' asked for, but this machine has no usable CUDA device.*"
              r"use model\.device: cpu", " (on a machine without CUDA)")


@pytest.mark.bad_input("kernels-devices")
@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA on a machine without it")
def test_cli_generate_on_a_device_the_machine_does_not_have(tmp_path, capsys):
    _cli_case(tmp_path, capsys, ["generate", str(tmp_path), "--prompt", "1+1=", "--device", "cuda"],
              r"--device: 'cuda' asked for, but this machine has no usable CUDA device.*use --device cpu",
              " (on a machine without CUDA)")


@pytest.mark.bad_input("cli")
@pytest.mark.parametrize("threads", ["0", "-1"])
def test_cli_threads_not_positive(tmp_path, capsys, threads):
    _cli_case(tmp_path, capsys, ["sft", str(_tiny_recipe(tmp_path)), "--threads", threads],
              rf"--threads: expected an integer >= 1 \(torch CPU threads\), got {threads}")


def _hf_folder(tmp_path, vocab_size: int = 16) -> Path:
    """A tiny HF folder: random weights and a character tokenizer of ALPHA (47 ids)."""
    from rlfuse.model.weights import save_model

    cfg = ModelConfig(model_type="qwen3", vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=32, qk_norm=True)
    model = CausalLM(cfg)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    folder = tmp_path / "m"
    tok_dir = char_tokenizer(ALPHA).save(tmp_path / "tok")
    save_model(model, folder, tokenizer_dir=tok_dir)
    return folder


@pytest.mark.bad_input("model-config")
def test_truncated_weights_file_is_named_incomplete(tmp_path, capsys):
    folder = _hf_folder(tmp_path, vocab_size=48)
    _truncate(folder / "model.safetensors", 2000)
    _cli_case(tmp_path, capsys, ["generate", str(folder), "--prompt", "1+1=", "--device", "cpu"],
              r"m/model\.safetensors: incomplete or not a safetensors file \(2000 bytes; .*\): it was probably cut "
              r"short", " (model.safetensors cut to 2000 bytes)")


@pytest.mark.bad_input("model-config")
def test_vocab_size_below_the_tokenizer_names_both(tmp_path, capsys):
    folder = _hf_folder(tmp_path, vocab_size=16)
    _cli_case(tmp_path, capsys, ["generate", str(folder), "--prompt", "1+1=", "--device", "cpu"],
              r"m/config\.json: vocab_size is 16, smaller than the tokenizer's 47 ids: ids 16\.\.46 would index "
              r"past the embedding", " (config.json vocab_size 16, tokenizer.json with 47 ids)")
    expect_error(lambda: build_model_spec(vocab_size=8), r"model\.random_init: vocab_size is 8, smaller than the "
                 r"tokenizer's 47 ids", "model.random_init.vocab_size=8 with a 47-id tokenizer")


def build_model_spec(**random_init):
    from rlfuse.run.build import build_model
    from rlfuse.run.config.sections import ModelSpec

    spec = ModelSpec(random_init={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                  "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 16, **random_init},
                     kernel_backend="torch")
    return build_model(spec, char_tokenizer(ALPHA), torch.device("cpu"))


@pytest.mark.bad_input("cli")
def test_model_path_at_a_training_checkpoint_is_accepted(sft_run, capsys, caplog):
    recipe, run = sft_run
    ckpt = run / "checkpoints" / "step_000002"
    argv = ["sft", str(recipe), "--run-dir", str(run.parent / "run2"), "--set", f"model.path={ckpt}",
            "--set", "model.random_init=null", "--set", "model.tokenizer="]
    with caplog.at_level(logging.INFO):
        rc, _, err = _cli(argv, capsys)
    assert rc == 0, err
    expect_reported(caplog, f"from {ckpt / 'model'}", f"rlfuse sft with model.path={ckpt} (a training checkpoint, "
                                                       f"weights in its model/)", count=1)


@pytest.mark.bad_input("kernels-devices")
def test_cli_triton_backend_on_cpu_without_the_interpreter(tmp_path, capsys, monkeypatch):
    from rlfuse.run import build

    monkeypatch.setattr(build, "triton_interpreting", lambda: False)
    _cli_case(tmp_path, capsys, ["sft", str(_tiny_recipe(tmp_path)), "--set", "model.kernel_backend=triton"],
              r"model\.kernel_backend: 'triton' on cpu runs only under Triton's interpreter "
              r"\(TRITON_INTERPRET=1 .*use model\.kernel_backend: auto or torch on cpu",
              " (on a CPU, TRITON_INTERPRET unset)")


@pytest.mark.bad_input("cli")
@pytest.mark.parametrize("argv", [["check", "--tiny", "--threads", "0"], ["serve", "nowhere", "--threads", "0"],
                                  ["generate", "nowhere", "--prompt", "x", "--threads", "0"]],
                         ids=["check", "serve", "generate"])
def test_threads_is_checked_by_the_inference_commands(capsys, argv):
    """check, serve and generate had no --threads (issue 37: their speed swung with torch's default)."""
    rc, _, err = _cli(argv, capsys)
    cli_error_line(rc, err, r"--threads: expected an integer >= 1 \(torch CPU threads\), got 0",
                   f"rlfuse {' '.join(argv)}")


@pytest.mark.bad_input("cli")
def test_cli_bad_log_level(capsys):
    from rlfuse.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--log-level", "LOUD", "report", "."])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = [ln for ln in err.splitlines() if ln.startswith("rlfuse: error:")]
    assert line == "rlfuse: error: --log-level: 'LOUD' is not a level (DEBUG, INFO, WARNING, ERROR)", err
    catalog.seen("rlfuse --log-level LOUD report .", line)


CLI_USAGE_CASES = [
    # (id, argv ({tmp}: the case's folder, holding an empty p.txt), expected error line)
    ("unknown-config-key", ["grpo", "arith_grpo", "--set", "grpo.clip=0.3"],
     r"override 'grpo\.clip': unknown key 'clip' in grpo; valid keys: .*clip_low, clip_high"),
    ("unknown-ppo-key", ["ppo", "arith_ppo", "--set", "ppo.gae=0.3"],
     r"override 'ppo\.gae': unknown key 'gae' in ppo; valid keys: .*gamma, lam"),
    ("dpo-loss-choice", ["dpo", "arith_dpo", "--set", "dpo.loss=hinge"],
     r"--set dpo\.loss=hinge: dpo\.loss must be one of \['sigmoid', 'ipo', 'conservative'\], got 'hinge'"),
    ("unknown-recipe", ["sft", "no_such_recipe"], r"config 'no_such_recipe': no such file and no built-in recipe of "
                                                  r"that name \(built-in recipes: .*arith_grpo, .*arith_sft"),
    ("check-without-a-model", ["check", "--out", "{tmp}"],
     r"error: check: give one of MODEL_DIR \(an HF model folder\), --tiny \(a small random model\) or --shape "
     r"\(random weights at a published shape\); got none"),
    ("check-with-both-models", ["check", "{tmp}", "--tiny", "--out", "{tmp}"], r"got MODEL_DIR and --tiny"),
    ("check-empty-prompts-file", ["check", "--tiny", "--prompts", "{tmp}/p.txt", "--out", "{tmp}"],
     r"p\.txt: no prompts \(expected one prompt per line\)"),
]


@pytest.mark.bad_input("cli")
@pytest.mark.parametrize("argv,msg", [c[1:] for c in CLI_USAGE_CASES], ids=[c[0] for c in CLI_USAGE_CASES])
def test_cli_usage_errors(tmp_path, capsys, argv, msg):
    (tmp_path / "p.txt").write_text("\n")
    _cli_case(tmp_path, capsys, [a.format(tmp=tmp_path) for a in argv], msg)


@pytest.mark.bad_input("cli")
def test_cli_os_error_is_one_line(tmp_path, capsys, monkeypatch):
    """A file-system failure no check foresaw: the path and what happened, on one line."""
    recipe = _tiny_recipe(tmp_path)
    _fail_with(monkeypatch, Path, "mkdir", PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "run")))
    _cli_case(tmp_path, capsys, ["sft", str(recipe)], rf"^rlfuse: error: {tmp_path / 'run'}: Permission denied$",
              " (creating the run folder fails: PermissionError EACCES)")


@pytest.mark.bad_input("cli")
def test_cli_run_dir_is_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    _cli_case(tmp_path, capsys, ["sft", str(_tiny_recipe(tmp_path)), "--run-dir", str(tmp_path / "afile")],
              r"logging\.run_dir: .*afile is a file; expected a folder", " (afile is a file)")


@pytest.mark.bad_input("cli")
def test_cli_run_dir_inside_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    _cli_case(tmp_path, capsys, ["sft", str(_tiny_recipe(tmp_path)), "--run-dir", str(tmp_path / "afile" / "run")],
              rf"logging\.run_dir: {tmp_path / 'afile' / 'run'} cannot be created: {tmp_path / 'afile'} is a file; "
              r"expected a folder", " (afile is a file)")


_FOLDER = r"expected a folder \(an existing one, or a path that does not exist yet\)"
OUTPUT_FOLDER_CASES = [  # every command that writes into a folder it is given (rlfuse.run.make_folder)
    ("demo", lambda t, f: ["demo", "--size", "ci", "--run-dir", f], rf"--run-dir: .*afile is a file; {_FOLDER}"),
    ("demo-inside-a-file", lambda t, f: ["demo", "--size", "ci", "--run-dir", f"{f}/demo"],
     rf"--run-dir: .*afile/demo cannot be created: .*afile is a file; {_FOLDER}"),
    ("check", lambda t, f: ["check", "--tiny", "--out", f], rf"--out: .*afile is a file; {_FOLDER}"),
    ("bench", lambda t, f: ["bench", "generate", "--small", "--out", f], rf"--out: .*afile is a file; {_FOLDER}"),
    ("eval", lambda t, f: ["eval", str(_tiny_recipe(t)), "--run-dir", f],
     rf"logging\.run_dir: .*afile is a file; {_FOLDER}"),
]


@pytest.mark.bad_input("cli")
@pytest.mark.parametrize("argv,msg", [c[1:] for c in OUTPUT_FOLDER_CASES], ids=[c[0] for c in OUTPUT_FOLDER_CASES])
def test_cli_output_folder_is_a_file(tmp_path, capsys, argv, msg):
    (tmp_path / "afile").write_text("x")
    threads = torch.get_num_threads()  # the demo sets this process's torch threads before its folder
    try:
        _cli_case(tmp_path, capsys, argv(tmp_path, str(tmp_path / "afile")), msg, " (afile is a file)")
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.bad_input("cli")
def test_report_folder_is_a_file(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "stage": "sft", "loss": 1.0}\n')
    (tmp_path / "report").write_text("x")
    _cli_case(tmp_path, capsys, ["report", str(tmp_path)],
              r"rlfuse report: .*report is a file; expected a folder for the plots", " (RUN_DIR/report is a file)")


# ------------------------------------------------------------------ run folders: start, resume, overwrite
@pytest.fixture
def sft_run(tmp_path, capsys):
    recipe = _tiny_recipe(tmp_path)
    rc, out, err = _cli(["sft", str(recipe)], capsys)
    assert rc == 0, err
    return recipe, tmp_path / "run"


@pytest.mark.bad_input("run-folders")
def test_run_folder_with_a_run_needs_resume_or_overwrite(sft_run, capsys):
    recipe, run = sft_run
    before = sorted(p.name for p in run.iterdir())
    rc, _, err = _cli(["sft", str(recipe)], capsys)
    cli_error_line(rc, err, rf"{run}: already holds a sft run \(metrics\.jsonl, 1 checkpoint, final/\); continue "
                             r"it with --resume, replace it with --overwrite, or choose another --run-dir "
                             r"\(nothing was changed\)", f"rlfuse sft {recipe} again, over a finished run")
    assert sorted(p.name for p in run.iterdir()) == before


@pytest.mark.bad_input("run-folders")
def test_resume_in_a_folder_of_another_kind(sft_run, capsys):
    recipe, run = sft_run
    rc, _, err = _cli(["grpo", str(recipe), "--resume"], capsys)
    cli_error_line(rc, err, rf"--resume: {run} holds a sft run, not a grpo run; resume it with `rlfuse sft`",
                   f"rlfuse grpo {recipe} --resume, the run folder holding an sft run")


@pytest.mark.bad_input("run-folders")
@pytest.mark.parametrize("over,shown", [
    ("seed=3", r"seed: 0 -> 3"),
    ("data.train_size=30", r"data\.train_size: 40 -> 30"),
    ("model.dtype=bfloat16", r"model\.dtype: 'float32' -> 'bfloat16'"),
    ("grpo.loss_type=dapo", r"grpo\.loss_type: 'grpo' -> 'dapo'"),
], ids=["seed", "data", "model", "algorithm"])
def test_resume_refuses_changes_that_break_it(sft_run, capsys, over, shown):
    recipe, run = sft_run
    rc, _, err = _cli(["sft", str(recipe), "--resume", "--set", over], capsys)
    cli_error_line(rc, err, rf"--resume: the config differs from {run / 'config.yaml'} in fields a resumed run "
                            rf"cannot change \({shown}\); undo the change, start a new --run-dir, or pass --force",
                   f"rlfuse sft {recipe} --resume --set {over}, over a finished run")


@pytest.mark.bad_input("run-folders")
def test_resume_force_and_harmless_changes_are_warned(sft_run, capsys, caplog):
    recipe, run = sft_run
    argv = ["sft", str(recipe), "--resume", "--force", "--set", "seed=3", "--set", "sft.steps=3", "--set",
            "optim.lr=0.002"]
    with caplog.at_level(logging.WARNING):
        rc, out, err = _cli(argv, capsys)
    assert rc == 0, err
    fed = f"rlfuse {' '.join(argv)}, over a finished 2-step run"
    for text in ("--resume --force: resuming with changed seed: 0 -> 3", "--resume: optim.lr changed from 1e-05 to "
                 "0.002", "--resume: sft.steps changed from 2 to 3"):
        expect_reported(caplog, text, fed, count=1)
    assert "sft done: 3 steps" in out  # resumed at step 2, one more step


@pytest.mark.bad_input("run-folders")
def test_overwrite_replaces_the_run_and_says_what_it_removed(sft_run, capsys, caplog):
    recipe, run = sft_run
    (run / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING):
        rc, _, err = _cli(["sft", str(recipe), "--overwrite"], capsys)
    assert rc == 0, err
    expect_reported(caplog, "--overwrite: removed the previous run's metrics.jsonl, checkpoints, final, config.yaml, "
                            "run.json", f"rlfuse sft {recipe} --overwrite, over a finished run (and a notes.txt of "
                                        "the user's)", count=1)
    assert (run / "notes.txt").read_text() == "mine"  # only what rlfuse writes is removed


@pytest.mark.bad_input("run-folders")
def test_resume_and_overwrite_together(sft_run, capsys):
    recipe, run = sft_run
    rc, _, err = _cli(["sft", str(recipe), "--resume", "--overwrite"], capsys)
    cli_error_line(rc, err, r"--resume and --overwrite contradict each other",
                   f"rlfuse sft {recipe} --resume --overwrite")


@pytest.mark.bad_input("run-folders")
def test_resume_with_nothing_to_resume_says_so(tmp_path, capsys, caplog):
    recipe = _tiny_recipe(tmp_path)
    with caplog.at_level(logging.WARNING):
        rc, _, err = _cli(["sft", str(recipe), "--resume"], capsys)
    assert rc == 0, err
    expect_reported(caplog, "nothing to resume (no complete checkpoint in", f"rlfuse sft {recipe} --resume, "
                                                                            "no run folder yet", count=1)


@pytest.mark.bad_input("run-folders")
def test_a_failed_start_does_not_block_the_next(tmp_path, capsys):
    recipe = _tiny_recipe(tmp_path)
    rc, _, err = _cli(["sft", str(recipe), "--set", "data.train=absent.jsonl"], capsys)
    cli_error_line(rc, err, r"error: absent\.jsonl: no such data file \(a relative path: looked in ",
                   f"rlfuse sft {recipe} --set data.train=absent.jsonl, then the same without the bad file")
    rc, _, err = _cli(["sft", str(recipe)], capsys)  # only config.yaml was left: not a run
    assert rc == 0, err


def _lock_of(pid: int, started: str = "2026-01-01T00:00:00+00:00") -> str:
    import socket

    return json.dumps({"pid": pid, "host": socket.gethostname(), "started": started})


@pytest.mark.bad_input("run-folders")
def test_a_second_run_on_a_held_folder_is_refused(sft_run, capsys):
    import os
    import socket

    recipe, run = sft_run
    assert not (run / "run.lock").exists()  # the finished run let go of it
    (run / "run.lock").write_text(_lock_of(os.getpid()))  # a live process: this one, as a stand-in
    before = sorted(p.name for p in run.iterdir())
    rc, _, err = _cli(["sft", str(recipe), "--resume"], capsys)
    cli_error_line(rc, err, rf"{run}: another run is using this run folder \(pid {os.getpid()} on host "
                             rf"{re.escape(socket.gethostname())}, started 2026-01-01T00:00:00\+00:00\); wait for it",
                   f"rlfuse sft {recipe} --resume while another run holds {run}")
    assert sorted(p.name for p in run.iterdir()) == before


@pytest.mark.bad_input("run-folders")
def test_a_stale_lock_is_taken_over_and_said(sft_run, capsys, caplog):
    import subprocess
    import sys

    recipe, run = sft_run
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid is free now
    (run / "run.lock").write_text(_lock_of(gone.pid))
    with caplog.at_level(logging.WARNING):
        rc, _, err = _cli(["sft", str(recipe), "--overwrite"], capsys)
    assert rc == 0, err
    expect_reported(caplog, "taking over the lock of a run that is gone", f"rlfuse sft {recipe} --overwrite over the "
                    f"lock of a process that exited", count=1)
    assert not (run / "run.lock").exists()


def _signal_at_step(monkeypatch, at: int, *signums):
    """SFT steps that send this process `signums` during step `at` (0-based), as a user or
    a cluster would."""
    import os

    from rlfuse.train.sft import SFTStep

    step = SFTStep.step

    def step_then_signal(self, s):
        m = step(self, s)
        if s == at:
            for sig in signums:
                os.kill(os.getpid(), sig)
        return m
    monkeypatch.setattr(SFTStep, "step", step_then_signal)


@pytest.mark.bad_input("run-folders")
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_stops_at_a_step_with_a_checkpoint_and_the_resume_command(tmp_path, capsys, monkeypatch, signame):
    import shlex
    import signal

    sig = getattr(signal, signame)
    recipe = _tiny_recipe(tmp_path)
    _signal_at_step(monkeypatch, 1, sig)
    before = signal.getsignal(signal.SIGINT)
    argv = ["sft", str(recipe), "--set", "sft.steps=4"]
    rc, _, err = _cli(argv, capsys)
    assert rc == 128 + sig and signal.getsignal(signal.SIGINT) is before, err
    assert f"{signame} received: stopping after the current step" in err and "Traceback" not in err
    line = next(ln for ln in err.splitlines() if ln.startswith("rlfuse: stopped"))
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    assert line == (f"rlfuse: stopped by {signame} after step 2; checkpoint {ckpt}; continue with: "
                    f"{shlex.join(['rlfuse', '--log-level', 'WARNING', *argv, '--resume'])}"), line
    catalog.seen(f"{signame} during step 2 of 4 of rlfuse {' '.join(argv)} (exit status {rc})", line)
    assert (ckpt / "COMPLETE").is_file() and not (tmp_path / "run" / "run.lock").exists()
    monkeypatch.undo()
    rc, out, err = _cli(shlex.split(line.split("continue with: ")[1])[3:], capsys)
    assert rc == 0, err
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("stage") == "sft"] == [1, 2, 3, 4]


def test_a_second_signal_stops_at_once(tmp_path):
    """The second signal ends the process before the step is over, without a checkpoint
    (a process of its own: it leaves through os._exit)."""
    import subprocess
    import sys

    recipe = _tiny_recipe(tmp_path)
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import pytest
        from test_bad_inputs import _signal_at_step
        mp = pytest.MonkeyPatch()
        _signal_at_step(mp, 0, signal.SIGINT, signal.SIGINT)
        from rlfuse.cli import main
        sys.exit(main(["--log-level", "WARNING", "sft", {str(recipe)!r}]))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 130, r.stderr
    assert r.stderr.rstrip().endswith("rlfuse: second SIGINT: stopping now, without a checkpoint (the last complete "
                                      "checkpoint is kept)"), r.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() and "Traceback" not in r.stderr


@pytest.mark.bad_input("run-folders")
def test_a_demo_rerun_replaces_the_previous_demo_and_says_so(tmp_path, caplog):
    from rlfuse.cli.demo import replace_previous_demo

    root = tmp_path / "demo"
    for stage in ("sft", "grpo"):
        (root / stage / "tb").mkdir(parents=True)
        (root / stage / "metrics.jsonl").write_text('{"step": 1, "stage": "%s", "loss": 1.0}\n' % stage)
    (root / "report").mkdir()
    (root / "report" / "index.html").write_text("old")
    (root / "demo.json").write_text("{}")
    (root / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING):
        replace_previous_demo(root)
    assert sorted(p.name for p in root.rglob("*")) == ["grpo", "notes.txt", "sft"]
    expect_reported(caplog, "a re-run replaces the previous demo", f"rlfuse demo again over {root} (sft/, grpo/ with "
                    "metrics and tb/, report/, demo.json)", count=4)


@pytest.mark.bad_input("run-folders")
def test_a_second_demo_on_a_held_folder_is_refused(tmp_path, capsys, monkeypatch):
    """`rlfuse demo` takes its folder's run lock before it replaces a previous demo, holds
    it while the demo runs, and lets go at the end."""
    import os
    import socket

    import rlfuse.cli.demo as demo_cli

    root = tmp_path / "demo"
    (root / "grpo").mkdir(parents=True)
    (root / "grpo" / "metrics.jsonl").write_text('{"step": 1, "stage": "grpo", "loss": 1.0}\n')
    (root / "demo.json").write_text("{}")
    (root / "run.lock").write_text(_lock_of(os.getpid()))  # a live process: this one, as a stand-in
    before = sorted(str(p) for p in root.rglob("*"))
    rc, _, err = _cli(["demo", "--run-dir", str(root), "--size", "ci"], capsys)
    cli_error_line(rc, err, rf"{root}: another run is using this run folder \(pid {os.getpid()} on host "
                             rf"{re.escape(socket.gethostname())}, started 2026-01-01T00:00:00\+00:00\); wait for it",
                   f"rlfuse demo --run-dir {root} while another demo holds it")
    assert sorted(str(p) for p in root.rglob("*")) == before  # the previous demo is untouched
    (root / "run.lock").unlink()
    held = []
    monkeypatch.setattr(demo_cli, "run_demo", lambda size, run_dir, **kw: held.append(
        json.loads((Path(run_dir) / "run.lock").read_text())["pid"]) or {"accuracy": 1.0})
    rc, _, err = _cli(["demo", "--run-dir", str(root), "--size", "ci"], capsys)
    assert rc == 0, err
    assert held == [os.getpid()] and not (root / "run.lock").exists()
    assert json.loads((root / "demo.json").read_text()) == {"accuracy": 1.0}


def test_run_folders_get_normal_permissions(sft_run):
    import os
    import stat

    _, run = sft_run
    umask = os.umask(0)
    os.umask(umask)
    for p in (run / "final", run / "checkpoints" / "step_000002" / "model"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o777 & ~umask, p
    files = [f for f in run.rglob("*") if f.is_file()]
    assert any(f.suffix == ".safetensors" for f in files)
    for f in files:  # safetensors' own writer makes 0600 files
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f


# ------------------------------------------------------------------ non-finite numbers in the training step
@pytest.mark.bad_input("non-finite")
def test_sft_step_with_a_non_finite_loss_is_skipped_and_counted(tmp_path, monkeypatch, caplog):
    from train_setup import tiny_cfg, tiny_session

    from rlfuse.data.prompts import PromptStream
    from rlfuse.train import sft as sft_mod
    from rlfuse.train.loop import make_optimizer

    cfg = tiny_cfg(tmp_path, "optim.max_nonfinite_steps=2")
    ses = tiny_session(cfg, need_target=True)
    ex = build_sft_examples(ses.train_rows, ses.tokenizer, cfg.data, cfg.sft.max_seq_len)[:4]
    opt = make_optimizer(ses.model, cfg)
    tr = sft_mod.SFTStep(cfg, ses.model, opt, PromptStream(ex))
    before = {k: v.clone() for k, v in ses.model.state_dict().items()}
    real = sft_mod.token_logprobs
    monkeypatch.setattr(sft_mod, "token_logprobs", lambda *a, **k: real(*a, **k) * float("nan"))
    m = tr.train_step(ex, 0)
    assert m["optim/skipped_steps"] == 1.0 and opt.step_count == 0
    assert all(torch.equal(before[k], v) for k, v in ses.model.state_dict().items())
    assert tr.state_dict()["nonfinite"] == {"consecutive": 1, "total_skipped": 1}
    fed = "an SFT loss of NaN in 2 steps in a row, optim.max_nonfinite_steps=2"
    expect_reported(caplog, "sft step 1: loss nan, grad norm nan: not finite; optimizer step skipped", fed, count=1)
    expect_error(lambda: tr.train_step(ex, 1), r"sft step 2: 2 optimizer steps in a row had a non-finite loss or "
                                                r"gradient norm .*the limit is 2", fed)


@pytest.mark.bad_input("non-finite")
def test_grpo_step_with_a_non_finite_loss_is_skipped_and_counted(tmp_path, monkeypatch, caplog):
    from train_setup import tiny_cfg, tiny_session

    from rlfuse.data.prompts import PromptStream, build_prompts
    from rlfuse.train import grpo as grpo_mod
    from rlfuse.train import grpo_update
    from rlfuse.train.loop import make_optimizer

    cfg = tiny_cfg(tmp_path)
    ses = tiny_session(cfg)
    stream = PromptStream(build_prompts(ses.train_rows, ses.tokenizer, cfg.data))
    tr = grpo_mod.GRPOStep(cfg, ses.model, ses.sampler, ses.rewards(), stream, make_optimizer(ses.model, cfg))
    before = {k: v.clone() for k, v in ses.model.state_dict().items()}
    real = grpo_update.kernel_policy_loss
    monkeypatch.setattr(grpo_update, "kernel_policy_loss",
                        lambda *a, **k: (lambda r: (r[0] * float("nan"), r[1]))(real(*a, **k)))
    m = tr.step(0)
    assert m["optim/skipped_steps"] == 1.0 and tr.optimizer.step_count == 0
    assert all(torch.equal(before[k], v) for k, v in ses.model.state_dict().items())
    expect_reported(caplog, "not finite; optimizer step skipped", "a GRPO policy loss of NaN in one step", count=1)


# ------------------------------------------------------------------ LoRA adapters
LORA_CONFIG_CASES = [
    ("model.lora.rank=0", r": model\.lora\.rank must be a positive integer, got 0"),
    ("model.lora.rank=2.5", r"model\.lora\.rank: expected an integer, got 2\.5"),
    ("model.lora.alpha=0", r": model\.lora\.alpha must be a positive number, got 0\.0"),
    ("model.lora.alpha=.nan", r": model\.lora\.alpha must be a positive number, got nan"),
    ("model.lora.dropout=1.0", r": model\.lora\.dropout must be a number in \[0, 1\), got 1\.0"),
    ("model.lora.targets=[q_proj, lm_head]", r": model\.lora\.targets: unknown projection\(s\) \['lm_head'\]; valid: "
                                             r"\['q_proj', .*'out_proj'\] or 'all-linear'"),
    ("model.lora.targets=[]", r": model\.lora\.targets must be 'all-linear' or a non-empty list of \[.*\], got \(\)"),
    ("model.lora.targets=qkv", r": model\.lora\.targets must be 'all-linear' or a list of \[.*\], got 'qkv'"),
    ("model.lora.targets=[q_proj, q_proj]", r": model\.lora\.targets lists a projection twice: \['q_proj', 'q_proj'\]"),
    ("model.lora.export_merged=maybe", r"model\.lora\.export_merged: expected true or false, got 'maybe'"),
    ("model.lora.path=3", r"model\.lora\.path: expected a string, got 3"),
    ("model.lora=8", r"model\.lora: expected a mapping, got int 8"),
]


@pytest.mark.bad_input("lora")
@pytest.mark.parametrize("override,msg", LORA_CONFIG_CASES, ids=[c[0].removeprefix("model.lora.")
                                                                 for c in LORA_CONFIG_CASES])
def test_lora_config_value(override, msg):
    from rlfuse.run.config.run_config import load_config

    expect_error(lambda: load_config(None, [override]), msg, f"--set {override}")


def _lora_model(layers: int = 1, hidden: int = 16):
    cfg = ModelConfig(model_type="qwen3", qk_norm=True, vocab_size=16, hidden_size=hidden, intermediate_size=32,
                      num_hidden_layers=layers, num_attention_heads=1, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=32)
    return CausalLM(cfg)


def _adapter(tmp, name="a", rank=2, layers=1, hidden=16, targets="all-linear") -> Path:
    from rlfuse.model.lora import LoRAConfig, attach_lora
    from rlfuse.model.lora_peft import save_peft_adapter

    model = _lora_model(layers, hidden)
    attach_lora(model, LoRAConfig(rank=rank, targets=targets))
    return save_peft_adapter(model, tmp / name)


def _edit_json(path: Path, **change):
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))


def _rename_tensor(folder: Path, old: str, new: str):
    from safetensors.torch import load_file, save_file

    f = folder / "adapter_model.safetensors"
    t = load_file(f)
    t[new] = t.pop(old)
    save_file(t, f)


_Q = "base_model.model.model.layers.0.self_attn.q_proj"
LORA_FOLDER_CASES = [
    # (id, what is fed, damage(tmp) -> the adapter folder, expected error)
    ("folder-missing", "model.lora.path: no/such/adapter", lambda t: t / "no" / "such" / "adapter",
     r"model\.lora\.path .*no/such/adapter: no such folder \(a PEFT LoRA adapter folder holds adapter_config\.json "
     r"and adapter_model\.safetensors\)"),
    ("path-a-file", "model.lora.path: a file", lambda t: (t / "f.txt", (t / "f.txt").write_text("x"))[0],
     r"model\.lora\.path .*f\.txt: is a file \(a PEFT LoRA adapter folder holds"),
    ("no-weights", "an adapter folder without adapter_model.safetensors",
     lambda t: (a := _adapter(t), (a / "adapter_model.safetensors").unlink())[0],
     r"model\.lora\.path .*a: no adapter_model\.safetensors \(a PEFT LoRA adapter folder holds"),
    ("config-not-json", "adapter_config.json: {r: 2",
     lambda t: (a := _adapter(t), (a / "adapter_config.json").write_text("{r: 2"))[0],
     r"adapter_config\.json: not valid JSON \(Expecting property name enclosed in double quotes"),
    ("not-lora", "adapter_config.json with peft_type PROMPT_TUNING",
     lambda t: (a := _adapter(t), _edit_json(a / "adapter_config.json", peft_type="PROMPT_TUNING"))[0],
     r"adapter_config\.json: peft_type must be 'LORA', got 'PROMPT_TUNING'"),
    ("dora", "adapter_config.json with use_dora: true",
     lambda t: (a := _adapter(t), _edit_json(a / "adapter_config.json", use_dora=True))[0],
     r"adapter_config\.json: use_dora = True is not supported \(only plain LoRA: use_dora = False\)"),
    ("rank-zero", "adapter_config.json with r: 0",
     lambda t: (a := _adapter(t), _edit_json(a / "adapter_config.json", r=0))[0],
     r"adapter_config\.json: r \(lora\.rank\) must be a positive integer, got 0"),
    ("alpha-a-string", "adapter_config.json with lora_alpha: \"16\"",
     lambda t: (a := _adapter(t), _edit_json(a / "adapter_config.json", lora_alpha="16"))[0],
     r"adapter_config\.json: lora_alpha \(lora\.alpha\) must be a positive number, got '16'"),
    ("rank-differs-from-tensors", "adapter_config.json says r: 4, the tensors have rank 2",
     lambda t: (a := _adapter(t), _edit_json(a / "adapter_config.json", r=4))[0],
     r"adapter_model\.safetensors: base_model\.model\.model\.layers\.0\.mlp\.down_proj\.lora_A\.weight has shape "
     r"\(2, 32\), the model's adapter expects \(4, 32\) \(rank 2 in the file, 4 in adapter_config\.json\)"),
    ("another-hidden-size", "an adapter trained on a hidden size of 32, the model's is 16",
     lambda t: _adapter(t, hidden=32),
     r"adapter_model\.safetensors: .*down_proj\.lora_B\.weight has shape \(32, 2\), the model's adapter expects "
     r"\(16, 2\) \(an adapter for another model shape\?\)"),
    ("more-layers", "an adapter for a 2-layer model on a 1-layer model", lambda t: _adapter(t, layers=2),
     r"adapter_model\.safetensors: adapts modules the model does not have or does not adapt, e\.g\. "
     r"\['model\.layers\.1\.mlp\.down_proj', .*\] \(an adapter for another model\?\)"),
    ("lm-head", "an adapter tensor on lm_head",
     lambda t: (a := _adapter(t), _rename_tensor(a, f"{_Q}.lora_A.weight",
                                                  "base_model.model.lm_head.lora_A.weight"))[0],
     r"adapter_model\.safetensors: adapters on \['lm_head'\]; rlfuse adapts only \['q_proj', .*\]"),
    ("unexpected-tensor", "an adapter tensor named ...q_proj.weight",
     lambda t: (a := _adapter(t), _rename_tensor(a, f"{_Q}.lora_A.weight", f"{_Q}.weight"))[0],
     r"adapter_model\.safetensors: unexpected tensor 'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.weight' "
     r"\(expected base_model\.model\.<module>\.lora_A\.weight and \.lora_B\.weight\)"),
    ("weights-damaged", "adapter_model.safetensors cut to its first 20 bytes",
     lambda t: (a := _adapter(t), _truncate(a / "adapter_model.safetensors", keep=20))[0],
     r"adapter_model\.safetensors: not a readable safetensors file \(damaged or truncated\?\)"),
]


@pytest.mark.bad_input("lora")
@pytest.mark.parametrize("fed,damage,msg", [c[1:] for c in LORA_FOLDER_CASES], ids=[c[0] for c in LORA_FOLDER_CASES])
def test_bad_lora_adapter_folder(tmp_path, fed, damage, msg):
    from rlfuse.model.lora import LoRAConfig
    from rlfuse.run.build import apply_lora
    from rlfuse.run.config.sections import ModelSpec

    folder = damage(tmp_path)
    spec = ModelSpec(random_init={}, lora=LoRAConfig(path=str(folder)))
    expect_error(lambda: apply_lora(_lora_model(), spec), msg, fed)


@pytest.mark.bad_input("lora")
def test_lora_rank_set_beside_an_adapter_path_must_agree(tmp_path):
    from rlfuse.model.lora import LoRAConfig
    from rlfuse.run.build import apply_lora
    from rlfuse.run.config.sections import ModelSpec

    folder = _adapter(tmp_path, rank=2)
    spec = ModelSpec(random_init={}, lora=LoRAConfig(path=str(folder), rank=4))
    expect_error(lambda: apply_lora(_lora_model(), spec),
                 r"lora\.rank = 4 but the adapter at .*a has 2: set lora\.rank to 2 or leave it out",
                 "model.lora: {rank: 4, path: <an adapter of rank 2>}")


@pytest.mark.bad_input("lora")
def test_resumed_adapter_of_a_per_layer_subset(tmp_path):
    """A checkpoint's adapter/ must cover every module the run adapts (resume loads into
    adapters attached already)."""
    from rlfuse.model.lora import LoRAConfig, attach_lora
    from rlfuse.model.lora_peft import load_peft_weights

    folder = _adapter(tmp_path, layers=1)
    model = _lora_model(layers=2)
    attach_lora(model, LoRAConfig(rank=2))
    expect_error(lambda: load_peft_weights(model, folder),
                 r"adapter_model\.safetensors: no adapter for 7 of the model's 14 adapted modules, e\.g\. "
                 r"\['model\.layers\.1\.mlp\.down_proj', .*\]; per-layer subsets are not supported",
                 "a 1-layer adapter/ loaded into a 2-layer model's adapters (resume)")


@pytest.mark.bad_input("lora")
def test_cli_generate_with_a_missing_adapter(tmp_path, capsys):
    from rlfuse.model.weights import save_model
    from rlfuse.run.build import char_tokenizer as char_tok

    model = _lora_model()
    save_model(model, tmp_path / "base", tokenizer_dir=char_tok("abc").save(tmp_path / "tok"))
    argv = ["generate", str(tmp_path / "base"), "--adapter", str(tmp_path / "nope"), "--prompt", "ab",
            "--device", "cpu"]
    rc, _, err = _cli(argv, capsys)
    cli_error_line(rc, err, r"adapter .*nope: no such folder \(a PEFT LoRA adapter folder holds",
                   "rlfuse generate BASE --adapter <missing folder>")


# ------------------------------------------------------------------ the server (issue 37)
@pytest.fixture(scope="module")
def serve_client(tmp_path_factory):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from serve_helpers import write_model_folder

    from rlfuse.api import load_model
    from rlfuse.engine import LLM, EngineConfig
    from rlfuse.serve import build_app

    model, tok = load_model(write_model_folder(tmp_path_factory.mktemp("bad_serve")), device="cpu")
    llm = LLM(model, tok, EngineConfig(max_model_len=96, max_num_seqs=4, num_kv_blocks=16))
    with TestClient(build_app(llm, "tiny")) as client:
        yield client


SERVE_CASES = [
    # (id, route, raw JSON body, the error's param)
    ("stop-token-id-past-the-vocab", "completions",
     '{"model": "tiny", "prompt": "abc", "min_tokens": 2, "stop_token_ids": [1000000]}', "stop_token_ids"),
    ("top-k-2**63", "completions", '{"model": "tiny", "prompt": "abc", "top_k": 9223372036854775808}', "top_k"),
    ("top-k-past-the-vocab", "completions", '{"model": "tiny", "prompt": "abc", "top_k": 100000}', "top_k"),
    ("temperature-1e-40", "completions", '{"model": "tiny", "prompt": "abc", "temperature": 1e-40, "logprobs": 0}',
     "temperature"),
    ("lone-surrogate-prompt", "completions", '{"model": "tiny", "prompt": "\\ud800abc"}', "prompt"),
    ("lone-surrogate-chat", "chat/completions",
     '{"model": "tiny", "messages": [{"role": "user", "content": "hi \\udfff"}]}', "messages.0.content"),
]


@pytest.mark.bad_input("serve")
@pytest.mark.parametrize("route,body,param", [c[1:] for c in SERVE_CASES], ids=[c[0] for c in SERVE_CASES])
def test_serve_refuses_a_request_that_stopped_the_engine(serve_client, route, body, param):
    """Each once took the engine down (every later request 503) or answered a plain 500."""
    r = serve_client.post(f"/v1/{route}", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    catalog.seen(f"POST /v1/{route} {body}", f"400 {err['message']}")
    assert serve_client.get("/health").status_code == 200


@pytest.mark.bad_input("serve")
def test_serve_lora_wants_name_equals_path():
    from rlfuse.cli.serve import _lora_args

    expect_error(lambda: _lora_args(["adapters/math"]), r"--lora: expected NAME=PATH \(e\.g\. math=adapters/math\), "
                 r"got 'adapters/math'", "rlfuse serve MODEL --lora adapters/math")


# ------------------------------------------------------------------ tools, environments, the sandbox (issue 37)
class _EnvResetKeyError:
    def reset(self, row, *, seed):
        return [{"role": "user", "content": row["question"]}]

    def step(self, turn):
        from rlfuse.rollout import Step
        return Step(done=True)


class _EnvStepDict(_EnvResetKeyError):
    def reset(self, row, *, seed):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn):
        return {"done": True}


class _EnvNanReward(_EnvStepDict):
    def step(self, turn):
        from rlfuse.rollout import Step
        return Step(done=True)

    def reward(self):
        return float("nan")


AGENT_ENV_CASES = [
    ("env-reset-raises", _EnvResetKeyError, r"_EnvResetKeyError\.reset raised KeyError: 'question' \(row 0",
     "rollout.env whose reset reads a missing row field (row['question'])"),
    ("env-step-returns-a-dict", _EnvStepDict, r"_EnvStepDict\.step returned dict \{'done': True\}",
     "rollout.env whose step returns {'done': True}"),
    ("env-reward-nan", _EnvNanReward, r"_EnvNanReward\.reward\(\) gave nan for episode 0 \(row 0\)",
     "rollout.env whose reward() returns nan"),
]


@pytest.mark.bad_input("agents")
@pytest.mark.parametrize("env_cls,msg,fed", [c[1:] for c in AGENT_ENV_CASES], ids=[c[0] for c in AGENT_ENV_CASES])
def test_environment_faults_are_one_line_naming_the_class(env_cls, msg, fed):
    from agent_setup import ScriptedEngine, chat_tokenizer

    from rlfuse.rollout import ChatRenderer, run_episodes
    from rlfuse.run.config import RolloutConfig

    tok = chat_tokenizer("qwen2")
    eng = ScriptedEngine(tok, lambda ids, k: "answer")
    expect_error(lambda: run_episodes(eng, ChatRenderer(tok), env_cls, [{"prompt": "a"}], cfg=RolloutConfig()),
                 msg, fed)


@pytest.mark.bad_input("agents")
def test_python_tool_fails_closed_without_isolation(monkeypatch):
    from rlfuse.rollout.agent import sandbox as sb
    from rlfuse.rollout.agent.tools import load_tools

    monkeypatch.setattr(sb, "find_bwrap", lambda: None)
    sb._probe.cache_clear()
    try:
        expect_error(lambda: load_tools(["python"]), r"rollout\.sandbox: the python tool runs model-written code "
                     r"isolated by bubblewrap \(bwrap\), which is not usable here: no bwrap executable found",
                     "rollout.tools: [python] on a machine without bwrap")
    finally:
        sb._probe.cache_clear()


@pytest.mark.bad_input("agents")
def test_python_tool_unisolated_is_warned(caplog):
    from rlfuse.rollout.agent.tools import load_tools

    with caplog.at_level(logging.WARNING):
        load_tools(["python"], sandbox="none")
    expect_reported(caplog, "WITHOUT isolation", "rollout.sandbox: none", count=1)


@pytest.mark.bad_input("agents")
def test_bad_sandbox_setting_names_the_choices():
    from rlfuse.run.config import load_config

    expect_error(lambda: load_config(None, ["rollout.sandbox=docker"]),
                 r"rollout\.sandbox must be bwrap, none or a SandboxFusion URL \(http://HOST:PORT\), got 'docker'",
                 "--set rollout.sandbox=docker")



@pytest.mark.bad_input("agents")
def test_bad_failed_episode_setting_names_the_choices():
    from rlfuse.run.config import load_config

    expect_error(lambda: load_config(None, ["rollout.failed_episode=skip"]),
                 r"rollout\.failed_episode must be one of \['zero', 'drop'\], got 'skip'",
                 "--set rollout.failed_episode=skip")


# ------------------------------------------------------------------ the catalog of this corpus
def test_the_catalog_lists_every_case(request):
    """docs/bad-inputs.md lists exactly this file's corpus cases, each under its category (the
    messages themselves are rewritten by regenerating it; see tests/bad_input_catalog.py)."""
    if request.config.getoption("--bad-input-catalog"):
        pytest.skip("this session rewrites the catalog; the next one checks it")
    module = request.node.getparent(pytest.Module)
    cases = [it for it in module.collect() if isinstance(it, pytest.Function) and catalog.category(it)]
    collected = {(catalog.category(it), catalog.case_id(it.nodeid)) for it in cases}
    listed = catalog.listed(catalog.DOC.read_text())
    assert len(collected) >= 60 and len(collected) == len(cases)
    assert listed == collected, (f"docs/bad-inputs.md is out of date: regenerate it with `{catalog.COMMAND}` "
                                 f"(missing: {sorted(collected - listed)[:5]}; "
                                 f"not a case: {sorted(listed - collected)[:5]})")


def test_a_changed_message_fails_its_case():
    """The catalog's check compares each case's recorded text with its row (the other
    direction, every unchanged case agreeing, is this file's run itself)."""
    class Item:  # the parts of a pytest item the catalog reads
        nodeid = "tests/test_bad_inputs.py::test_cli_bad_log_level"
        user_properties = [(catalog.PROPERTY, ("rlfuse --log-level LOUD report .",
                                               "rlfuse: error: --log-level: 'LOUD' is not a level, reworded"))]

        def get_closest_marker(self, name):
            return pytest.mark.bad_input("cli").mark if name == "bad_input" else None

    assert ("cli", "test_cli_bad_log_level") in catalog.documented()
    problem = catalog.stale(Item())
    assert problem and "regenerate the catalog" in problem and "reworded" in problem
    Item.nodeid = "tests/test_bad_inputs.py::test_not_yet_in_the_catalog"
    assert catalog.stale(Item()) is None  # a new case: test_the_catalog_lists_every_case says so
