"""Images in data rows: reading them, the image processor, and the chat-template expansion
into image-pad tokens.

Where a row's images are (`data.images_field`, default `images`, is a column of images: a
list, or one image; a datasets `Image` column arrives as {"bytes", "path"} dicts):
  * chat rows: a message's `content` may be a list of OpenAI-style parts
      {"type": "text", "text": str}
      {"type": "image_url", "image_url": {"url": PATH_OR_DATA_URL}}   (or "image_url": str)
      {"type": "image", "image": PIL.Image | path | {"bytes", "path"}}
      {"type": "image"}   the next image of the images column (Hugging Face's chat format)
  * prompt rows: `data.image_placeholder` (default `<image>`) in the prompt text marks where
    the next image of the images column goes.
An image is a PIL image, a file path (relative paths are read from the working folder), a
`data:image/...;base64,` URL or raw encoded bytes. The processor is the model's
(rlfuse.model.vision.processor: transformers' Qwen2-VL one).

Expansion. Each image becomes the text `<|vision_start|><|image_pad|><|vision_end|>` before
the chat template renders the row (so any template that takes string contents works), the
text is tokenized, and the single image-pad id is then repeated n = t * h * w / merge^2
times, (t, h, w) being the processor's patch grid of the resized image. The row's
`MediaItem`s (rlfuse.engine.media) carry the pixels, grid, media hash and pad-run offset.

Bad input, one ValueError line naming the row and the field: an unreadable or missing
image; an image needing more tokens than data.max_prompt_len; more placeholders than
images or the reverse; a row with images for a model without a vision tower; a processor
whose patch / merge sizes differ from the model's vision config (`ImageProcessor.check_model`).
Test: python -m pytest -q tests/test_vision_data.py
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from rlfuse.engine import IMAGE_TOKENS, MediaItem, media_hash
from rlfuse.model.vision.processor import ImageProcessor


# ---------------------------------------------------------------------- reading images
def load_image(value, where: str, field: str) -> Image.Image:
    """A decoded PIL image from any accepted form (the processor converts it to RGB,
    compositing transparency onto white); a ValueError naming `where` and `field`."""
    def bad(msg):
        return ValueError(f"{where}: field {field}: {msg}")
    if isinstance(value, Image.Image):
        img = value
    elif isinstance(value, dict) and ("bytes" in value or "path" in value):  # a datasets Image cell
        if value.get("bytes"):
            return load_image(bytes(value["bytes"]), where, field)
        if value.get("path"):
            return load_image(str(value["path"]), where, field)
        raise bad("an image cell with neither bytes nor a path")
    elif isinstance(value, (bytes, bytearray)):
        img = _open(io.BytesIO(value), bad, "the image bytes")
    elif isinstance(value, str) and value.startswith("data:"):
        head, _, data = value.partition(",")
        if not head.startswith("data:image/") or not head.endswith(";base64"):
            raise bad(f"a data URL must be data:image/<type>;base64,..., got {head[:40]!r}")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise bad("the data URL's base64 payload does not decode") from None
        img = _open(io.BytesIO(raw), bad, "the data URL")
    elif isinstance(value, str):
        path = Path(value)
        if not path.is_file():
            where_to = "" if path.is_absolute() else f" (a relative path: looked in {Path.cwd()})"
            raise bad(f"no image file {value!r}{where_to}")
        img = _open(path, bad, f"{value!r}")
    elif value is None:
        raise bad("the image is missing (null)")
    else:
        raise bad(f"expected an image (a PIL image, a path, a data: URL or bytes), got {type(value).__name__}")
    return img


def _open(src, bad, what: str) -> Image.Image:
    try:
        img = Image.open(src)
        img.load()
        return img
    except (UnidentifiedImageError, OSError) as e:
        raise bad(f"{what} is not a readable image ({e})") from None


# ---------------------------------------------------------------------- processor
@dataclasses.dataclass(frozen=True, slots=True)
class VisionData:
    """What data needs to turn image rows into prompts: the processor and the marker ids.
    `done` keeps each preprocessed image by media hash, so the SFT examples, the prompts and
    the evaluation built from the same rows preprocess (and hold) an image once."""
    processor: ImageProcessor
    start_id: int
    pad_id: int
    end_id: int
    done: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def for_tokenizer(cls, processor: ImageProcessor, tokenizer) -> "VisionData":
        ids = []
        for tok in IMAGE_TOKENS:
            got = tokenizer.encode(tok, add_special_tokens=False)
            if len(got) != 1:
                raise ValueError(f"tokenizer: {tok} is not one token (got {len(got)} ids); an image model's "
                                 f"tokenizer needs {', '.join(IMAGE_TOKENS)} as added tokens")
            ids.append(got[0])
        return cls(processor, *ids)


# ---------------------------------------------------------------------- rows
def has_images(row: dict, cfg) -> bool:
    """Whether the row carries images (an images column with any, or image content parts)."""
    imgs = row.get(cfg.images_field)
    if imgs not in (None, [], ()):
        return True
    msgs = row.get(cfg.messages_field)
    return isinstance(msgs, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                          and any(_is_image_part(p) for p in m["content"]) for m in msgs)


def _is_image_part(p) -> bool:
    return isinstance(p, dict) and p.get("type") in ("image", "image_url")


def check_parts(where: str, field: str, parts) -> None:
    """A content list is made of text and image parts (the module docstring's forms)."""
    for k, p in enumerate(parts):
        f = f"{field}[{k}]"
        if not isinstance(p, dict) or p.get("type") not in ("text", "image", "image_url"):
            raise ValueError(f"{where}: field {f} must be a content part {{'type': 'text' | 'image' | "
                             f"'image_url', ...}}, got {str(p)[:60]}")
        if p["type"] == "text" and not isinstance(p.get("text"), str):
            raise ValueError(f"{where}: field {f}.text must be a string")
        if p["type"] == "image_url":
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise ValueError(f"{where}: field {f}.image_url must be {{'url': PATH_OR_DATA_URL}} or a string")


def split_images(row: dict, cfg, where: str) -> tuple[dict, list[tuple[str, object]]]:
    """(the row with each image replaced by the marker text, [(field, image value)] in order).
    Chat contents become strings; prompt placeholders become markers. Counts are checked."""
    marker = "".join(IMAGE_TOKENS)
    column = row.get(cfg.images_field)
    column = [] if column is None else list(column) if isinstance(column, (list, tuple)) else [column]
    taken = 0
    found: list[tuple[str, object]] = []
    mf = cfg.messages_field
    if mf in row:
        msgs = []
        for j, m in enumerate(row[mf]):
            if not isinstance(m.get("content"), list):
                msgs.append(m)
                continue
            text = []
            for k, p in enumerate(m["content"]):
                f = f"{mf}[{j}].content[{k}]"
                if p["type"] == "text":
                    text.append(p["text"])
                    continue
                if p["type"] == "image_url":
                    url = p["image_url"]
                    found.append((f + ".image_url", url.get("url") if isinstance(url, dict) else url))
                elif p.get("image") is not None:
                    found.append((f + ".image", p["image"]))
                else:  # {"type": "image"}: the next image of the images column
                    if taken >= len(column):
                        raise ValueError(f"{where}: field {f} is an image placeholder but field "
                                         f"{cfg.images_field!r} has only {len(column)} images: more placeholders "
                                         f"than images")
                    found.append((f"{cfg.images_field}[{taken}]", column[taken]))
                    taken += 1
                text.append(marker)
            msgs.append({**m, "content": "".join(text)})
        row = {**row, mf: msgs}
    else:
        pf, ph = cfg.prompt_field, cfg.image_placeholder
        n = row[pf].count(ph)
        if n > len(column):
            raise ValueError(f"{where}: field {pf!r} has {n} {ph} placeholders but field {cfg.images_field!r} has "
                             f"{len(column)} images: more placeholders than images")
        found = [(f"{cfg.images_field}[{i}]", column[i]) for i in range(n)]
        taken = n
        row = {**row, pf: row[pf].replace(ph, marker)}
    if taken < len(column):
        where_ph = "image parts {'type': 'image'}" if mf in row else f"{cfg.image_placeholder} placeholders"
        raise ValueError(f"{where}: field {cfg.images_field!r} has {len(column)} images but the row has {taken} "
                         f"{where_ph}: more images than placeholders")
    return row, found


def expand_images(ids: list[int], images: list[tuple[str, object]], vision: VisionData, where: str,
                  max_prompt_len: int, mask: list[bool] | None = None
                  ) -> tuple[list[int], tuple[MediaItem, ...], list[bool] | None]:
    """(ids with each image-pad id repeated n times, the MediaItems, the target `mask`
    expanded alike, False on every image token: only the model's own text is trained on),
    images read and preprocessed; the errors of the module docstring name `where` and the field."""
    pads = [i for i, t in enumerate(ids) if t == vision.pad_id]
    if len(pads) != len(images):
        raise ValueError(f"{where}: the rendered prompt holds {len(pads)} {IMAGE_TOKENS[1]} tokens for "
                         f"{len(images)} images (the text itself contains image markers?)")
    out: list[int] = []
    out_mask: list[bool] = []
    media = []
    at = 0
    proc = vision.processor
    for (field, value), p in zip(images, pads):
        img = load_image(value, where, field)
        n = proc.num_image_tokens(img.width, img.height)
        if n > max_prompt_len:
            raise ValueError(f"{where}: field {field}: the image ({img.width}x{img.height}) needs {n} tokens, more "
                             f"than data.max_prompt_len={max_prompt_len}; shrink it or lower the processor's "
                             f"max_pixels ({proc.max_pixels})")
        key = media_hash(img.mode, img.size, img.tobytes())
        if key not in vision.done:
            pixels, grid = proc(img)
            vision.done[key] = (pixels, tuple(int(g) for g in grid[0]))
        pixels, grid = vision.done[key]
        out += ids[at:p]
        media.append(MediaItem(pixels, grid, key, len(out), n))
        out += [vision.pad_id] * n
        if mask is not None:
            out_mask += mask[at:p] + [False] * n
        at = p + 1
    out += ids[at:]
    if mask is None:
        return out, tuple(media), None
    out_mask += mask[at:]
    marks = (vision.start_id, vision.end_id)
    return out, tuple(media), [m and t not in marks for m, t in zip(out_mask, out)]
