"""Qwen3-VL against transformers' Qwen3VLForConditionalGeneration on random weights (tiny
shapes, CPU, float64): the vision tower's features and DeepStack features, the merged
sequence, the mRoPE position ids, logits, loss and gradients, for one image, several images
of different sizes in one prompt, and a packed batch mixing text-only and image rows; the
config and checkpoint round trip (saved folders load in transformers); mRoPE's text rows
bitwise plain RoPE; batch invariance of the tower in exact numerics.

    python -m pytest -q tests/test_qwen3_vl.py
"""

import pytest
import torch

from rlfuse.kernels import use_backend, use_numerics
from rlfuse.model import CausalLM, ModelConfig, Packed
from rlfuse.model.arch.qwen3_vl import tiny_vl_fields
from rlfuse.model.vision import ImageFeatures, mrope_positions, text_positions, tokens_per_image
from rlfuse.model.weights import checkpoint_names, load_model, save_model

transformers = pytest.importorskip("transformers")
CFG = ModelConfig(**tiny_vl_fields())
V = CFG.vision
IMG, START, END = V.image_token_id, V.vision_start_token_id, V.vision_end_token_id


def _hf_config(cfg: ModelConfig):
    d = cfg.to_hf()
    hcfg = transformers.Qwen3VLConfig(**{k: v for k, v in d.items() if k != "architectures"})
    hcfg._attn_implementation = "eager"
    return hcfg


@pytest.fixture(scope="module")
def pair():
    """(ours, transformers') in float64 with the same random weights (norms and biases perturbed too)."""
    ours = CausalLM(CFG).double()
    g = torch.Generator().manual_seed(0)
    ours.init_weights(std=0.1, generator=g)
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() == 1:  # norms and biases away from their init values, so a swapped one shows
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    hf = transformers.Qwen3VLForConditionalGeneration(_hf_config(CFG)).double().eval()
    name = checkpoint_names(ours)
    sd = {name(n): p.detach() for n, p in ours.named_parameters()}
    assert set(sd) == set(hf.state_dict())
    hf.load_state_dict(sd)
    return ours, hf


def _images(g, grids):
    grids = torch.tensor(grids)
    return torch.randn(int(grids.prod(-1).sum()), V.patch_dim, generator=g, dtype=torch.float64), grids


def _prompt(grids, text=(11, 12, 13)):
    """[text, <start> image placeholders <end>, text] per image."""
    ids = [1, 2]
    for n in tokens_per_image(torch.tensor(grids), V.spatial_merge_size):
        ids += [START] + [IMG] * n + [END, *text]
    return torch.tensor(ids)


def _hf_rows(hf, rows):
    """transformers' logits per row: [(ids, pixels or None, grids or None)] -> list of (T, V)."""
    out = []
    for ids, pix, grids in rows:
        mm = (ids == IMG).int()[None]
        out.append(hf(input_ids=ids[None], pixel_values=pix, image_grid_thw=grids, mm_token_type_ids=mm).logits[0])
    return out


def test_positions_match_transformers(pair):
    _, hf = pair
    cases = [[[1, 4, 6]], [[1, 4, 6], [1, 2, 2], [1, 6, 2]], [[1, 8, 2]], []]
    for grids in cases:
        ids = _prompt(grids) if grids else torch.arange(1, 9)
        g = torch.tensor(grids).reshape(-1, 3)
        pos, delta = mrope_positions(ids, g if grids else None, spatial_merge_size=2, image_token_id=IMG)
        want, want_delta = hf.model.get_rope_index(ids[None], (ids == IMG).int()[None],
                                                   image_grid_thw=g if grids else None)
        assert torch.equal(pos, want[:, 0]) and delta == int(want_delta)
        # decode continues from the carried delta on all three rows
        assert torch.equal(text_positions(len(ids), 2, delta)[:, 0], pos.max().expand(3) + 1)
    # an image right at the start and at the end of the sequence
    ids = torch.tensor([START] + [IMG] * 6 + [END])
    pos, delta = mrope_positions(ids, torch.tensor([[1, 4, 6]]), spatial_merge_size=2, image_token_id=IMG)
    want, want_delta = hf.model.get_rope_index(ids[None], (ids == IMG).int()[None],
                                               image_grid_thw=torch.tensor([[1, 4, 6]]))
    assert torch.equal(pos, want[:, 0]) and delta == int(want_delta)


