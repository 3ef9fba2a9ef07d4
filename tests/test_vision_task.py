"""The built-in image task count_squares (rlfuse/data/image_tasks.py): deterministic,
disjoint splits, the count is what the image shows, and its rows become image prompts."""

from PIL import Image

from rlfuse.data.image_tasks import COLORS, count_squares_rows, render_layout
from rlfuse.data.media import IMAGE_TOKENS, ImageProcessor, VisionData
from rlfuse.data.prompts import build_prompts
from rlfuse.data.rows import load_rows
from rlfuse.data.tasks import task_alphabet, verify_arithmetic
from rlfuse.run.build import char_tokenizer
from rlfuse.run.config.sections import DataConfig


def _red_cells(img: Image.Image, cells: int) -> int:
    """Count cells whose centre pixel is red: what the picture shows, independent of the layout string."""
    c = img.width // cells
    return sum(img.getpixel((x * c + c // 2, y * c + c // 2)) == COLORS["R"] for y in range(cells)
               for x in range(cells))


def test_rows_are_deterministic_and_show_their_answer():
    a, b = count_squares_rows(50, seed=3), count_squares_rows(50, seed=3)
    assert [r["key"] for r in a] == [r["key"] for r in b]
    assert all(r1["images"][0].tobytes() == r2["images"][0].tobytes() for r1, r2 in zip(a, b))
    assert [r["key"] for r in count_squares_rows(50, seed=4)] != [r["key"] for r in a]
    counts = set()
    for r in a:
        (img,) = r["images"]
        assert img.size == (32, 32) and _red_cells(img, 4) == int(r["answer"]) == r["key"].count("R")
        assert verify_arithmetic(r["completion"], r["answer"])
        counts.add(r["answer"])
    assert counts == {"1", "2", "3", "4"}
    assert render_layout("R" + "." * 15, 32, 4).getpixel((0, 0)) == (255, 255, 255)  # a margin around a square


def test_builtin_splits_are_disjoint_and_become_image_prompts():
    cfg = DataConfig(train="builtin:count_squares", train_size=300, eval_size=40, max_prompt_len=64)
    train, ev = load_rows(cfg, "train"), load_rows(cfg, "eval")
    assert not {r["key"] for _, r in train} & {r["key"] for _, r in ev}
    tok = char_tokenizer(task_alphabet("count_squares", [r for _, r in train]), control=IMAGE_TOKENS)
    vision = VisionData.for_tokenizer(ImageProcessor(patch_size=8, merge_size=2, min_pixels=1024, max_pixels=1024),
                                      tok)
    prompts = build_prompts(ev, tok, cfg, "eval", vision=vision)
    assert len(prompts) == 40 and all(len(p.media) == 1 and p.media[0].num_tokens == 4 for p in prompts)
    assert len({p.media[0].media_hash for p in prompts}) == 40
