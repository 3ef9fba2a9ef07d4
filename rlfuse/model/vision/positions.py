"""Multimodal RoPE positions (Qwen3-VL's mRoPE): three position rows (t, h, w) per token,
and which row each rotary frequency reads.

Positions of one sequence (`mrope_positions`, transformers' `get_rope_index` for images):
  * a text token takes p on all three rows, then p += 1;
  * an image of grid (t, h, w) patches is t * h' * w' tokens (h' = h / merge, w' = w / merge)
    in (frame, row, col) order; its token at (f, r, c) takes (p + f, p + r, p + c); then
    p += max(h', w') (transformers' rule: the time extent is not counted);
  * each run of consecutive placeholder tokens (`image_token_id`) is the next image, in
    order (as transformers groups them: two images always have text, e.g. <vision_end>
    <vision_start>, between them); a run that is not t h' w' long is a ValueError naming
    the image.
After the prompt, token i of the sequence (prompt or generated) has position i + delta on
all rows, delta = max position + 1 - len(prompt) (<= 0): the sequence carries that one
integer and decode never re-derives the image layout (`text_positions`).

Frequencies (`mrope_axis`, transformers' interleaved `mrope_section` = (s_t, s_h, s_w),
s_t + s_h + s_w = Dh / 2): frequency f reads row 1 (h) when f % 3 == 1 and f < 3 s_h, row
2 (w) when f % 3 == 2 and f < 3 s_w, else row 0 (t). The table is built by
`rlfuse.kernels.rope.rope_cos_sin(positions, inv_freq, axis)`; a text token's three equal
rows give exactly plain RoPE's cos/sin.
Test: python -m pytest -q tests/test_qwen3_vl.py -k positions
"""

from __future__ import annotations

import torch


def mrope_axis(mrope_section: tuple[int, ...] | list[int], half: int) -> torch.Tensor:
    """(half,) int64: the position row each of the Dh/2 rotary frequencies reads."""
    if len(mrope_section) != 3 or sum(mrope_section) != half:
        raise ValueError(f"mrope_section {list(mrope_section)} must be three numbers summing to head_dim / 2 = {half}")
    f = torch.arange(half)
    axis = torch.zeros(half, dtype=torch.int64)
    axis[(f % 3 == 1) & (f < 3 * mrope_section[1])] = 1
    axis[(f % 3 == 2) & (f < 3 * mrope_section[2])] = 2
    return axis


def mrope_positions(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, *, spatial_merge_size: int,
                    image_token_id: int, where: str = "input_ids") -> tuple[torch.Tensor, int]:
    """input_ids (T,) of one sequence, the grids (n, 3) of its images in order ->
    (positions (3, T) int64 on input_ids' device, delta). `where` names the row in errors."""
    ids = input_ids.tolist()  # host sync: once per prompt, on the host-side token list
    grids = [] if image_grid_thw is None else image_grid_thw.reshape(-1, 3).tolist()
    m = spatial_merge_size
    rows: list[torch.Tensor] = []
    i = p = img = 0
    T = len(ids)
    while i < T:
        if ids[i] != image_token_id:
            j = i
            while j < T and ids[j] != image_token_id:
                j += 1
            rows.append(torch.arange(p, p + j - i).expand(3, -1))
            p += j - i
            i = j
            continue
        if img == len(grids):
            raise ValueError(f"{where}: image placeholder tokens at index {i} but only {len(grids)} image(s) given "
                             f"(more placeholders than images)")
        t, h, w = grids[img]
        if h % m or w % m:
            raise ValueError(f"{where}: image {img} has grid ({t}, {h}, {w}), not a multiple of merge size {m}")
        hh, ww = h // m, w // m
        n = t * hh * ww
        run = i
        while run < T and ids[run] == image_token_id:
            run += 1
        if run - i != n:
            raise ValueError(f"{where}: image {img} (grid ({t}, {h}, {w})) needs {n} placeholder tokens; the run of "
                             f"them from index {i} has {run - i}")
        ft, fh, fw = torch.meshgrid(torch.arange(t), torch.arange(hh), torch.arange(ww), indexing="ij")
        rows.append(torch.stack([ft.flatten(), fh.flatten(), fw.flatten()]) + p)
        p += max(hh, ww)
        i += n
        img += 1
    if img != len(grids):
        raise ValueError(f"{where}: {len(grids)} image(s) given but placeholders for {img} (more images than "
                         f"placeholders)")
    pos = torch.cat(rows, 1) if rows else torch.zeros(3, 0, dtype=torch.int64)
    delta = (int(pos.max()) + 1 - T) if T else 0
    return pos.to(device=input_ids.device, dtype=torch.int64), delta


def text_positions(start: int, n: int, delta: int, device=None) -> torch.Tensor:
    """(3, n): sequence indices start..start+n-1 after the prompt (or any text-only
    sequence, delta 0), the same position on all three rows."""
    return (torch.arange(start, start + n, device=device) + delta).expand(3, -1).contiguous()