def test_positions_refuse_mismatched_placeholders():
    ids = _prompt([[1, 4, 6]])
    kw = dict(spatial_merge_size=2, image_token_id=IMG, where="row 3")
    with pytest.raises(ValueError, match="row 3: image placeholder tokens at index 3 but only 0 image"):
        mrope_positions(ids, None, **kw)
    with pytest.raises(ValueError, match=r"row 3: 2 image\(s\) given but placeholders for 1"):
        mrope_positions(ids, torch.tensor([[1, 4, 6], [1, 2, 2]]), **kw)
    with pytest.raises(ValueError, match=r"image 0 \(grid \(1, 4, 4\)\) needs 4 placeholder tokens; the run of "
                                         r"them from index 3 has 6"):
        mrope_positions(ids, torch.tensor([[1, 4, 4]]), **kw)


def test_vision_tower_matches_transformers(pair):
    ours, hf = pair
    pix, grids = _images(torch.Generator().manual_seed(1), [[1, 4, 6], [1, 2, 2], [1, 6, 4]])
    with torch.no_grad():
        want = hf.model.get_image_features(pix, grids)
        got = ours.encode_images(pix, grids)
    assert got.embeds.shape == (sum(tokens_per_image(grids, 2)), CFG.hidden_size)
    torch.testing.assert_close(got.embeds, torch.cat(want.pooler_output), rtol=0, atol=1e-6)
    assert got.deepstack.shape[0] == len(want.deepstack_features) == 2
    for a, b in zip(got.deepstack, want.deepstack_features):
        torch.testing.assert_close(a, torch.cat(b), rtol=0, atol=1e-6)


def test_merged_sequence_matches_transformers(pair):
    """The embeddings after the scatter: image rows hold the merger's output, in order."""
    ours, hf = pair
    pix, grids = _images(torch.Generator().manual_seed(2), [[1, 2, 4], [1, 4, 2]])
    ids = _prompt(grids.tolist())
    with torch.no_grad():
        feats = ours.encode_images(pix, grids)
        emb = ours.model.embed_tokens(ids).index_copy(0, ours._image_rows(ids, feats), feats.embeds)
        want = hf.model.get_input_embeddings()(ids)
        want = want.masked_scatter((ids == IMG)[:, None], torch.cat(hf.model.get_image_features(pix, grids).pooler_output))
    torch.testing.assert_close(emb, want, rtol=0, atol=1e-6)


