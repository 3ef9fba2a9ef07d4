"""Qwen3.5 vision-language against transformers' Qwen3_5ForConditionalGeneration on random
weights (tiny shapes, CPU, float32): a hybrid text tower of one Gated DeltaNet and one gated
full-attention layer (half of head_dim rotated, mRoPE over those frequencies), a 2-block
vision tower without DeepStack. Checked: the vision tower's features, the merged sequence,
the mRoPE position ids, logits, loss and every gradient (vision tower trainable) for one
image, two images of different sizes in one prompt, and a packed batch mixing a text-only
row and image rows; the config and checkpoint round trip (saved folders load in
transformers, transformers' folders load here, with or without the text tower alone).

    python -m pytest -q tests/test_qwen3_5_vl.py
"""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_hf import _draw_qwen3_5_, rel_err

from rlfuse.kernels import use_backend, use_numerics
from rlfuse.model import CausalLM, ModelConfig, Packed
from rlfuse.model.arch.qwen3_5_vl import tiny_hybrid_vl_fields
from rlfuse.model.vision import mrope_positions, text_positions, tokens_per_image
from rlfuse.model.weights import checkpoint_names, load_model, save_model

transformers = pytest.importorskip("transformers")
CFG = ModelConfig(**tiny_hybrid_vl_fields(torch_dtype="float32"))
V = CFG.vision
IMG, START, END = V.image_token_id, V.vision_start_token_id, V.vision_end_token_id
FP32_TOL = 1e-4  # gradients' relative error (tests/test_qwen3_5.py's)


def _hf_config(cfg: ModelConfig):
    d = cfg.to_hf()
    hcfg = transformers.Qwen3_5Config(**{k: v for k, v in d.items() if k != "architectures"})
    hcfg._attn_implementation = "eager"
    hcfg.text_config._attn_implementation = "eager"
    return hcfg


@pytest.fixture(scope="module")
def pair():
    """(ours, transformers') in float32 with the same random weights: the text model drawn as
    tests/tiny_hf.py draws Qwen3.5's (no parameter at its special init), the vision tower's
    norms and biases perturbed too."""
    ours = CausalLM(CFG)
    g = torch.Generator().manual_seed(0)
    ours.init_weights(std=0.1, generator=g)
    _draw_qwen3_5_(ours.model, seed=1)
    with torch.no_grad():
        ours.lm_head.weight.normal_(0.0, 0.1, generator=g)
        for p in ours.visual.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    hf = transformers.Qwen3_5ForConditionalGeneration(_hf_config(CFG)).eval()
    name = checkpoint_names(ours)
    sd = {name(n): p.detach() for n, p in ours.named_parameters()}
    assert set(sd) == set(hf.state_dict())
    hf.load_state_dict(sd)
    return ours.eval(), hf


def _images(g, grids):
    grids = torch.tensor(grids)
    return torch.randn(int(grids.prod(-1).sum()), V.patch_dim, generator=g), grids


def _prompt(grids, text=(11, 12, 13)):
    """[text, <start> image placeholders <end>, text] per image."""
    ids = [1, 2]
    for n in tokens_per_image(torch.tensor(grids), V.spatial_merge_size):
        ids += [START] + [IMG] * n + [END, *text]
    return torch.tensor(ids)


def _hf_rows(hf, rows):
    """transformers' logits per row: [(ids, pixels or None, grids or None)] -> list of (T, V)."""
    return [hf(input_ids=ids[None], pixel_values=pix, image_grid_thw=grids,
               mm_token_type_ids=(ids == IMG).int()[None]).logits[0] for ids, pix, grids in rows]


def test_config_round_trip_and_text_only():
    d = CFG.to_hf()
    assert (d["model_type"], d["architectures"], d["vision_config"]["model_type"]) == (
        "qwen3_5", ["Qwen3_5ForConditionalGeneration"], "qwen3_5_vision")
    assert "deepstack_visual_indexes" not in d["vision_config"]
    assert d["text_config"]["rope_parameters"]["mrope_section"] == [1, 2, 1]
    assert ModelConfig.from_hf(d) == CFG
    text = ModelConfig.from_hf(d, text_only=True)
    assert (text.model_type, text.vision, text.mrope_section, text.layer_types) == (
        "qwen3_5_text", None, None, CFG.layer_types)
    # transformers' defaults where the released folders leave fields out
    d["text_config"]["rope_parameters"].pop("mrope_section")
    for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        d.pop(k)
    big = ModelConfig.from_hf({**d, "text_config": {**d["text_config"], "vocab_size": 248320, "head_dim": 128}})
    assert big.mrope_section == (11, 11, 10) and big.vision.image_token_id == 248056
    assert big.vision.deepstack_visual_indexes == ()
    with pytest.raises(ValueError, match=r"'mrope_section' \[2, 2, 2\] must be three numbers summing to "
                                         r"head_dim \* partial_rotary_factor / 2 = 4"):
        ModelConfig(**tiny_hybrid_vl_fields(mrope_section=(2, 2, 2)))
    with pytest.raises(ValueError, match="Qwen3.5's vision tower has no DeepStack"):
        ModelConfig(**tiny_hybrid_vl_fields(vision={**_fields(V), "deepstack_visual_indexes": (0,)}))
    with pytest.raises(ValueError, match=r"text_only: a 'qwen3_vl' folder has no text tower loadable alone"):
        ModelConfig.from_hf({"model_type": "qwen3_vl"}, text_only=True)
    # a text model's folder (e.g. a checkpoint of a text_only run) reads as it is
    assert ModelConfig.from_hf(text.to_hf(), text_only=True) == text


