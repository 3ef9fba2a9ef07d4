"""The image processor of Qwen2-VL / Qwen3-VL checkpoints (transformers' Qwen2VLImageProcessor,
PIL backend): a PIL image -> patch rows `pixel_values` and its grid `image_grid_thw`.

For one image (W x H pixels), with factor = patch_size * merge_size:
  1. size: `smart_resize` -- both sides rounded to multiples of factor, then scaled (keeping
     the aspect ratio) into [min_pixels, max_pixels]; an aspect ratio above 200 is refused;
  2. RGB (transparency composited onto white), resized to that size with PIL bicubic, x = uint8 * rescale_factor, then
     (x - mean) / std per channel, fp32;
  3. patches: grid (1, h, w) = (1, H' / P, W' / P); rows in merge-block-major order (each
     m x m block of neighbouring patches consecutive, as the merger joins them), each row
     the (C, Tp, P, P) values with the image repeated over the Tp frames.
The image takes t * h * w / m^2 placeholder tokens in the prompt (`num_image_tokens`).
Read from a checkpoint's preprocessor_config.json (`ImageProcessor.from_folder`; no hub).
Test: python -m pytest -q tests/test_qwen3_vl.py -k processor
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from rlfuse.model.vision.config import VisionConfig

_RESAMPLE = {0: Image.NEAREST, 1: Image.LANCZOS, 2: Image.BILINEAR, 3: Image.BICUBIC}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) multiples of `factor`, near the aspect ratio, pixels in [min, max]."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image of {width} x {height} pixels: aspect ratio above 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ImageProcessor:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    min_pixels: int = 65536
    """size.shortest_edge in the file: the fewest pixels an image is scaled up to."""
    max_pixels: int = 16777216
    """size.longest_edge in the file: the most pixels an image is scaled down to."""
    rescale_factor: float = 1 / 255
    resample: int = 3
    """PIL resampling filter (3: bicubic)."""

    def __post_init__(self):
        for f in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"image processor field {f!r} must be a positive integer, got {v!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"image processor: min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")
        for f in ("image_mean", "image_std"):
            v = getattr(self, f)
            if not isinstance(v, (list, tuple)) or len(v) != 3 or not all(isinstance(x, (int, float)) for x in v):
                raise ValueError(f"image processor field {f!r} must be three numbers, got {v!r}")
            object.__setattr__(self, f, tuple(float(x) for x in v))
        if self.resample not in _RESAMPLE:
            raise ValueError(f"image processor field 'resample' must be one of {sorted(_RESAMPLE)}, got {self.resample!r}")

    @classmethod
    def from_folder(cls, folder: str | Path) -> ImageProcessor:
        """From `folder`/preprocessor_config.json (a ValueError naming the file and field)."""
        path = Path(folder) / "preprocessor_config.json"
        if not path.exists():
            raise ValueError(f"{path}: no such file (a vision-language checkpoint needs its image processor config)")
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, str(path))

    @classmethod
    def from_dict(cls, d: dict, where: str = "preprocessor_config.json") -> ImageProcessor:
        size = d.get("size") or {}
        kw = {k: d[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
                                "rescale_factor", "resample") if k in d}
        # min/max_pixels (older files) win over size.shortest_edge / longest_edge, as in transformers
        for ours, theirs in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if ours in d or theirs in size:
                kw[ours] = d.get(ours, size.get(theirs))
        for k in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if d.get(k, True) is not True:
                raise ValueError(f"{where}: field {k!r} is {d[k]!r}; rlfuse's image processor always does it")
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def to_dict(self) -> dict:
        """A preprocessor_config.json dict transformers' Qwen2VLImageProcessor reads."""
        return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": self.patch_size,
                "temporal_patch_size": self.temporal_patch_size, "merge_size": self.merge_size,
                "image_mean": list(self.image_mean), "image_std": list(self.image_std),
                "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
                "rescale_factor": self.rescale_factor, "resample": self.resample, "do_resize": True,
                "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}

    @classmethod
    def for_model(cls, vision: VisionConfig, **over) -> ImageProcessor:
        """A processor matching a tower's patch shapes (tiny test models carry no file)."""
        return cls(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                   merge_size=vision.spatial_merge_size, **over)

    def check_model(self, vision: VisionConfig, where: str = "preprocessor_config.json") -> None:
        """ValueError when this processor's patches do not fit the model's tower."""
        for ours, theirs in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                             ("merge_size", "spatial_merge_size")):
            if getattr(self, ours) != getattr(vision, theirs):
                raise ValueError(f"{where}: field {ours!r} is {getattr(self, ours)} but the model's vision_config."
                                 f"{theirs} is {getattr(vision, theirs)}")

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the image is resized to."""
        h, w = smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)
        return w, h

    def num_image_tokens(self, width: int, height: int) -> int:
        """Placeholder tokens of a width x height image (without resizing it)."""
        w, h = self.resized_size(width, height)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size ** 2

    def __call__(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        """A PIL image or a list of them -> (pixel_values (n_patches, C*Tp*P*P) fp32,
        image_grid_thw (n, 3) int64), images in order."""
        images = [images] if isinstance(images, Image.Image) else list(images)
        rows, grids = [], []
        for im in images:
            if not isinstance(im, Image.Image):
                raise ValueError(f"image processor: expected PIL images, got {type(im).__name__}")
            x, grid = self._one(im)
            rows.append(x)
            grids.append(grid)
        if not rows:
            return torch.zeros(0, 3 * self.temporal_patch_size * self.patch_size ** 2), torch.zeros(0, 3,
                                                                                                    dtype=torch.int64)
        return torch.cat(rows), torch.tensor(grids, dtype=torch.int64)

    def _one(self, im: Image.Image) -> tuple[torch.Tensor, list[int]]:
        if "A" in im.getbands() or im.info.get("transparency") is not None:
            # transparency composited onto white (transformers' convert_to_rgb), not dropped
            im = Image.alpha_composite(Image.new("RGBA", im.size, (255, 255, 255, 255)), im.convert("RGBA"))
        im = im.convert("RGB")
        w, h = self.resized_size(*im.size)
        im = im.resize((w, h), resample=_RESAMPLE[self.resample])
        x = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1).float()  # (C, H, W)
        mean = torch.tensor(self.image_mean)[:, None, None]
        std = torch.tensor(self.image_std)[:, None, None]
        x = (x * self.rescale_factor - mean) / std
        P, m, Tp = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // P, w // P
        x = x.reshape(3, gh // m, m, P, gw // m, m, P).permute(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, P, P)
        x = x[:, :, :, :, :, None].expand(*x.shape[:5], Tp, P, P)  # the image repeated over the frames
        return x.reshape(gh * gw, 3 * Tp * P * P), [1, gh, gw]