def test_logits_loss_and_gradients_match_transformers(pair):
    """One packed batch: an image row, a two-image row (different sizes), a text-only row;
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
    pix, grids = torch.cat([pa, pb]), torch.cat([ga, gb])
    ours.set_vision_trainable(True)
    try:
        h = ours(ids, pos, Packed.from_lengths([len(r[0]) for r in rows]), pixel_values=pix, image_grid_thw=grids)
        logits = ours.logits(h).double()
        want = _hf_rows(hf, rows)
        torch.testing.assert_close(logits, torch.cat(want), rtol=0, atol=1e-5)

        def loss(lg, parts):  # next-token loss within each row
            out, s = 0, 0
            for r in parts:
                n = len(r[0])
                out = out + torch.nn.functional.cross_entropy(lg[s:s + n - 1], r[0][1:], reduction="sum")
                s += n
            return out
        l_ours = loss(logits, rows)
        l_hf = loss(torch.cat(want), rows)
        torch.testing.assert_close(l_ours, l_hf, rtol=1e-7, atol=0)
        name = checkpoint_names(ours)
        ours_p = dict(ours.named_parameters())
        hf_p = dict(hf.named_parameters())
        grads = torch.autograd.grad(l_ours, list(ours_p.values()))
        hf_grads = torch.autograd.grad(l_hf, [hf_p[name(n)] for n in ours_p])
        for n, a, b in zip(ours_p, grads, hf_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
        assert grads[list(ours_p).index("visual.patch_embed.proj.weight")].abs().sum() > 0
    finally:
        ours.set_vision_trainable(False)


def test_precomputed_features_and_text_rows_bitwise(pair):
    """Cached features (per image, cat back) give the pixels' result bitwise; a text-only
    row with three equal mRoPE rows gives plain RoPE's bits; DeepStack leaves text rows alone."""
    ours, _ = pair
    pix, grids = _images(torch.Generator().manual_seed(4), [[1, 4, 2], [1, 2, 2]])
    ids = _prompt(grids.tolist())
    pos, _ = mrope_positions(ids, grids, spatial_merge_size=2, image_token_id=IMG)
    attn = Packed.from_lengths([len(ids)])
    with torch.no_grad(), use_backend("torch"):
        a = ours(ids, pos, attn, pixel_values=pix, image_grid_thw=grids)
        feats = ours.encode_images(pix, grids)
        per_image = [ours.encode_images(p, gr[None]) for p, gr in zip(pix.split(grids.prod(-1).tolist()), grids)]
        b = ours(ids, pos, attn, ImageFeatures.cat(feats.split(tokens_per_image(grids, 2))))
        assert torch.equal(a, b)
        for f, want in zip(per_image, feats.split(tokens_per_image(grids, 2))):
            torch.testing.assert_close(f.embeds, want.embeds, rtol=0, atol=1e-12)
        text = torch.arange(40, 57)
        for numerics in ("fast", "exact"):
            with use_numerics(numerics):
                t1 = ours(text, torch.arange(17), Packed.from_lengths([17]))
                t3 = ours(text, text_positions(0, 17, 0), Packed.from_lengths([17]))
                assert torch.equal(t1, t3)


def test_tower_batch_invariant_in_exact_numerics(pair):
    ours, _ = pair
    model = CausalLM(CFG)  # fp32
    model.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
    pix, grids = _images(torch.Generator().manual_seed(5), [[1, 4, 6], [1, 2, 2], [1, 2, 4]])
    pix = pix.float()
    with torch.no_grad(), use_backend("torch"), use_numerics("exact"):
        together = model.encode_images(pix, grids)
        alone = [model.encode_images(p, gr[None]) for p, gr in zip(pix.split(grids.prod(-1).tolist()), grids)]
    got = ImageFeatures.cat(alone)
    assert torch.equal(together.embeds, got.embeds) and torch.equal(together.deepstack, got.deepstack)


def test_forward_refuses_mismatched_features(pair):
    ours, _ = pair
    pix, grids = _images(torch.Generator().manual_seed(6), [[1, 4, 6]])
    ids = _prompt([[1, 2, 2]])
    pos, _ = mrope_positions(ids, torch.tensor([[1, 2, 2]]), spatial_merge_size=2, image_token_id=IMG)
    with pytest.raises(ValueError, match="input_ids hold 1 image placeholder tokens .* for 6 image feature rows"):
        ours(ids, pos, Packed.from_lengths([len(ids)]), pixel_values=pix, image_grid_thw=grids)
    with pytest.raises(ValueError, match=r"positions \(8,\): a forward with images takes mRoPE positions \(3, T\)"):
        ours(ids, pos[0], Packed.from_lengths([len(ids)]), pixel_values=pix, image_grid_thw=grids)
    with pytest.raises(ValueError, match=r"pixel_values has 24 patches; image_grid_thw \[\[1, 2, 2\]\] holds 4"):
        ours.encode_images(pix, torch.tensor([[1, 2, 2]]))