def _fields(v):
    return {k: getattr(v, k) for k in v.__slots__}


def test_positions_match_transformers(pair):
    _, hf = pair
    for grids in ([[1, 4, 6]], [[1, 4, 6], [1, 2, 2], [1, 6, 2]], []):
        ids = _prompt(grids) if grids else torch.arange(1, 9)
        g = torch.tensor(grids).reshape(-1, 3)
        pos, delta = mrope_positions(ids, g if grids else None, spatial_merge_size=2, image_token_id=IMG)
        want, want_delta = hf.model.get_rope_index(ids[None], (ids == IMG).int()[None],
                                                   image_grid_thw=g if grids else None)
        assert torch.equal(pos, want[:, 0]) and delta == int(want_delta)


def test_vision_tower_matches_transformers(pair):
    ours, hf = pair
    pix, grids = _images(torch.Generator().manual_seed(1), [[1, 4, 6], [1, 2, 2], [1, 6, 4]])
    with torch.no_grad(), use_backend("torch"):
        want = hf.model.get_image_features(pix, grids)
        got = ours.encode_images(pix, grids)
    assert got.embeds.shape == (sum(tokens_per_image(grids, 2)), CFG.hidden_size)
    assert got.deepstack.shape[0] == 0
    assert rel_err(got.embeds, torch.cat(want.pooler_output)) < 1e-6


def test_merged_sequence_matches_transformers(pair):
    ours, hf = pair
    pix, grids = _images(torch.Generator().manual_seed(2), [[1, 2, 4], [1, 4, 2]])
    ids = _prompt(grids.tolist())
    with torch.no_grad(), use_backend("torch"):
        feats = ours.encode_images(pix, grids)
        emb = ours.model.embed_tokens(ids).index_copy(0, ours._image_rows(ids, feats), feats.embeds)
        want = hf.model.get_input_embeddings()(ids)
        want = want.masked_scatter((ids == IMG)[:, None],
                                   torch.cat(hf.model.get_image_features(pix, grids).pooler_output))
    assert rel_err(emb, want) < 1e-6


def test_logits_loss_and_every_gradient_match_transformers(pair):
    """One packed batch: a one-image row, a two-image row (different sizes), a text-only row;
    logits, the summed token loss and every gradient (vision tower trainable) against
    transformers run row by row."""
    ours, hf = pair
    g = torch.Generator().manual_seed(3)
    pa, ga = _images(g, [[1, 4, 6]])
    pb, gb = _images(g, [[1, 2, 2], [1, 6, 4]])
    rows = [(_prompt(ga.tolist()), pa, ga), (_prompt(gb.tolist(), text=(20, 21)), pb, gb),
            (torch.arange(30, 45), None, None)]
    ids = torch.cat([r[0] for r in rows])
    pos = torch.cat([mrope_positions(r[0], r[2], spatial_merge_size=2, image_token_id=IMG)[0] for r in rows], 1)

    def loss(lg):  # next-token loss within each row
        out, s = 0, 0
        for r in rows:
            n = len(r[0])
            out = out + torch.nn.functional.cross_entropy(lg[s:s + n - 1], r[0][1:], reduction="sum")
            s += n
        return out
    ours.set_vision_trainable(True)
    try:
        ours.zero_grad(set_to_none=True)
        hf.zero_grad(set_to_none=True)
        with use_backend("torch"):
            h = ours(ids, pos, Packed.from_lengths([len(r[0]) for r in rows]), pixel_values=torch.cat([pa, pb]),
                     image_grid_thw=torch.cat([ga, gb]))
            logits = ours.logits(h)
            l_ours = loss(logits)
            l_ours.backward()
        want = torch.cat(_hf_rows(hf, rows))
        l_hf = loss(want)
        l_hf.backward()
        assert rel_err(logits.detach(), want.detach()) < 1e-5
        assert abs(l_ours.item() - l_hf.item()) < 1e-5 * abs(l_hf.item())
        name = checkpoint_names(ours)
        hf_p = dict(hf.named_parameters())
        for n, p in ours.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{n}: no gradient"
            err = rel_err(p.grad, hf_p[name(n)].grad)
            assert err < FP32_TOL, f"{n}: rel err {err:.2e}"
    finally:
        ours.set_vision_trainable(False)
        ours.zero_grad(set_to_none=True)


