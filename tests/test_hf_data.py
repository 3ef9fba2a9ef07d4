"""Hugging Face datasets as data sources (rlfuse.data.hf): save_to_disk folders (a Dataset
and a DatasetDict), data.columns renames, a data.map row transform, and a hub name that is
not cached failing offline with an error naming the cache. Nothing is downloaded: the
datasets are built here and the Hub is put in offline mode.
Run: PYTHONPATH=$PWD python -m pytest -q tests/test_hf_data.py
"""

from __future__ import annotations

import pytest

datasets = pytest.importorskip("datasets", reason="needs the optional dependency datasets (pip install -e .[datasets])")

from rlfuse.data.hf import is_hf_source, read_hf, transform_rows  # noqa: E402

ROWS = [{"question": "1+2=", "solution": "3", "level": 1}, {"question": "4+4=", "solution": "8", "level": 2}]


def test_save_to_disk_folders(tmp_path):
    one = tmp_path / "one"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(one))
    assert is_hf_source(str(one)) and is_hf_source("hf:gsm8k:main") and not is_hf_source(str(tmp_path / "x.jsonl"))
    rows = read_hf(str(one), split="train")
    assert rows == [(f"{one} row 0", ROWS[0]), (f"{one} row 1", ROWS[1])]  # a Dataset: the split is moot
    both = tmp_path / "both"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(str(both))
    assert [r for _, r in read_hf(str(both), split="test")] == ROWS[:1]
    assert read_hf(str(both), split="train")[1][0] == f"{both}[train] row 1"
    with pytest.raises(ValueError, match=r"data.eval: .*no split 'validation'; it has \['test', 'train'\]"):
        read_hf(str(both), split="validation", field="data.eval")
    (tmp_path / "plain").mkdir()
    assert not is_hf_source(str(tmp_path / "plain"))  # the file reader's "is a folder" error
    with pytest.raises(ValueError, match="not one written by save_to_disk"):
        read_hf(str(tmp_path / "plain"), split="train")


def test_hub_name_offline_names_the_cache(monkeypatch):
    # offline: no request leaves the machine, and a name that is not cached must fail clearly
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError) as e:
        read_hf("hf:rlfuse-tests/no-such-dataset:main", split="train")
    msg = str(e.value)
    assert msg.startswith("data.train: hf:rlfuse-tests/no-such-dataset:main: could not load "
                          "'rlfuse-tests/no-such-dataset' (config 'main'), split 'train'")
    assert str(datasets.config.HF_DATASETS_CACHE) in msg and "offline mode: on" in msg
    with pytest.raises(ValueError, match="expected hf:NAME"):
        read_hf("hf:", split="train")


def test_columns_and_map(tmp_path):
    pairs = [("f row 0", dict(ROWS[0])), ("f row 1", dict(ROWS[1]))]
    out = transform_rows(pairs, {"question": "prompt", "solution": "answer"}, None)
    assert out[0] == ("f row 0", {"prompt": "1+2=", "answer": "3", "level": 1})

    def add_hint(row):
        return {**row, "prompt": row["prompt"] + " (level %d)" % row["level"]}
    out = transform_rows(pairs, {"question": "prompt"}, add_hint)
    assert [r["prompt"] for _, r in out] == ["1+2= (level 1)", "4+4= (level 2)"]
    with pytest.raises(ValueError, match=r"f row 0: data.columns renames \['answer'\], which the row does not have"):
        transform_rows(pairs, {"answer": "x"}, None)
    with pytest.raises(ValueError, match=r"f row 0: data.columns renames onto \['level'\], which the row already has"):
        transform_rows(pairs, {"question": "level"}, None)
    with pytest.raises(ValueError, match="f row 1: data.map raised KeyError"):
        transform_rows(pairs, {}, lambda r: {"p": r["question"]} if r["level"] == 1 else r["nope"])
    with pytest.raises(ValueError, match="f row 0: data.map must return a dict"):
        transform_rows(pairs, {}, lambda r: None)


def test_recipe_keys_reach_the_rows(tmp_path):
    """data.train as a save_to_disk folder or a file, data.split / eval_split, data.columns and a
    data.map file named relative to the recipe; hf: names are not taken for paths."""
    from rlfuse.data import load_rows
    from rlfuse.run.config import load_config

    folder = tmp_path / "ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "validation": datasets.Dataset.from_list(ROWS[1:])}).save_to_disk(str(folder))
    (tmp_path / "hint.py").write_text("def hint(row):\n    return {**row, 'prompt': 'Q: ' + row['prompt']}\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  train: ds\n  eval: ds\n  eval_split: validation\n"
                      "  columns: {question: prompt, solution: answer}\n  map: hint.py:hint\n")
    cfg = load_config(recipe, relative_to=tmp_path)
    assert cfg.data.train == str(folder) and cfg.data.map == f"{tmp_path / 'hint.py'}:hint"
    train = load_rows(cfg.data, "train", need_target=True)  # the SFT target: the renamed answer column
    assert [(w, r["prompt"], r["answer"]) for w, r in train] == [(f"{folder}[train] row 0", "Q: 1+2=", "3"),
                                                                 (f"{folder}[train] row 1", "Q: 4+4=", "8")]
    assert [r["prompt"] for _, r in load_rows(cfg.data, "eval")] == ["Q: 4+4="]
    recipe.write_text("data:\n  train: hf:gsm8k:main\n")
    assert load_config(recipe, relative_to=tmp_path).data.train == "hf:gsm8k:main"
    with pytest.raises(ValueError, match="data.columns must map"):
        load_config(None, ["data.columns={question: 3}"])
    with pytest.raises(ValueError, match=r"data.map 'nope.py:f': no such file"):
        load_rows(load_config(None, [f"data.train={folder}", "data.map=nope.py:f"]).data)


def test_sft_trains_on_a_saved_dataset(tmp_path):
    """End to end: `rlfuse sft`'s run on a save_to_disk folder whose columns are renamed."""
    import torch
    import transformers
    from tiny_hf import hf_config, randomize_
    from train_setup import one_thread

    from rlfuse.run.build import char_tokenizer
    from rlfuse.run.config import load_config
    from rlfuse.run.metrics import read_metrics
    from rlfuse.train.sft import run_sft

    model = tmp_path / "model"
    tok = char_tokenizer("0123456789+= ")
    tok.save(model)
    cfg = hf_config("qwen3", vocab_size=tok.vocab_size, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomize_(hf, seed=1).save_pretrained(model)
    data = tmp_path / "ds"
    datasets.Dataset.from_list(ROWS * 4).save_to_disk(str(data))
    cfg = load_config({"model": {"path": str(model), "dtype": "float32", "device": "cpu", "kernel_backend": "torch"},
                       "data": {"train": str(data), "columns": {"question": "prompt", "solution": "completion"},
                                "max_prompt_len": 16},
                       "sft": {"steps": 2, "batch_size": 4},
                       "logging": {"run_dir": str(tmp_path / "run"), "tensorboard": False, "progress": False},
                       "checkpoint": {"save_final": False}})
    with one_thread():
        run_sft(cfg)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows if r["stage"] == "sft"] == [1, 2]
    assert next(r for r in rows if r["stage"] == "data")["train/kept"] == 8