def test_vision_frozen_by_default():
    m = CausalLM(CFG)
    assert not any(p.requires_grad for p in m.visual.parameters())
    assert all(p.requires_grad for n, p in m.named_parameters() if not n.startswith("visual."))
    m.set_vision_trainable(True)
    assert all(p.requires_grad for p in m.visual.parameters())


def test_save_load_round_trip_and_transformers_loads_it(pair, tmp_path):
    ours, _ = pair
    folder = save_model(ours, tmp_path / "vl", dtype="float32")
    back = load_model(folder, dtype=torch.float64)
    assert back.config == ModelConfig(**tiny_vl_fields(torch_dtype="float32"))
    for (n, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(a.float().double(), b, rtol=0, atol=0, msg=n)
    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float64).eval()
    pix, grids = _images(torch.Generator().manual_seed(7), [[1, 2, 4]])
    ids = _prompt(grids.tolist())
    pos, _ = mrope_positions(ids, grids, spatial_merge_size=2, image_token_id=IMG)
    with torch.no_grad():
        h = back(ids, pos, Packed.from_lengths([len(ids)]), pixel_values=pix, image_grid_thw=grids)
        want = _hf_rows(hf, [(ids, pix, grids)])[0]
    torch.testing.assert_close(back.logits(h).double(), want, rtol=0, atol=1e-5)


def test_config_errors():
    with pytest.raises(ValueError, match="'vision' / 'mrope_section' is set, but Qwen3ForCausalLM has no vision"):
        ModelConfig(**tiny_vl_fields(model_type="qwen3"))
    with pytest.raises(ValueError, match=r"'mrope_section' \[2, 3, 2\] must be three numbers summing to "
                                         r"head_dim / 2 = 8"):
        ModelConfig(**tiny_vl_fields(mrope_section=(2, 3, 2)))
    d = CFG.to_hf()
    d["vision_config"] = {**d["vision_config"], "deepstack_visual_indexes": [0, 7]}
    with pytest.raises(ValueError, match=r"config \(vision_config\): vision config field 'deepstack_visual_indexes' "
                                         r"must list block indices in \[0, 3\)"):
        ModelConfig.from_hf(d)
    with pytest.raises(ValueError, match=r"'image_token_id' is 509; it must be a token id below vocab_size \(300\)"):
        ModelConfig(**{**tiny_vl_fields(), "vocab_size": 300})
    assert ModelConfig(**tiny_vl_fields(vocab_size=300)).vision.image_token_id == 297
    d = CFG.to_hf()
    del d["text_config"]
    with pytest.raises(ValueError, match="config: a Qwen3VLForConditionalGeneration config needs a 'text_config'"):
        ModelConfig.from_hf(d)


def _random_images():
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    ims = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(30, 50), (17, 9), (90, 70)]]
    ims.append(Image.fromarray(rng.integers(0, 256, (20, 21), dtype=np.uint8)))  # grayscale
    ims.append(Image.fromarray(rng.integers(0, 256, (12, 40, 4), dtype=np.uint8)))  # RGBA
    return ims


def test_processor_matches_transformers(tmp_path):
    """pixel_values and grids as transformers' Qwen2VL processor (PIL backend), with images
    scaled up (min_pixels), kept, and scaled down (max_pixels); read from a folder's file."""
    import json

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rlfuse.model.vision.processor import ImageProcessor
    ours = ImageProcessor(patch_size=4, merge_size=2, min_pixels=300, max_pixels=2048,
                          image_mean=(0.48, 0.45, 0.4), image_std=(0.26, 0.26, 0.27))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(ours.to_dict()))
    assert ImageProcessor.from_folder(tmp_path) == ours
    theirs = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    ims = _random_images()
    pix, grids = ours(ims)
    want = theirs(ims, return_tensors="pt")
    assert torch.equal(grids, want["image_grid_thw"])
    torch.testing.assert_close(pix, want["pixel_values"], rtol=0, atol=1e-6)
    assert [ours.num_image_tokens(*im.size) for im in ims] == tokens_per_image(grids, 2)
    ImageProcessor.for_model(V).check_model(V)


