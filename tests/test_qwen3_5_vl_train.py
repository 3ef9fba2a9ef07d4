"""SFT and GRPO on image rows with the real engine and a tiny Qwen3.5-VL (hybrid text tower:
one Gated DeltaNet layer, one gated attention; a vision tower without DeepStack) on
builtin:count_squares -- a smoke test, not a learning curve: exact numerics holds on image
prompts at every GRPO step (rollout == trainer log-probs, bitwise), the tower runs once per
distinct image per rollout, the vision tower stays frozen by default and trains with
model.train_vision (LoRA adapts the language model only), and the packed trainer forward that reads a group's shared prompt (and its
images) once gives the unshared forward's bits through the linear-attention layer.

    python -m pytest -q tests/test_qwen3_5_vl_train.py
"""

import json

import pytest
import torch
from engine_helpers import one_thread  # noqa: F401 -- an autouse fixture
from test_vision_train import _cfg as vision_cfg
from test_vision_train import _parity, _tower, shared_prompt_packing_is_bitwise

from rlfuse.run.config import replace
from rlfuse.train import open_session, run_grpo, run_sft

TINY_Q35_VL = dict(model_type="qwen3_5", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, partial_rotary_factor=0.5,
                   layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                   linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=1,
                   linear_num_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
                   mrope_section=[1, 2, 1],
                   vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
                               temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32,
                               num_position_embeddings=16, deepstack_visual_indexes=[]))


def _cfg(tmp_path, **model):
    return vision_cfg(tmp_path, TINY_Q35_VL, **model)


def test_grpo_on_images_is_exact_and_encodes_once_per_image(tmp_path):
    ses = open_session(_cfg(tmp_path / "g"), reward_functions={"parity": _parity})
    assert ses.model.config.architecture == "Qwen3_5ForConditionalGeneration" and ses.model.config.is_hybrid
    tower0, lm0 = _tower(ses.model), ses.model.lm_head_weight.detach().clone()
    res = run_grpo(ses.cfg, session=ses)
    assert len(res["history"]) == 2
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
    lm0 = {n: p.detach().clone() for n, p in ses.model.named_parameters() if p.requires_grad}
    res = run_sft(ses.cfg, session=ses)
    assert res["steps"] == 2
    changed = [not torch.equal(a, b) for a, b in zip(tower0, _tower(ses.model))]
    assert all(changed) if how == "train_vision" else not any(changed)
    trained = dict(ses.model.named_parameters())
    assert any(not torch.equal(p, trained[n]) for n, p in lm0.items() if not n.startswith("visual."))


def test_packed_shared_prompt_with_images_equals_unshared(tmp_path):
    ses = open_session(_cfg(tmp_path / "p"), reward_functions={"parity": _parity})
    shared_prompt_packing_is_bitwise(ses)  # through the linear-attention layer too


def test_dpo_trains_on_image_pairs(tmp_path):
    """DPO preference rows with images (tests/test_vision_dpo.py's rows) on the hybrid VLM: the
    pairs' log-probs do not depend on how pairs are packed, and two steps train on them."""
    from test_vision_dpo import _rows

    from rlfuse.data.preference import build_preference_pairs
    from rlfuse.run.config import replace
    from rlfuse.train.dpo import run_dpo, sequence_logprobs

    _rows(tmp_path)
    cfg = replace(_cfg(tmp_path / "run"), **{
        "data.train": str(tmp_path / "pref.jsonl"), "data.eval": "", "rewards": [],
        "dpo.steps": 2, "dpo.batch_size": 10, "dpo.max_seq_len": 48, "dpo.micro_batch_tokens": 4096})
    ses = open_session(cfg)
    pairs = build_preference_pairs(ses.train_rows, ses.tokenizer, ses.cfg.data, ses.cfg.dpo, vision=ses.vision)
    lp = sequence_logprobs(ses.model, pairs, 4096, "cpu")
    one_by_one = torch.cat([sequence_logprobs(ses.model, [p], 4096, "cpu") for p in pairs])
    torch.testing.assert_close(lp, one_by_one, rtol=0, atol=1e-5)
    lm0 = ses.model.lm_head_weight.detach().clone()
    res = run_dpo(ses.cfg, session=ses)
    assert res["steps"] == 2 and res["history"][0]["rewards/margin"] == 0 < res["history"][-1]["rewards/margin"]
    assert not torch.equal(lm0, ses.model.lm_head_weight)


def test_a_trained_lora_exports_a_peft_folder_for_transformers(tmp_path):
    """A LoRA trained by `rlfuse sft` on image rows (one step): RUN_DIR/final (PEFT) applied by PEFT to
    transformers' Qwen3_5ForConditionalGeneration holding the base, and final_merged (plain
    transformers), give our trained model's logits on an image row (fp32; the tower frozen,
    the adapters on the hybrid text tower: Gated DeltaNet and gated attention projections)."""
    import peft
    import transformers
    from tiny_hf import rel_err

    from rlfuse.kernels import use_backend
    from rlfuse.model import Packed
    from rlfuse.model.lora import BaseModelView, adapters_off
    from rlfuse.model.vision import mrope_positions, tokens_per_image
    from rlfuse.model.weights import save_model

    cfg = _cfg(tmp_path / "run", lora={"rank": 4, "alpha": 8, "export_merged": True})
    ses = open_session(replace(cfg, **{"checkpoint.save_final": True, "sft.steps": 1}), need_target=True,
                       reward_functions={"parity": _parity})
    model = run_sft(ses.cfg, session=ses)["model"].eval()
    final, merged = tmp_path / "run" / "final", tmp_path / "run" / "final_merged"
    peft_cfg = json.loads((final / "adapter_config.json").read_text())
    assert {"in_proj_qkv", "q_proj", "down_proj"} <= set(peft_cfg["target_modules"]), peft_cfg
    save_model(model, tmp_path / "base", dtype="float32")  # the frozen base alone
    v = model.config.vision
    g = torch.Generator().manual_seed(4)
    grids = torch.tensor([[1, 4, 2]])
    pix = torch.randn(int(grids.prod(-1).sum()), v.patch_dim, generator=g)
    ids = torch.tensor([1, 2, v.vision_start_token_id, *[v.image_token_id] * int(tokens_per_image(grids, 2)[0]),
                        v.vision_end_token_id, 3, 4])
    pos, _ = mrope_positions(ids, grids, spatial_merge_size=v.spatial_merge_size, image_token_id=v.image_token_id)
    attn = Packed.from_lengths([len(ids)])
    with torch.no_grad(), use_backend("torch"):
        feats = BaseModelView(model).encode_images(pix, grids)
        ours = model.logits(model(ids, pos, attn, feats))
        with adapters_off(model):
            base = model.logits(model(ids, pos, attn, feats))
    load = transformers.Qwen3_5ForConditionalGeneration.from_pretrained
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    row = dict(input_ids=ids[None], pixel_values=pix, image_grid_thw=grids,
               mm_token_type_ids=(ids == v.image_token_id).int()[None])  # this char vocabulary's image token
    with torch.no_grad():
        with_peft = peft.PeftModel.from_pretrained(load(tmp_path / "base", **kw), final).eval()(**row).logits[0]
        got_merged = load(merged, **kw).eval()(**row).logits[0]
    assert rel_err(with_peft, ours) < 1e-5 and rel_err(got_merged, ours) < 1e-5
    assert rel_err(ours, base) > 1e-3  # the trained adapter changes the logits
