"""Image rows -> prompts: content parts, the images column with placeholders, datasets Image
cells, the image-pad expansion, media hashes, the image processor and the bad inputs
(rlfuse/data/media.py). Fast: images of a few pixels, a character tokenizer."""

import base64
import io
import json

import pytest
import torch
from PIL import Image

from rlfuse.data.media import IMAGE_TOKENS, ImageProcessor, VisionData, load_image
from rlfuse.data.prompts import build_prompts, build_sft_examples
from rlfuse.data.rows import load_rows
from rlfuse.engine.media import check_media
from rlfuse.run.build import char_tokenizer
from rlfuse.run.config.sections import DataConfig

TEMPLATE = ("{% for m in messages %}{{ '<s>' + m['role'] + ':' + m['content'] + '</s>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<s>assistant:' }}{% endif %}")
# patch 4, merge 2: the resize factor is 8; a 16 x 24 image is a 4 x 6 patch grid, 6 image tokens
PROC = ImageProcessor(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=64, max_pixels=32 * 32)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer("abcdefghijklmnopqrstuvwxyz ?:0123456789<>", control=("<s>", "</s>", *IMAGE_TOKENS),
                          chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def vision(tok):
    return VisionData.for_tokenizer(PROC, tok)


def _img(color, size=(24, 16)):
    return Image.new("RGB", size, color)


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _pairs(rows):
    return [(f"rows.jsonl:{i + 1}", r) for i, r in enumerate(rows)]


def test_content_parts_expand_into_pad_runs_with_media(tmp_path, tok, vision):
    red, blue = _img("red"), _img("blue", (16, 16))
    path = tmp_path / "blue.png"
    blue.save(path)
    url = "data:image/png;base64," + base64.b64encode(_png(red)).decode()
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "what?"},
                                                   {"type": "image", "image": str(path)}]}], "answer": "x"},
        {"messages": [{"role": "user", "content": "just text"}], "answer": "y"},  # a text row in the same data
        {"prompt": "<image>count", "images": [{"bytes": _png(red), "path": None}]},  # a datasets Image cell
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hf style"}]}],
         "images": [red]},
    ]
    cfg = DataConfig(max_prompt_len=64)
    prompts = build_prompts(_pairs(rows), tok, cfg, vision=vision)
    assert [len(p.media) for p in prompts] == [2, 0, 1, 1]
    p = prompts[0]
    a, b = p.media
    assert (a.grid_thw, a.num_tokens, b.grid_thw, b.num_tokens) == ((1, 4, 6), 6, (1, 4, 4), 4)
    assert p.ids[a.offset - 1] == vision.start_id and p.ids[a.end] == vision.end_id
    assert p.ids[b.offset - 1] == vision.start_id and p.ids[b.end] == vision.end_id
    check_media(p.media, p.ids, vision.pad_id, p.where)
    assert tok.decode(p.ids[a.end + 1:b.offset - 1]) == "what?"
    # the same red pixels from a data URL, a datasets cell and a PIL image: one media hash
    assert a.media_hash == prompts[2].media[0].media_hash == prompts[3].media[0].media_hash != b.media_hash
    assert torch.equal(a.pixel_values, PROC(red)[0])
    assert vision.pad_id not in prompts[1].ids


def test_sft_masks_never_cover_image_tokens(tok, vision):
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": _img("red")},
                                                       {"type": "text", "text": "color?"}]},
                          {"role": "assistant", "content": "red"}]},
            {"prompt": "<image>color?", "images": _img("green"), "completion": "green"}]
    ex = build_sft_examples(_pairs(rows), tok, DataConfig(max_prompt_len=64), 128, vision=vision)
    for e in ex:
        (m,) = e.media
        assert not any(e.mask[m.offset - 1:m.end + 1])
        assert tok.decode([t for t, k in zip(e.ids, e.mask) if k]).startswith(("red", "green"))


