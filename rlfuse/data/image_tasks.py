"""Built-in image tasks rendered with Pillow (no download): rows with an `images` column.

count_squares: a `size` x `size` white image cut into `cells` x `cells` cells; 1..max_count
    cells hold a red square and 0..distractors others a square of another colour (blue or
    green), each square filling its cell but a 1-pixel margin. The prompt is
    "<image>How many red squares?", the answer and SFT completion the count. The layout
    (which cell holds which colour) is the row's identity: `key`, so held-out splits are
    disjoint from training ones. Verifier: verify_arithmetic (the integer answer), i.e. the
    builtin reward `arithmetic`.
Deterministic in the seed. With the default size 32 and 4 cells, a cell is 8 x 8 pixels:
one patch of a patch-8 tower (the tiny VLM of `rlfuse demo --vision`).
Test: python -m pytest -q tests/test_vision_task.py
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

COLORS = {"R": (220, 30, 30), "B": (30, 60, 220), "G": (30, 170, 60)}
PROMPT = "<image>How many red squares?"


def render_layout(layout: str, size: int, cells: int) -> Image.Image:
    """The image of a layout string: one char per cell, row-major, '.' empty or a COLORS key."""
    img = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    c = size // cells
    for i, ch in enumerate(layout):
        if ch != ".":
            y, x = divmod(i, cells)
            draw.rectangle((x * c + 1, y * c + 1, x * c + c - 2, y * c + c - 2), fill=COLORS[ch])
    return img


def count_squares_rows(n: int, *, seed: int = 0, size: int = 32, cells: int = 4, max_count: int = 4,
                       distractors: int = 2, exclude=()) -> list[dict]:
    if cells < 1 or size % cells or size // cells < 4:
        raise ValueError(f"count_squares task: size must be a multiple of cells with cells of >= 4 pixels, got "
                         f"size={size}, cells={cells}")
    if not 1 <= max_count or max_count + distractors > cells * cells:
        raise ValueError(f"count_squares task: max_count ({max_count}) >= 1 and max_count + distractors "
                         f"({distractors}) <= cells^2 ({cells * cells})")
    rng = random.Random(seed)
    seen = set(exclude)
    rows = []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise ValueError(f"count_squares task: could not draw {n} distinct layouts (size={size}, cells={cells}, "
                             f"max_count={max_count}, distractors={distractors})")
        k, d = rng.randint(1, max_count), rng.randint(0, distractors)
        where = rng.sample(range(cells * cells), k + d)
        layout = ["."] * (cells * cells)
        for i in where[:k]:
            layout[i] = "R"
        for i in where[k:]:
            layout[i] = rng.choice("BG")
        key = "".join(layout)
        if key in seen:
            continue
        seen.add(key)
        rows.append({"prompt": PROMPT, "answer": str(k), "completion": str(k), "key": key,
                     "images": [render_layout(key, size, cells)]})
    return rows


IMAGE_TASKS = {"count_squares": count_squares_rows}
