"""SFT and GRPO on image rows with the real engine and a tiny Qwen3-VL (builtin:count_squares):
exact numerics holds on image prompts (rollout == trainer log-probs, bitwise, every step),
the tower runs once per distinct image per rollout (vision/encodes), the vision tower is
frozen by default and trains with model.train_vision, LoRA adapts the language model only,
and a shared prompt's images keep the packed trainer forward exact (grpo.share_prefix)."""

import pytest
import torch
from engine_helpers import one_thread  # noqa: F401 -- an autouse fixture

from rlfuse.data import build_prompts
from rlfuse.recipes.vision_demo import VLM
from rlfuse.run import PackedBatch
from rlfuse.run.config.run_config import load_config
from rlfuse.train import open_session, run_grpo, run_sft

SMALL_VLM = dict(VLM, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                 vision=dict(VLM["vision"], depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                             out_hidden_size=32))


def _cfg(tmp_path, random_init=None, **model):
    """random_init: the tiny VLM's fields (default SMALL_VLM, a Qwen3-VL)."""
    return load_config({
        "seed": 0,
        "model": {"random_init": random_init or SMALL_VLM, "tokenizer": "char", "dtype": "float32", "device": "cpu",
                  "processor": {"min_pixels": 1024, "max_pixels": 1024}, **model},
        "engine": {"numerics": "exact", "max_num_seqs": 32},
        "data": {"train": "builtin:count_squares", "train_size": 40, "eval_size": 8, "max_prompt_len": 40},
        # a random model rarely counts right: `parity` gives the groups reward variance
        "rewards": [{"name": "arithmetic"}, {"name": "parity"}],
        "optim": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"},
        "sft": {"steps": 2, "batch_size": 8, "max_seq_len": 48},
        "grpo": {"steps": 2, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 3, "temperature": 1.0,
                 "check_every": 1},
        "logging": {"run_dir": str(tmp_path), "tensorboard": False, "progress": False},
        "checkpoint": {"every": 0, "save_final": False},
    })


def _parity(prompts, completions, completion_ids, **_):
    return [float(ids[0] % 2) for ids in completion_ids]


def _tower(model):
    return [p.detach().clone() for p in model.visual.parameters()]


def test_grpo_on_images_is_exact_and_encodes_once_per_image(tmp_path):
    ses = open_session(_cfg(tmp_path / "a"), reward_functions={"parity": _parity})
    tower0, lm0 = _tower(ses.model), ses.model.lm_head_weight.detach().clone()
    res = run_grpo(ses.cfg, session=ses)
    for h in res["history"]:
        assert h["vision/encodes"] == 4.0  # 4 prompts x 4 samples: the tower ran 4 times, not 16
        assert h["mismatch/max_abs"] == 0.0  # rollout == trainer log-probs, bitwise, on image prompts
    assert all(torch.equal(a, b) for a, b in zip(tower0, _tower(ses.model)))  # frozen by default
    assert not torch.equal(lm0, ses.model.lm_head_weight)


@pytest.mark.parametrize("how", ["train_vision", "lora"])
def test_sft_on_images_trains_the_tower_on_request_and_lora_the_language_model(tmp_path, how):
    model = {"train_vision": True} if how == "train_vision" else {"lora": {"rank": 4}}
    ses = open_session(_cfg(tmp_path / how, **model), need_target=True, reward_functions={"parity": _parity})
    tower0 = _tower(ses.model)
    res = run_sft(ses.cfg, session=ses)
    assert res["steps"] == 2
    changed = [not torch.equal(a, b) for a, b in zip(tower0, _tower(ses.model))]
    assert all(changed) if how == "train_vision" else not any(changed)


def shared_prompt_packing_is_bitwise(ses):
    """Two samples of one image prompt and one of another, packed with and without reading the
    shared prompt (and its image) once: the same log-prob bits. -> (prompts, seqs)."""
    p = build_prompts(ses.train_rows[:2], ses.tokenizer, ses.cfg.data, vision=ses.vision)
    seqs = [(p[0].ids + [5, 6], len(p[0].ids), p[0].media), (p[0].ids + [7], len(p[0].ids), p[0].media),
            (p[1].ids + [5, 6], len(p[1].ids), p[1].media)]
    vis = ses.model.config.vision
    with torch.no_grad():
        outs = []
        for share in (0, 1):
            b = PackedBatch.build(seqs, "cpu", share, vision=vis)
            outs.append(ses.model.token_logprobs(b.forward(ses.model)[b.rows], b.targets))
            assert len(b.images) == (2 if share else 3)  # the group's image once when shared
    assert torch.equal(outs[0], outs[1])
    return p, seqs


def test_packed_shared_prompt_with_images_equals_unshared(tmp_path):
    ses = open_session(_cfg(tmp_path / "p"), reward_functions={"parity": _parity})
    p, seqs = shared_prompt_packing_is_bitwise(ses)
    vis = ses.model.config.vision
    # same ids, another image: not shared (the images differ), so no image is dropped
    other = (p[0].ids + [7], len(p[0].ids), p[1].media[:1])
    b = PackedBatch.build([seqs[0], other], "cpu", 1, vision=vis)
    assert len(b.images) == 2
