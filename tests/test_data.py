"""Data: file formats, bad-row messages, templates, length filter, SFT masks, built-in
tasks and their exact verifiers, resumable ordering."""

import json
import logging

import pytest

from rlfuse.data.prompts import PromptStream, build_prompts, build_sft_examples
from rlfuse.data.rows import load_rows
from rlfuse.data.tasks import (
    arithmetic_rows,
    countdown_rows,
    extract_answer,
    make_split,
    task_alphabet,
    verify_arithmetic,
    verify_countdown,
)
from rlfuse.run.build import char_tokenizer
from rlfuse.run.config.sections import DataConfig

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
ALPHA = "abcdefghijklmnopqrstuvwxyz0123456789 +-*=?.:<>/|\n_ABCDEFGHIJKLMNOPQRSTUVWXYZ{}%()"


@pytest.fixture
def tok():
    t = char_tokenizer(ALPHA)
    t.chat_template = CHATML
    return t


def _jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_json_and_extra_columns(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": 2, "level": 1}, "", {"prompt": "2+2=", "answer": "4"}])
    pairs = load_rows(DataConfig(train=str(p)))
    assert [w for w, _ in pairs] == [f"{p}:1", f"{p}:3"]
    assert pairs[0][1]["level"] == 1
    j = tmp_path / "d.json"
    j.write_text(json.dumps({"data": [{"prompt": "x"}, {"prompt": "y"}]}))
    assert [r["prompt"] for _, r in load_rows(DataConfig(train=str(j)))] == ["x", "y"]


@pytest.mark.parametrize("row,msg", [
    ({"question": "hi"}, r"d.jsonl:2: missing field 'prompt' \(or 'messages'\); the row has fields \['question'\]"),
    ({"prompt": 3}, r"d.jsonl:2: field 'prompt' must be a string, got int"),
    ({"prompt": "p", "answer": [1]}, r"d.jsonl:2: field 'answer' must be a string or a number, got list"),
    ({"messages": [{"role": "user"}]}, r"d.jsonl:2: field messages\[0\] must be an object with string 'role' and 'content'"),
    ("[1, 2]", r"d.jsonl:2: expected an object"),
    ("{bad json", r"d.jsonl:2: not valid JSON"),
])
def test_malformed_rows_name_file_line_and_field(tmp_path, row, msg):
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, row])
    with pytest.raises(ValueError, match=msg):
        load_rows(DataConfig(train=str(p)))


def test_sft_rows_need_a_target(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": "p"}])
    with pytest.raises(ValueError, match=r"d.jsonl:1: missing field 'completion'"):
        load_rows(DataConfig(train=str(p)), need_target=True)
    p = _jsonl(tmp_path / "e.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(ValueError, match="no assistant message"):
        load_rows(DataConfig(train=str(p)), need_target=True)


def test_parquet_needs_pyarrow_or_reads(tmp_path):
    p = tmp_path / "d.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        p.write_bytes(b"PAR1")
        with pytest.raises(ValueError, match="needs pyarrow"):
            load_rows(DataConfig(train=str(p)))
        return
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), p)
    assert [r["prompt"] for _, r in load_rows(DataConfig(train=str(p)))] == ["a", "b"]


