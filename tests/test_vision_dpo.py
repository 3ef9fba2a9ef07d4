"""DPO on image rows (a tiny Qwen3-VL, CPU): preference rows with an images column become
pairs whose two sequences carry the prompt's images; the pair log-probs see the image (a
different image, different log-probs) and do not depend on how pairs are packed; `rlfuse dpo`'s
trainer trains on them (cached or live reference), the vision tower only with model.train_vision.

    python -m pytest -q tests/test_vision_dpo.py
"""

import json

import pytest
import torch
from engine_helpers import one_thread  # noqa: F401 -- an autouse fixture

from rlfuse.data.image_tasks import render_layout
from rlfuse.data.preference import build_preference_pairs
from rlfuse.recipes.vision_demo import VLM
from rlfuse.run.config import replace
from rlfuse.run.config.run_config import load_config
from rlfuse.train import open_session
from rlfuse.train.dpo import run_dpo, sequence_logprobs

SMALL_VLM = dict(VLM, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                 vision=dict(VLM["vision"], depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                             out_hidden_size=32))
# 4 x 4 cells, row-major: R red, B / G a distractor, . empty (rlfuse.data.image_tasks)
LAYOUTS = ["R...B...R.......", "RR..............", ".G..R...RR..R...", "R...............", "...R..R..G..R..R",
           "B.R.............", "..RR..G.........", "R..R..R.........", "G..............R", "RRRR............"]


def _rows(tmp_path):
    """Preference rows from image files: chosen the red count, rejected one more."""
    rows = []
    for i, key in enumerate(LAYOUTS):
        path = tmp_path / f"img{i}.png"
        render_layout(key, 32, 4).save(path)
        k = key.count("R")
        rows.append({"prompt": "<image>How many red squares?", "images": [str(path)], "chosen": str(k),
                     "rejected": str(k + 1)})
    (tmp_path / "pref.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _cfg(tmp_path, **model):
    return load_config({
        "seed": 0,
        "model": {"random_init": SMALL_VLM, "tokenizer": "char", "dtype": "float32", "device": "cpu",
                  "processor": {"min_pixels": 1024, "max_pixels": 1024}, **model},
        "data": {"train": str(tmp_path / "pref.jsonl"), "max_prompt_len": 40},
        "optim": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"},
        "dpo": {"steps": 2, "batch_size": len(LAYOUTS), "max_seq_len": 48, "micro_batch_tokens": 4096},
        "logging": {"run_dir": str(tmp_path / "run"), "tensorboard": False, "progress": False},
        "checkpoint": {"every": 0, "save_final": False},
    })


def test_image_pairs_carry_the_prompts_images_and_their_logprobs_see_them(tmp_path):
    _rows(tmp_path)
    ses = open_session(_cfg(tmp_path))
    pairs = build_preference_pairs(ses.train_rows, ses.tokenizer, ses.cfg.data, ses.cfg.dpo, vision=ses.vision)
    pad = ses.vision.pad_id
    assert len(pairs) == len(LAYOUTS)
    for p in pairs:
        (item,) = p.media
        assert p.prompt[item.offset:item.end] == [pad] * item.num_tokens == [pad] * 4  # 32 x 32, 2 x 2 merge
        assert pad not in p.chosen and pad not in p.rejected  # image tokens are never response tokens
        assert [s[2] for s in p.sequences()] == [p.media, p.media]
    lp = sequence_logprobs(ses.model, pairs, 4096, "cpu")  # all pairs in one micro-batch
    one_by_one = torch.cat([sequence_logprobs(ses.model, [p], 4096, "cpu") for p in pairs])
    torch.testing.assert_close(lp, one_by_one, rtol=0, atol=1e-5)
    # pair 0 with pair 1's image: same ids, other pixels -> other log-probs
    swapped = type(pairs[0])(pairs[0].prompt, pairs[0].chosen, pairs[0].rejected, "swap", pairs[1].media)
    assert not torch.allclose(sequence_logprobs(ses.model, [swapped], 4096, "cpu"), lp[:1])


@pytest.mark.parametrize("train_vision,reference", [(False, "precompute"), (True, "precompute"), (True, "live")])
def test_dpo_trains_on_image_pairs(tmp_path, train_vision, reference):
    _rows(tmp_path)
    ses = open_session(replace(_cfg(tmp_path, train_vision=train_vision), **{"dpo.reference": reference}))
    tower0 = [p.detach().clone() for p in ses.model.visual.parameters()]
    lm0 = ses.model.lm_head_weight.detach().clone()
    res = run_dpo(ses.cfg, session=ses)
    assert res["steps"] == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in res["history"])
    # every step takes all pairs: the second sees the first's update on the same pairs
    assert res["history"][0]["rewards/margin"] == 0 < res["history"][-1]["rewards/margin"]
    assert not torch.equal(lm0, ses.model.lm_head_weight)
    changed = [not torch.equal(a, b) for a, b in zip(tower0, ses.model.visual.parameters())]
    assert all(changed) if train_vision else not any(changed)