def test_processor_bad_inputs(tmp_path):
    import json

    from rlfuse.model.vision.processor import ImageProcessor
    with pytest.raises(ValueError, match="preprocessor_config.json: no such file"):
        ImageProcessor.from_folder(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16, "do_resize": False}))
    with pytest.raises(ValueError, match="preprocessor_config.json: field 'do_resize' is False"):
        ImageProcessor.from_folder(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 0}))
    with pytest.raises(ValueError, match="field 'patch_size' must be a positive integer, got 0"):
        ImageProcessor.from_folder(tmp_path)
    with pytest.raises(ValueError, match="field 'patch_size' is 16 but the model's vision_config.patch_size is 4"):
        ImageProcessor(patch_size=16).check_model(V)
    with pytest.raises(ValueError, match="expected PIL images, got str"):
        ImageProcessor.for_model(V)(["cat.png"])


def test_lora_on_the_language_model(pair, tmp_path):
    """LoRA adapts the text tower only (the vision tower has no target and stays frozen);
    forwards with images train A and B; the PEFT folder names transformers' modules
    (model.language_model.*), so PEFT applies it to Qwen3VLForConditionalGeneration."""
    from rlfuse.model.lora import BaseModelView, LoRAConfig, attach_lora, init_lora_, lora_parameters
    from rlfuse.model.lora_peft import load_peft_adapter, save_peft_adapter
    ours, hf = pair
    model = CausalLM(CFG).double()
    model.load_state_dict(ours.state_dict())
    names = attach_lora(model, LoRAConfig(rank=4, alpha=8))
    assert names and all(n.startswith("model.layers.") for n in names)
    init_lora_(model, seed=1, b_std=0.1)
    assert not any(p.requires_grad for p in model.visual.parameters())
    pix, grids = _images(torch.Generator().manual_seed(8), [[1, 4, 2]])
    ids = _prompt(grids.tolist())
    pos, _ = mrope_positions(ids, grids, spatial_merge_size=2, image_token_id=IMG)
    attn = Packed.from_lengths([len(ids)])
    feats = BaseModelView(model).encode_images(pix, grids)
    h = model(ids, pos, attn, feats)
    trained = dict(lora_parameters(model))
    grads = torch.autograd.grad(model.logits(h).logsumexp(-1).sum(), list(trained.values()))
    assert all(g.abs().sum() > 0 for g in grads)
    with torch.no_grad():
        base = BaseModelView(model)(ids, pos, attn, feats)
        torch.testing.assert_close(base, ours(ids, pos, attn, feats), rtol=0, atol=0)
    folder = save_peft_adapter(model, tmp_path / "adapter")
    back = CausalLM(CFG).double()
    back.load_state_dict(ours.state_dict())
    load_peft_adapter(back, folder)
    with torch.no_grad():
        torch.testing.assert_close(back(ids, pos, attn, feats), h.detach(), rtol=0, atol=0)
    peft = pytest.importorskip("peft")
    hf_lora = peft.PeftModel.from_pretrained(hf, folder)
    try:
        with torch.no_grad():
            want = _hf_rows(hf_lora, [(ids, pix, grids)])[0]
        torch.testing.assert_close(model.logits(h.detach()).double(), want, rtol=0, atol=1e-5)
    finally:
        hf_lora.unload()


