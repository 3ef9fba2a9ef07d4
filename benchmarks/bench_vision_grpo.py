"""GRPO step with images (issue 40's targets) on a Qwen3-VL- or Qwen3.5-shaped random model (GPU).

Workload: 8 prompts x 8 completions, each prompt 64 random text ids + one 448 x 448 image
(784 patches, 196 image tokens) + 32 text ids, up to 1024 new tokens (a random model almost
never emits EOS), temperature 1, dapo loss, gradient checkpointing, micro-batches of 16384
tokens, vision tower frozen. Reward: share of even token ids. Shape `2b`: the text tower of
Qwen3-VL-2B (hidden 2048, 28 layers, 16 q / 8 kv heads of 128, MLP 6144, mRoPE section
(24, 20, 20), tied) and bench_vision_tower.py's 2b tower; random bf16 weights on the GPU.
Shape `3.5-2b` (`--shape 3.5-2b`): the Qwen3.5-2B text tower (rlfuse.engine.benchmark's
3.5-2b: 24 hybrid layers, Gated DeltaNet x 3 + gated attention, head_dim 256 a quarter rotated,
mRoPE section (11, 11, 10)) with the same 24-block tower and no DeepStack (the tower's width is
Qwen3-VL-2B's, assumed, not read from a released Qwen3.5 config).
Baseline: the same step with the image block replaced by as many random text ids (same
sequence lengths, no tower). Each case runs `--steps` steps; the first (CUDA graphs,
Triton compiles) is left out of the medians.

Reported per case (median over the timed steps): step, generate, train seconds, the tower's
runs per step (vision/encodes: 8, not 64), mismatch/max_abs; and the encode time of the 8
images alone (no grad). Targets: image step <= 1.2 x (text step + tower encode); exact
numerics costs <= 15% of the fast step.

    OUT=out python benchmarks/bench_vision_grpo.py                 # fast and exact, images and text
    OUT=out python benchmarks/bench_vision_grpo.py --numerics exact
    OUT=out python benchmarks/bench_vision_grpo.py --shape 3.5-2b  # the Qwen3.5 hybrid VLM
    python benchmarks/bench_vision_grpo.py --small [--shape 3.5-2b] # CPU smoke test (tiny VLM)
Writes $OUT/bench_vision_grpo.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlfuse.engine.benchmark import QWEN3_5_SHAPES, random_model  # noqa: E402
from rlfuse.kernels.backend import new_compiles, triton_compiles  # noqa: E402
from rlfuse.model.arch.qwen3_5_vl import tiny_hybrid_vl_fields  # noqa: E402
from rlfuse.model.arch.qwen3_vl import tiny_vl_fields  # noqa: E402
from rlfuse.model.vision import VisionConfig  # noqa: E402

REWARD = "def even(prompts, completions, completion_ids, **kw):\n" \
         "    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]\n"
VISION_2B = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                 deepstack_visual_indexes=(5, 11, 17), patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                 num_position_embeddings=2304)
SHAPES = {
    "2b": dict(model_type="qwen3_vl", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
               num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, qk_norm=True,
               tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=5000000.0,
               mrope_section=(24, 20, 20), vision=VisionConfig(**VISION_2B)),
    "3.5-2b": dict(QWEN3_5_SHAPES["3.5-2b"], model_type="qwen3_5", max_position_embeddings=8192,
                   mrope_section=(11, 11, 10), vision=VisionConfig(**{**VISION_2B, "deepstack_visual_indexes": ()})),
}
TINY = {"2b": tiny_vl_fields, "3.5-2b": tiny_hybrid_vl_fields}


def _case(out: Path, *, small: bool, numerics: str, images: bool, steps: int, shape: str = "2b") -> dict:
    from PIL import Image

    from rlfuse.data import VisionData, expand_images
    from rlfuse.data.prompts import Prompt, PromptStream
    from rlfuse.engine import EngineConfig
    from rlfuse.model import ModelConfig
    from rlfuse.model.vision.processor import ImageProcessor
    from rlfuse.rollout.rewards import RewardSet
    from rlfuse.rollout.sampler import EngineSampler
    from rlfuse.run import build_engine, char_tokenizer
    from rlfuse.run.config.run_config import load_config
    from rlfuse.train.grpo import GRPOStep
    from rlfuse.train.sft import make_optimizer

    dev = torch.device("cuda" if torch.cuda.is_available() and not small else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sh = TINY[shape]() if small else SHAPES[shape]
    P, G, new, side = (8, 8, 1024, 448) if not small else (2, 4, 8, 16)
    v = ModelConfig(**sh).vision
    proc = ImageProcessor.for_model(v, min_pixels=side * side, max_pixels=side * side)
    n_img = proc.num_image_tokens(side, side)
    plen = 64 + 1 + n_img + 1 + 32
    (out / "reward_even.py").write_text(REWARD)
    block = EngineConfig().block_size
    cfg = load_config({
        "model": {"random_init": {}, "dtype": str(dtype).removeprefix("torch."), "gradient_checkpointing": not small},
        "engine": {"numerics": numerics, "max_num_seqs": P * G, "max_model_len": plen + new,
                   "num_kv_blocks": P * G * math.ceil((plen + new) / block)},
        "rewards": [{"name": f"{out}/reward_even.py:even"}],
        "optim": {"lr": 1e-6, "schedule": "constant"},
        "grpo": {"steps": steps, "prompts_per_step": P, "group_size": G, "max_new_tokens": new, "temperature": 1.0,
                 "loss_type": "dapo", "micro_batch_tokens": 16384 if not small else 512, "check_every": 1},
        "logging": {"run_dir": str(out / "grpo"), "tensorboard": False, "progress": False},
    })
    model = random_model(sh, dev, dtype, seed=0)
    model.gradient_checkpointing = not small
    llm = build_engine(model, char_tokenizer("abc"), cfg.engine)
    vision = VisionData(proc, v.vision_start_token_id, v.image_token_id, v.vision_end_token_id)
    g = torch.Generator().manual_seed(0)
    top = min(v.vision_start_token_id, v.image_token_id, v.vision_end_token_id, v.video_token_id)
    prompts = []
    for i in range(P * steps):
        head, tail = (torch.randint(0, top, (k,), generator=g).tolist() for k in (64, 32))
        if images:
            img = Image.frombytes("RGB", (side, side), torch.randint(0, 256, (side * side * 3,), generator=g,
                                                                       dtype=torch.uint8).numpy().tobytes())
            ids, media, _ = expand_images(head + [v.vision_start_token_id, v.image_token_id, v.vision_end_token_id]
                                          + tail, [("image", img)], vision, f"p{i}", plen)
        else:
            ids, media = head + torch.randint(0, top, (n_img + 2,), generator=g).tolist() + tail, ()
        prompts.append(Prompt(ids, "", {}, f"p{i}", media))
    tr = GRPOStep(cfg, model, EngineSampler(llm, char_tokenizer("abc")), RewardSet(cfg.rewards),
                  PromptStream(prompts, seed=0, shuffle=False), make_optimizer(model, cfg))
    rows = []
    for step in range(steps):
        c0, t0 = triton_compiles(), time.perf_counter()
        m = tr.step(step)
        # a step's Triton compiles: a later step that compiles again (new shapes) is not warm
        rows.append({"step": step, "wall_s": time.perf_counter() - t0, "triton_compiles": new_compiles(c0, triton_compiles()),
                     **{k: float(x) for k, x in m.items() if k.startswith(("time/", "mismatch/max_abs", "vision/",
                                                                           "completion_len/mean"))}})
        print(json.dumps(rows[-1]), flush=True)
    encode_s = None
    if images:  # the tower on the step's 8 images, no grad, after warm-up
        from rlfuse.engine import encode_images
        batch = [m for p in prompts[:P] for m in p.media]
        with torch.no_grad():
            encode_images(model, batch)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            encode_images(model, batch)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            encode_s = time.perf_counter() - t0
    llm.sleep()
    timed = rows[1:] or rows

    def med(k):
        vals = [r[k] for r in timed if k in r]
        return statistics.median(vals) if vals else None
    return {"numerics": numerics, "images": images, "prompt_tokens": plen, "image_tokens": n_img if images else 0,
            "step_s": med("time/step"), "generate_s": med("time/generate"), "train_s": med("time/train"),
            "encodes_per_step": med("vision/encodes"), "mismatch_max_abs": med("mismatch/max_abs"),
            "completion_len": med("completion_len/mean"), "tower_encode_s": encode_s, "steps": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny VLM on the CPU (smoke test)")
    ap.add_argument("--numerics", choices=("fast", "exact", "both"), default="both")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="2b",
                    help="2b: Qwen3-VL-2B; 3.5-2b: Qwen3.5-2B's hybrid text tower with a vision tower (no DeepStack)")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "runs/bench_vision_grpo"))
    out.mkdir(parents=True, exist_ok=True)
    cases = []
    for numerics in (("fast", "exact") if args.numerics == "both" else (args.numerics,)):
        for images in (True, False):
            cases.append(_case(out, small=args.small, numerics=numerics, images=images, steps=args.steps,
                               shape=args.shape))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.small else "cpu"
    what = {"2b": "Qwen3-VL-2B shape", "3.5-2b": "Qwen3.5-2B hybrid shape + a 24-block tower"}[args.shape]
    lines = [f"GRPO step with images, {gpu}, {'tiny VLM' if args.small else what}, 8 x 8, <= 1024 new tokens "
             f"(`python benchmarks/bench_vision_grpo.py --shape {args.shape}`)", "",
             "| numerics | prompts | step s | generate s | train s | tower runs / step | tower encode s | "
             "mismatch max | Triton compiles in the timed steps |", "|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        late = sum(n for r in c["steps"][1:] for n in r["triton_compiles"].values())
        lines.append(f"| {c['numerics']} | {'image' if c['images'] else 'text'} | {c['step_s']:.2f} | "
                     f"{c['generate_s']:.2f} | {c['train_s']:.2f} | {c['encodes_per_step'] or '-'} | "
                     f"{c['tower_encode_s'] or 0:.3f} | {c['mismatch_max_abs']:.3g} | {late} |")
    by = {(c["numerics"], c["images"]): c for c in cases}
    for n in ("fast", "exact"):
        if (n, True) in by and (n, False) in by:
            img, txt = by[(n, True)], by[(n, False)]
            ratio = img["step_s"] / (txt["step_s"] + img["tower_encode_s"])
            lines.append(f"\n{n}: image step / (text step + tower encode) = {ratio:.2f} (target <= 1.2)")
    if ("fast", True) in by and ("exact", True) in by:
        lines.append(f"exact / fast, image step: {by[('exact', True)]['step_s'] / by[('fast', True)]['step_s']:.2f} "
                     f"(target <= 1.15)")
    print("\n".join(lines))
    (out / "bench_vision_grpo.json").write_text(json.dumps({"gpu": gpu, "cases": cases}, indent=1))
    (out / "bench_vision_grpo.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