def test_unsupported_suffix(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("prompt\nx\n")
    with pytest.raises(ValueError, match="unsupported data file type '.csv'"):
        load_rows(DataConfig(train=str(p)))


def test_prompt_template_chat_template_and_length_filter(tmp_path, tok, caplog):
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1", "answer": "2"}, {"prompt": "x" * 80, "answer": "1"},
                                      {"messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "yo"}]}])
    cfg = DataConfig(train=str(p), prompt_template="Q: {prompt}=", max_prompt_len=60)
    with caplog.at_level(logging.INFO):
        prompts = build_prompts(load_rows(cfg), tok, cfg)
    n = len(tok.encode("Q: " + "x" * 80 + "="))
    assert f"data train: dropped prompts (3 rows): 1 longer than data.max_prompt_len=60 tokens (e.g. {p}:2 ({n} " \
           "tokens))" in caplog.text
    assert prompts[0].text == "Q: 1+1=" and prompts[0].ids == tok.encode("Q: 1+1=")
    assert prompts[0].columns["answer"] == "2"
    # chat row: rendered with the template up to the generation prompt, the assistant turn dropped
    assert prompts[1].text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    cfg2 = DataConfig(train=str(p), use_chat_template=True, system_prompt="S", max_prompt_len=400)
    p0 = build_prompts(load_rows(cfg2), tok, cfg2)[0]
    assert p0.text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match=r"prompt_template '\{question\}' cannot be filled"):
        build_prompts(load_rows(cfg), tok, DataConfig(train=str(p), prompt_template="{question}"))


def test_sft_masks_completion_and_assistant_tokens_only(tmp_path, tok):
    p = _jsonl(tmp_path / "d.jsonl", [
        {"prompt": "1+1=", "completion": "2"},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                      {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}])
    cfg = DataConfig(train=str(p))
    ex = build_sft_examples(load_rows(cfg, need_target=True), tok, cfg, max_seq_len=512)
    eos = tok.eos_token_ids[0]
    assert ex[0].ids == tok.encode("1+1=") + tok.encode("2") + [eos]
    assert ex[0].mask == [False] * 4 + [True, True]
    text = tok.decode([t for t, m in zip(ex[1].ids, ex[1].mask) if m])
    assert text == "b<|im_end|>\nd<|im_end|>\n"  # both assistant turns (with their end marks), nothing else


def test_builtin_splits_are_disjoint_and_deterministic():
    cfg = DataConfig(train="builtin:arithmetic", task={"digits": 2, "ops": "+-"}, train_size=500, eval_size=100)
    tr, ev = load_rows(cfg, "train"), load_rows(cfg, "eval")
    assert len(tr) == 500 and len(ev) == 100
    assert not {r["prompt"] for _, r in tr} & {r["prompt"] for _, r in ev}
    assert load_rows(cfg, "train") == tr
    with pytest.raises(ValueError, match="unknown builtin task 'sudoku'"):
        make_split("sudoku", 3, seed=0)


def test_arithmetic_rows_and_verifier():
    for r in arithmetic_rows(200, seed=3, digits=3, ops="+-*"):
        assert verify_arithmetic(r["completion"], r["answer"])
        assert eval(r["prompt"][:-1]) == int(r["answer"])  # the prompt is a Python expression
    assert arithmetic_rows(1, seed=0, digits=2, pad=True)[0]["prompt"][2] == "+"  # "07+45="
    assert verify_arithmetic("46", "46") and verify_arithmetic(" 46 ", "46")
    assert verify_arithmetic("so \\boxed{46}", "46") and verify_arithmetic("<answer>-3</answer>", "-3")
    assert not verify_arithmetic("466", "46") and not verify_arithmetic("4 6", "46") and not verify_arithmetic("", "4")
    assert extract_answer("a \\boxed{1} b \\boxed{2}") == "2"


def test_countdown_rows_are_solvable_and_verifier_is_exact():
    rows = countdown_rows(100, seed=1, count=4)
    for r in rows:
        assert verify_countdown(r["completion"], r["numbers"], r["target"])
        assert 0 < r["target"] <= 200
    nums, t = [3, 5, 7], 22
    assert verify_countdown("<answer>3*5+7</answer>", nums, t)
    assert verify_countdown("think...\n(7+5)*3-14", [7, 5, 3, 14], t)
    assert not verify_countdown("<answer>3*5+7+0</answer>", nums, t)        # 0 is not given
    assert not verify_countdown("<answer>3*5+7</answer>", [3, 5, 7, 1], t)   # 1 unused (use_all)
    assert verify_countdown("<answer>3*5+7</answer>", [3, 5, 7, 1], t, use_all=False)
    assert not verify_countdown("<answer>5*5-3</answer>", nums, t)           # 5 twice
    assert not verify_countdown("<answer>__import__('os')</answer>", nums, t)
    assert not verify_countdown("<answer>7/0+3*5</answer>", nums, t)
    assert not verify_countdown("<answer>3*5+7</answer>", nums, 23)
    assert set(task_alphabet("countdown", rows)) >= set("<answer>0123456789")


def test_prompt_stream_resumes_at_position():
    a = PromptStream(list(range(10)), seed=4)
    first = a.take(13)  # crosses an epoch boundary
    assert sorted(first[:10]) == list(range(10))
    b = PromptStream(list(range(10)), seed=4)
    b.load_state_dict({"position": 7})
    assert b.take(6) == first[7:13]


def test_files_that_cannot_be_read_name_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid UTF-8 \(byte 0xe9 at offset 32\)"):
        load_rows(DataConfig(train=str(p)))
    for name, body in (("e.jsonl", ""), ("e.json", " \n"), ("w.jsonl", "\n\n")):
        (tmp_path / name).write_text(body)
        with pytest.raises(ValueError, match=rf"{name}: the data file is empty"):
            load_rows(DataConfig(train=str(tmp_path / name)))
    (tmp_path / "l.json").write_text("[]")
    with pytest.raises(ValueError, match=r"l.json: no rows in the data file"):
        load_rows(DataConfig(train=str(tmp_path / "l.json")))
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(ValueError, match=r"dir.jsonl: is a folder"):
        load_rows(DataConfig(train=str(tmp_path / "dir.jsonl")))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "x"}\n')
    assert load_rows(DataConfig(train=str(bom)))[0][1] == {"prompt": "x"}