def _backend_checks(cfg: ModelConfig, dev: str, dtype: torch.dtype, grids_per_row):
    """Triton vs the references and exact-numerics batch invariance on `dev`: a packed batch
    of image rows and a text row. (1) the Triton backend's hidden states are no further from
    an fp32 reference-backend gold than the reference backend in `dtype` is (x2 + slack);
    (2) in exact numerics, each row's hidden states packed with the others equal the row run
    alone, bitwise, and the tower's features of the images encoded together equal them
    encoded one by one; (3) a backward through the trainable tower runs and is finite."""
    from rlfuse.kernels import use_backend, use_numerics
    v = cfg.vision
    gold = CausalLM(cfg)
    gold.init_weights(std=0.05, generator=torch.Generator().manual_seed(0))
    gold = gold.to(dev)
    model = CausalLM(cfg).to(dev)
    model.load_state_dict(gold.state_dict())
    model = model.to(dtype)
    g = torch.Generator().manual_seed(1)
    rows = []
    for grids in grids_per_row:
        if not grids:
            rows.append((torch.randint(0, v.vision_start_token_id, (23,), generator=g), None, None))
            continue
        gr = torch.tensor(grids)
        ids = [1, 2]
        for n in tokens_per_image(gr, v.spatial_merge_size):
            ids += [v.vision_start_token_id] + [v.image_token_id] * n + [v.vision_end_token_id, 5, 6]
        pix = torch.randn(int(gr.prod(-1).sum()), v.patch_dim, generator=g)
        rows.append((torch.tensor(ids), pix, gr))

    def run(m, sel, dt):
        ids = torch.cat([rows[i][0] for i in sel]).to(dev)
        pos = torch.cat([mrope_positions(rows[i][0], rows[i][2], spatial_merge_size=v.spatial_merge_size,
                                         image_token_id=v.image_token_id)[0] for i in sel], 1).to(dev)
        img = [i for i in sel if rows[i][1] is not None]
        kw = {}
        if img:
            kw = dict(pixel_values=torch.cat([rows[i][1] for i in img]).to(dev, dt),
                      image_grid_thw=torch.cat([rows[i][2] for i in img]))
        return m(ids, pos, Packed.from_lengths([len(rows[i][0]) for i in sel], device=dev), **kw)

    everything = list(range(len(rows)))
    with torch.no_grad():
        with use_backend("torch"):
            want = run(gold, everything, torch.float32)
            ref_err = (run(model, everything, dtype).float() - want).abs().max()
        with use_backend("triton"):
            tri_err = (run(model, everything, dtype).float() - want).abs().max()
    assert tri_err <= 2 * ref_err + 1e-3, (tri_err, ref_err)
    with use_backend("triton"), use_numerics("exact"):
        with torch.no_grad():
            packed = run(model, everything, dtype)
            start = 0
            for i in everything:
                n = len(rows[i][0])
                assert torch.equal(packed[start:start + n], run(model, [i], dtype)), f"row {i}"
                start += n
            img = [i for i in everything if rows[i][1] is not None]
            pix = torch.cat([rows[i][1] for i in img]).to(dev, dtype)
            grids = torch.cat([rows[i][2] for i in img])
            together = model.encode_images(pix, grids)
            alone = ImageFeatures.cat([model.encode_images(p, gr[None]) for p, gr in
                                       zip(pix.split(grids.prod(-1).tolist()), grids)])
            assert torch.equal(together.embeds, alone.embeds) and torch.equal(together.deepstack, alone.deepstack)
        model.set_vision_trainable(True)
        run(model, everything, dtype).float().square().mean().backward()
        grads = [p.grad for p in model.visual.parameters()]
        assert all(gr is not None and torch.isfinite(gr).all() for gr in grads)


@pytest.mark.slow
def test_backends_on_cpu_interpreter():
    """`_backend_checks` at the tiny shape under Triton's CPU interpreter (slow)."""
    _backend_checks(CFG, "cpu", torch.float32, [[[1, 4, 2], [1, 2, 2]], [], [[1, 2, 4]]])


@pytest.mark.gpu
def test_gpu_backends_and_exact_batch_invariance():
    """On CUDA in bf16 at a small Qwen3-VL shape (text head_dim 64, vision width 256 /
    head_dim 64, patch 16): 448 x 448-like grids and smaller ones, a text-only row."""
    from rlfuse.model.vision import VisionConfig
    vision = VisionConfig(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=512,
                          num_position_embeddings=256, deepstack_visual_indexes=(1, 2), image_token_id=1000,
                          video_token_id=1001, vision_start_token_id=998, vision_end_token_id=999)
    cfg = ModelConfig(**tiny_vl_fields(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                       mrope_section=(12, 10, 10), vision=vision))
    _backend_checks(cfg, "cuda", torch.bfloat16, [[[1, 28, 28], [1, 8, 12]], [], [[1, 16, 8]], [[1, 28, 28]]])