def test_jsonl_rows_with_content_parts_load(tmp_path, tok, vision):
    _img("red").save(tmp_path / "r.png")
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(tmp_path / "r.png")}}, {"type": "text", "text": "hi"}]}]}))
    pairs = load_rows(DataConfig(train=str(f)))
    (p,) = build_prompts(pairs, tok, DataConfig(train=str(f)), vision=vision)
    assert len(p.media) == 1 and p.where == f"{f}:1"


@pytest.mark.parametrize("row, msg", [
    ({"prompt": "<image><image>x", "images": [_img("red")]},
     "rows.jsonl:1: field 'prompt' has 2 <image> placeholders but field 'images' has 1 images"),
    ({"prompt": "x", "images": [_img("red")]},
     "rows.jsonl:1: field 'images' has 1 images but the row has 0 <image> placeholders"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "rows.jsonl:1: field messages[0].content[0] is an image placeholder but field 'images' has only 0"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}], "images": [_img("red"), _img("red")]},
     "field 'images' has 2 images but the row has 1 image parts"),
    ({"prompt": "<image>x", "images": ["missing.png"]}, "rows.jsonl:1: field images[0]: no image file 'missing.png'"),
    ({"prompt": "<image>x", "images": [b"not a png"]}, "rows.jsonl:1: field images[0]: the image bytes is not a "
                                                        "readable image"),
    ({"prompt": "<image>x", "images": [None]}, "rows.jsonl:1: field images[0]: the image is missing"),
    ({"prompt": "<image>x", "images": ["data:text/plain;base64,aGk="]}, "field images[0]: a data URL must be"),
    ({"prompt": "<image>x", "images": [_img("red", (400, 400))]},
     "rows.jsonl:1: field images[0]: the image (400x400) needs 16 tokens, more than data.max_prompt_len=12"),
])
def test_bad_image_rows_name_row_and_field(tok, vision, row, msg):
    with pytest.raises(ValueError) as e:
        build_prompts(_pairs([row]), tok, DataConfig(max_prompt_len=12), vision=vision)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_images_for_a_text_model_and_text_markers_are_errors(tok, vision):
    with pytest.raises(ValueError, match=r"rows.jsonl:1: field images\[0\]: the row has images but the model has "
                                         r"no vision tower"):
        build_prompts(_pairs([{"prompt": "<image>x", "images": [_img("red")]}]), tok, DataConfig())
    # a text that spells the pad marker itself: the ids then hold more pads than images
    row = {"prompt": "<image><|image_pad|>", "images": [_img("red")]}
    with pytest.raises(ValueError, match="holds 2 <\\|image_pad\\|> tokens for 1 images"):
        build_prompts(_pairs([row]), tok, DataConfig(), vision=vision)


def test_a_processor_that_does_not_fit_the_model_is_refused_at_session_start(tmp_path):
    from rlfuse.recipes.vision_demo import vision_demo_config
    from rlfuse.run.config import replace
    from rlfuse.train import open_session
    cfg = replace(vision_demo_config("ci", str(tmp_path)), **{"model.processor": {"merge_size": 4},
                                                               "data.train_size": 8, "data.eval_size": 4})
    with pytest.raises(ValueError, match="model.processor: field 'merge_size' is 4 but the model's vision_config."
                                         "spatial_merge_size is 2"):
        open_session(cfg)
    cfg = replace(cfg, **{"model.processor": {"max_pixel": 4}})
    with pytest.raises(ValueError, match="model.processor.max_pixel: unknown image processor setting"):
        open_session(cfg)


def test_load_image_forms(tmp_path):
    img = _img("red")
    img.save(tmp_path / "a.png")
    for v in (img, str(tmp_path / "a.png"), _png(img), {"bytes": None, "path": str(tmp_path / "a.png")},
              "data:image/png;base64," + base64.b64encode(_png(img)).decode()):
        got = load_image(v, "r", "f")
        assert got.convert("RGB").tobytes() == img.tobytes()
    with pytest.raises(ValueError, match="r: field f: expected an image"):
        load_image(3, "r", "f")