def test_text_rows_of_mrope_are_plain_rope_bitwise(pair):
    """A text-only row with three equal mRoPE rows gives the (T,)-position forward's bits on
    the partial-rotary gated attention, in both numerics."""
    ours, _ = pair
    text = torch.arange(40, 57)
    with torch.no_grad(), use_backend("torch"):
        for numerics in ("fast", "exact"):
            with use_numerics(numerics):
                t1 = ours(text, torch.arange(17), Packed.from_lengths([17]))
                t3 = ours(text, text_positions(0, 17, 0), Packed.from_lengths([17]))
                assert torch.equal(t1, t3)


def test_checkpoint_round_trips_with_transformers(pair, tmp_path, caplog):
    """Ours saved -> transformers loads it (same logits on an image row); transformers'
    folder (plus a released checkpoint's MTP head) -> ours with the vision tower by default,
    the text tower alone with text_only, each said in one line."""
    ours, hf = pair
    folder = save_model(ours, tmp_path / "ours", dtype="float32")
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    back = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    pix, grids = _images(torch.Generator().manual_seed(7), [[1, 2, 4]])
    row = (_prompt(grids.tolist()), pix, grids)
    with torch.no_grad():
        assert torch.equal(_hf_rows(back, [row])[0], _hf_rows(hf, [row])[0])
    theirs = tmp_path / "theirs"
    hf.save_pretrained(theirs)
    tensors = load_file(theirs / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(8, 8)
    save_file(tensors, theirs / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="rlfuse.model.weights"):
        vl = load_model(theirs, dtype="float32")
    lines = [r.getMessage() for r in caplog.records]
    assert vl.config == CFG and any("with its vision tower (text_only loads the text tower alone)" in m
                                    for m in lines), lines
    assert any("multi-token-prediction head (1 tensors) is not loaded" in m for m in lines), lines
    for n, p in ours.state_dict().items():
        assert torch.equal(p, vl.state_dict()[n]), n
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlfuse.model.weights"):
        text = load_model(theirs, dtype="float32", text_only=True)
    assert text.config.model_type == "qwen3_5_text" and text.visual is None
    assert any("its vision tower" in r.getMessage() and "(text_only)" in r.getMessage() for r in caplog.records)
    ids = torch.arange(30, 60)
    with torch.no_grad(), use_backend("torch"):
        assert torch.equal(text(ids, torch.arange(30), Packed.from_lengths([30])),
                           vl(ids, torch.arange(30), Packed.from_lengths([30])))


def test_run_config_text_only(tmp_path):
    """model.text_only loads a folder's text tower (run layer); with random_init it is refused."""
    from rlfuse.run.build import build_model, char_tokenizer
    from rlfuse.run.config.sections import ModelSpec

    folder = save_model(CausalLM(CFG), tmp_path / "vl", dtype="float32")
    tok = char_tokenizer("abc")
    model = build_model(ModelSpec(path=str(folder), text_only=True, kernel_backend="torch"), tok, torch.device("cpu"))
    assert model.config.model_type == "qwen3_5_text" and model.visual is None
    model = build_model(ModelSpec(path=str(folder), kernel_backend="torch"), tok, torch.device("cpu"))
    assert model.config.model_type == "qwen3_5" and model.visual is not None
    with pytest.raises(ValueError, match="model.text_only: loads a folder's text tower"):
        build_model(ModelSpec(random_init=tiny_hybrid_vl_fields(), text_only=True, kernel_backend="torch"), tok,
                    torch.device("cpu"))


def test_a_critic_from_a_vlm_folder_is_its_text_trunk(pair, tmp_path):
    """A PPO critic / reward trunk (text prompts) from a Qwen3.5 VLM folder: the text tower alone."""
    from rlfuse.model.scalar_head import load_scalar_head_model

    ours, hf = pair
    hf.save_pretrained(tmp_path / "theirs")
    critic = load_scalar_head_model(tmp_path / "theirs", dtype="float32", head="zero")
    assert critic.config.model_type == "qwen3_5_text" and critic.visual is None
    for n, p in critic.model.state_dict().items():
        assert torch.equal(p, ours.model.state_dict()[n]), n
