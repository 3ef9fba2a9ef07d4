"""The Qwen3-VL vision tower alone (`rlfuse.model.vision.tower`): the time the issue-40 GRPO
step adds per distinct image. Random bf16 weights at a Qwen3-VL vision shape (`--shape 2b`:
depth 24, width 1024, 16 heads, MLP 4096, DeepStack after blocks 5/11/17, out 2048; `8b`:
depth 27, width 1152, 16 heads, MLP 4304, DeepStack 8/16/24, out 4096 -- the published
vision_config values as we read them; check against your checkpoint's config.json), N images
of S x S pixels (default 8 of 448 x 448: 784 patches, 196 image tokens each):

  * encode, frozen tower (no grad): all N images in one call, and one call per image (what
    an engine caching per distinct image does), fast and exact numerics;
  * forward + backward of a trainable tower (vision.trainable), fast and exact.
Medians of CUDA-event timings after warm-up.

    python benchmarks/bench_vision_tower.py [--shape 2b] [--images 8] [--size 448]
    python benchmarks/bench_vision_tower.py --small     # tiny fp32 tower on CPU: a smoke test

Prints a table; with $OUT set, writes $OUT/bench_vision_tower.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlfuse.kernels import use_backend, use_numerics  # noqa: E402
from rlfuse.model.vision import VisionConfig, VisionTower, init_vision_weights  # noqa: E402

SHAPES = {
    "2b": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
               deepstack_visual_indexes=(5, 11, 17)),
    "8b": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
               deepstack_visual_indexes=(8, 16, 24)),
    "small": dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  deepstack_visual_indexes=(0, 1), patch_size=4, num_position_embeddings=16),
}


def _time(fn, device, reps: int) -> float:
    """Median milliseconds of fn() over reps calls (after one warm-up call)."""
    fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["2b", "8b"], default="2b")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--size", type=int, default=448, help="image side in pixels (a multiple of patch * merge)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    shape = "small" if args.small else args.shape
    cfg = VisionConfig(**SHAPES[shape])
    dtype = torch.float32 if args.small else torch.bfloat16
    size = 16 if args.small else args.size
    tower = VisionTower(cfg)
    init_vision_weights(tower, 0.02, torch.Generator().manual_seed(0))
    tower = tower.to(device, dtype)
    side = size // cfg.patch_size
    grids = torch.tensor([[1, side, side]] * args.images)
    pix = torch.randn(args.images * side * side, cfg.patch_dim, device=device, dtype=dtype)
    per = pix.split(side * side)
    rows = []
    for numerics in ("fast", "exact"):
        with use_backend("auto"), use_numerics(numerics):
            tower.requires_grad_(False)
            with torch.no_grad():
                batched = _time(lambda: tower(pix, grids), device, args.reps)
                one_by_one = _time(lambda: [tower(p, grids[:1]) for p in per], device, args.reps)
            tower.requires_grad_(True)

            def fwd_bwd():
                f = tower(pix, grids)
                (f.embeds.float().square().mean() + f.deepstack.float().square().mean()).backward()
            train = _time(fwd_bwd, device, args.reps)
            tower.zero_grad(set_to_none=True)
        rows.append({"numerics": numerics, "encode_batched_ms": batched, "encode_per_image_ms": one_by_one,
                     "fwd_bwd_ms": train})
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    commit = os.environ.get("RLFUSE_COMMIT", "?")
    print(f"\n{dev}, torch {torch.__version__}, commit {commit}; Qwen3-VL {shape} vision tower, {dtype}, "
          f"{args.images} images of {size} x {size} ({side * side} patches, {side * side // 4} tokens each)")
    print("| numerics | encode, one call (ms) | encode, per image (ms) | fwd+bwd, trainable (ms) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['numerics']} | {r['encode_batched_ms']:.2f} | {r['encode_per_image_ms']:.2f} | "
              f"{r['fwd_bwd_ms']:.2f} |")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_vision_tower.json").write_text(json.dumps({"device": dev, "shape": shape, "images": args.images,
                                                                 "size": size, "commit": commit, "rows": rows},
                                                                indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