def test_prompts_checked_against_the_context_empty_and_counted(tmp_path, tok, caplog):
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1"}, {"prompt": "   "}, {"prompt": "x" * 30}, {"prompt": "y" * 12},
                                      {"messages": [{"role": "user", "content": ""}]}])
    cfg = DataConfig(train=str(p), max_prompt_len=20)
    counts = {}
    with caplog.at_level(logging.WARNING):
        prompts = build_prompts(load_rows(cfg), tok, cfg, context_len=24, counts=counts)
    assert [x.where for x in prompts] == [f"{p}:1", f"{p}:4"]
    assert counts == {"empty": 2, "longer than data.max_prompt_len=20 tokens": 1}
    assert f"2 empty (e.g. {p}:2, {p}:5)" in caplog.text
    assert f"{p}:3 (30 tokens)" in caplog.text
    with pytest.raises(ValueError, match=r"data.max_prompt_len \(20\) does not fit in the model context "
                                         r"\(16 tokens"):
        build_prompts(load_rows(cfg), tok, cfg, context_len=16)
    only_empty = _jsonl(tmp_path / "e.jsonl", [{"prompt": ""}])
    with pytest.raises(ValueError, match=r"data train: no prompts left of 1 rows after the checks above "
                                         r"\(1 empty\)"):
        build_prompts(load_rows(DataConfig(train=str(only_empty))), tok, DataConfig(train=str(only_empty)))


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_sft_sequences_over_the_context_truncated_or_dropped(tmp_path, tok, overlong, caplog):
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "completion": "2"},
                                      {"prompt": "2+2=", "completion": "4" * 40}])
    cfg = DataConfig(train=str(p), max_prompt_len=8)
    counts = {}
    with caplog.at_level(logging.WARNING):
        ex = build_sft_examples(load_rows(cfg, need_target=True), tok, cfg, max_seq_len=64, context_len=16,
                                overlong=overlong, counts=counts)
    n = 4 + 40 + 1
    if overlong == "truncate":
        assert [len(e.ids) for e in ex] == [6, 16] and ex[1].mask == [False] * 4 + [True] * 12
        assert counts == {"truncated to 16 tokens (the model context)": 1}
    else:
        assert [len(e.ids) for e in ex] == [6]
        assert counts == {"dropped: longer than 16 tokens (the model context)": 1}
    assert f"{p}:2 ({n} tokens)" in caplog.text
    with pytest.raises(ValueError, match="overlong must be 'truncate' or 'drop', got 'cut'"):
        build_sft_examples(load_rows(cfg, need_target=True), tok, cfg, max_seq_len=64, overlong="cut")