def test_paged_prefill_chunks_and_decode_equal_the_packed_forward(pair):
    """The engine's way through the model, by hand: the prompt prefilled into a paged KV cache
    in two chunks that split an image's tokens (each chunk gets its share of the cached
    features, `ImageFeatures.narrow`), then decode steps at positions index + delta on all
    rows, passed as (T,) or (3, T). In exact numerics every row equals the packed forward of
    the whole sequence bitwise (the trainer's forward)."""
    from rlfuse.kernels import use_backend, use_numerics
    from rlfuse.model import PagedKV
    ours, _ = pair
    model = CausalLM(CFG)
    model.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
    pix, grids = _images(torch.Generator().manual_seed(9), [[1, 4, 6], [1, 2, 2]])
    pix = pix.float()
    prompt = _prompt(grids.tolist())
    completion = torch.tensor([40, 41, 42, 43])
    ids = torch.cat([prompt, completion])
    P, T = len(prompt), len(ids)
    pos_prompt, delta = mrope_positions(prompt, grids, spatial_merge_size=2, image_token_id=IMG)
    pos = torch.cat([pos_prompt, text_positions(P, len(completion), delta)], 1)
    block = 4
    n_blocks = -(-T // block) + 1
    kv = [(torch.zeros(n_blocks, block, CFG.num_key_value_heads, CFG.head_dim),
           torch.zeros(n_blocks, block, CFG.num_key_value_heads, CFG.head_dim)) for _ in range(CFG.num_hidden_layers)]
    table = torch.arange(n_blocks, dtype=torch.int32)[None, :]

    def step(start, end, positions, feats=None):
        attn = PagedKV(kv, torch.arange(start, end), torch.tensor([0, end - start], dtype=torch.int32),
                       torch.tensor([end], dtype=torch.int32), table, end - start)
        return model(ids[start:end], positions, attn, feats)

    with torch.no_grad(), use_backend("torch"), use_numerics("exact"):
        feats = model.encode_images(pix, grids)
        want = model(ids, pos, Packed.from_lengths([T]), feats)
        cut = 6  # inside the first image's 6 tokens (they start at index 3)
        n_img_before = int((prompt[:cut] == IMG).sum())
        got = [step(0, cut, pos[:, :cut], feats.narrow(0, n_img_before)),
               step(cut, P, pos[:, cut:P], feats.narrow(n_img_before, len(feats) - n_img_before))]
        for i in range(P, T):
            got.append(step(i, i + 1, pos[:, i:i + 1] if i % 2 else pos[0, i:i + 1]))
    assert torch.equal(torch.cat(got), want)


def test_gradient_checkpointing_with_images(pair):
    """The trainer's recompute-in-backward path gives the same gradients (the DeepStack adds sit
    between the checkpointed layers)."""
    ours, _ = pair
    pix, grids = _images(torch.Generator().manual_seed(10), [[1, 2, 4]])
    ids = _prompt(grids.tolist())
    pos, _ = mrope_positions(ids, grids, spatial_merge_size=2, image_token_id=IMG)
    feats = ours.encode_images(pix, grids)
    params = [p for p in ours.parameters() if p.requires_grad]
    out = []
    for ckpt in (False, True):
        ours.gradient_checkpointing = ckpt
        try:
            h = ours(ids, pos, Packed.from_lengths([len(ids)]), feats)
            out.append(torch.autograd.grad(ours.logits(h).logsumexp(-1).sum(), params))
        finally:
            ours.gradient_checkpointing = False
    assert all(torch.equal(a, b) for a, b in zip(*out))
