"""`rlfuse check`: do rollout log-probs equal training log-probs?

    rlfuse check --tiny --numerics exact          # a small random model, ~1 min on a CPU
    rlfuse check MODEL_DIR --prompts prompts.txt --numerics fast --out runs/check
    rlfuse check MODEL_DIR --adapter PEFT_DIR        # the same with a LoRA adapter applied
    rlfuse check --tiny --lora-rank 8                # a random rank-8 adapter on the tiny model
    rlfuse check --tiny --moe                        # a tiny Qwen3-MoE (8 experts, top-2): exact routing
    rlfuse check --tiny --hybrid                     # a small random Qwen3.5 (Gated DeltaNet + attention)
    rlfuse check --tiny --hybrid --moe               # a small random Qwen3.5-MoE (the hybrid, MoE + shared expert)
    rlfuse check --tiny --next                       # a small random Qwen3-Next (fused in_proj, MoE and dense layers)
    rlfuse check --shape 3.5-2b                      # random weights at a published shape (GPU)
    rlfuse check --tiny --vision                     # a tiny Qwen3-VL on image-text prompts (the whole sweep)
    rlfuse check --tiny --vision --hybrid            # a tiny Qwen3.5-VL (hybrid text tower) on the same prompts
Generates with the engine over a sweep of settings (batch sizes, n > 1 sharing a
prompt, prefix cache off, chunked prefill, forced preemption, eager vs static/graph
decode, look-ahead, micro-batch packing, all combined; then multi-turn episodes against a
scripted tool, with observations appended as ids, chunked, with preemption and prefix-cache
hits between turns; with --tiny, image-text prompts on a tiny Qwen3-VL, or with --vision
--hybrid on a tiny Qwen3.5-VL), teacher-forces the same tokens
through the trainer's forward and prints one row per setting: tokens, % bitwise equal,
max and mean |delta|, k3 KL. Writes OUT/check.json. Where a setting differs, the first
differing token is replayed along both forwards with hooks on every layer: the first
divergent layer and op are named and OUT/layer_drift.png plots |delta| per layer for
exact and fast numerics. Exit status 1 when --numerics exact finds any difference.
"""

from __future__ import annotations

import json
import logging
import string
import sys
import time
from pathlib import Path

import torch
from PIL import Image

from rlfuse.cli.common import add_threads_argument, fail, setup_threads
from rlfuse.consistency.check import Setting, default_sweep, run_setting
from rlfuse.consistency.drift import layer_drift, plot_layer_drift
from rlfuse.data import ImageProcessor, VisionData, expand_images
from rlfuse.engine.benchmark import SHAPES, random_model
from rlfuse.kernels.backend import BACKENDS, NUMERICS, use_backend
from rlfuse.model import CausalLM, ModelConfig, load_model
from rlfuse.model.arch.qwen3_5 import tiny_hybrid_fields
from rlfuse.model.arch.qwen3_5_moe import tiny_hybrid_moe_fields
from rlfuse.model.arch.qwen3_5_vl import tiny_hybrid_vl_fields
from rlfuse.model.arch.qwen3_next import tiny_next_fields
from rlfuse.model.arch.qwen3_vl import tiny_vl_fields
from rlfuse.model.lora import LoRAConfig, attach_lora, init_lora_, lora_modules
from rlfuse.model.lora_peft import load_peft_adapter
from rlfuse.model.tokenizer import Tokenizer
from rlfuse.rollout import TemplateError, char_chat_tokenizer, multi_turn_setting
from rlfuse.run import make_folder

log = logging.getLogger("rlfuse.cli")
HELP = "prove rollout log-probs equal training log-probs (exact numerics) or measure the drift (fast)"

_TINY = dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=False,
             max_position_embeddings=1024)
# --tiny --moe: the same shape as a Qwen3-MoE, both layers sparse
_TINY_MOE = dict(_TINY, model_type="qwen3_moe",
                 moe=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True))


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", help="HF checkpoint folder (or use --tiny)")
    p.add_argument("--tiny", action="store_true", help="a small random Qwen3-style model built in memory")
    p.add_argument("--moe", action="store_true", help="with --tiny: a small random Qwen3-MoE model (8 experts, "
                   "top-2) instead of the dense one")
    p.add_argument("--hybrid", action="store_true", help="with --tiny: a small random Qwen3.5-style hybrid "
                   "(three Gated DeltaNet layers, one gated full attention) instead of the Qwen3-style model; with "
                   "--moe too: a Qwen3.5-MoE of those layers (8 experts, top-2, and a gated shared expert)")
    p.add_argument("--next", action="store_true", help="with --tiny: a small random Qwen3-Next (the hybrid's layers "
                   "with fused in_proj_qkvz / in_proj_ba; MoE blocks with a shared expert on layers 0, 2, 3, a "
                   "dense MLP on layer 1)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="a model of this published shape with random weights (rlfuse.engine.benchmark.SHAPES: "
                        "Qwen3 0.6b..8b, the Qwen3.5 hybrids 3.5-0.8b / 3.5-2b), instead of MODEL_DIR or --tiny")
    p.add_argument("--vision", action="store_true", help="with --tiny: a tiny random Qwen3-VL on image-text prompts "
                   "(random images of several sizes, some shared between prompts, two in some, text-only rows too); "
                   "with --hybrid too: a tiny Qwen3.5-VL (one Gated DeltaNet layer, one gated attention, a vision "
                   "tower without DeepStack)")
    p.add_argument("--prompts", help="text file, one prompt per line (default: random token prompts)")
    p.add_argument("--numerics", choices=NUMERICS, default="exact")
    p.add_argument("--out", default="runs/check", help="folder for check.json and layer_drift.png")
    p.add_argument("--max-batch", type=int, default=None,
                   help="largest sweep batch (default: 256 on CUDA, 8 on CPU)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per completion "
                   "(default: 128 on CUDA, 24 on CPU)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="model dtype (default: bf16 on CUDA, fp32 on CPU for --tiny; "
                   "the checkpoint's otherwise)")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="kernel backend")
    p.add_argument("--adapter", default=None, help="a PEFT LoRA adapter folder applied to the model (unmerged)")
    add_threads_argument(p)
    p.add_argument("--lora-rank", type=int, default=0, help="attach a random LoRA adapter of this rank on every "
                   "linear layer (B drawn nonzero, so the adapter changes the output)")


def _model(args, device):
    if args.shape:
        dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
        m, tok = random_model(SHAPES[args.shape], torch.device(device), dtype, seed=args.seed), None
    elif args.tiny:
        dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
        fields = (tiny_next_fields() if args.next else tiny_hybrid_moe_fields() if args.hybrid and args.moe
                  else _TINY_MOE if args.moe else tiny_hybrid_vl_fields() if args.hybrid and args.vision
                  else tiny_hybrid_fields() if args.hybrid
                  else tiny_vl_fields() if args.vision else _TINY)
        m = CausalLM(ModelConfig(**fields))
        m.init_weights(std=0.1, generator=torch.Generator().manual_seed(args.seed))
        m, tok = m.to(device=device, dtype=getattr(torch, dtype)), None
    else:
        m, tok = load_model(args.model, device=device, dtype=args.dtype), Tokenizer.from_pretrained(args.model)
    if args.adapter and args.lora_rank:
        raise ValueError("check: give --adapter or --lora-rank, not both")
    if args.adapter:
        load_peft_adapter(m, args.adapter)
    elif args.lora_rank:
        attach_lora(m, LoRAConfig(rank=args.lora_rank))
        init_lora_(m, seed=args.seed, b_std=0.1)
    return m, tok


def _prompts(args, tok, vocab: int, n: int) -> list[list[int]]:
    if args.prompts:
        path = Path(args.prompts)
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        if not lines:
            raise ValueError(f"{path}: no prompts (expected one prompt per line)")
        if tok is None:
            raise ValueError("--prompts needs a tokenizer: give MODEL_DIR (the --tiny model has none)")
        ids = [tok.encode(ln) for ln in lines]
        return [ids[i % len(ids)] for i in range(n)]
    g = torch.Generator().manual_seed(args.seed + 1)
    lens = torch.randint(3, 64, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


def _vision_prompts(args, model, n: int) -> tuple[list[list[int]], list[tuple]]:
    """n random image-text prompts: (text, image) 0, 1 or 2 times (random pixels, 3 sizes;
    some images in two prompts), then text; token ids below the vision ids."""
    v = model.config.vision
    proc = ImageProcessor.for_model(v, min_pixels=64, max_pixels=48 * 48)
    vision = VisionData(proc, v.vision_start_token_id, v.image_token_id, v.vision_end_token_id)
    g = torch.Generator().manual_seed(args.seed + 2)
    top = min(v.image_token_id, v.vision_start_token_id, v.vision_end_token_id, v.video_token_id)
    sizes = [(16, 16), (24, 16), (16, 32)]
    pool = [Image.frombytes("RGB", sizes[i % 3], bytes(torch.randint(0, 256, (sizes[i % 3][0] * sizes[i % 3][1] * 3,),
                                                                     generator=g).tolist())) for i in range(n)]
    prompts, media = [], []
    for i in range(n):
        k = (i % 3 == 0) + (i % 3 != 2)  # 2 images, 1, none, in turn
        ids, images = [], []
        for j in range(k):
            ids += torch.randint(0, top, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            ids += [v.vision_start_token_id, v.image_token_id, v.vision_end_token_id]
            # prompt 3m+1's first image is prompt 3m's: the same image in two prompts
            images.append(("image", pool[i - 1 if i % 3 == 1 and j == 0 else (i + 3 * j) % n]))
        ids += torch.randint(0, top, (int(torch.randint(3, 24, (1,), generator=g)),), generator=g).tolist()
        ids, items, _ = expand_images(ids, images, vision, f"prompt {i}", 1 << 20)
        prompts.append(ids)
        media.append(items)
    return prompts, media


IMAGE_ROW = "image-text prompts, tiny Qwen3-VL"


def _image_row(args, device, dtype):
    """The default --tiny check's image row (a few seconds): a tiny Qwen3-VL, 4 image-text
    prompts x 2 samples, chunked prefill splitting images, prefix caching, micro-batches
    (rlfuse check --tiny --vision runs the whole sweep on it)."""
    vl = CausalLM(ModelConfig(**tiny_vl_fields()))
    vl.init_weights(std=0.1, generator=torch.Generator().manual_seed(args.seed))
    vl = vl.to(device=device, dtype=dtype)
    prompts, media = _vision_prompts(args, vl, 4)
    s = Setting(name=IMAGE_ROW, num_prompts=4, n=2, micro_batch_tokens=96, engine=dict(max_num_batched_tokens=16))
    r = run_setting(vl, prompts, s, numerics=args.numerics, max_tokens=args.max_tokens or 24,
                    temperature=args.temperature, seed=args.seed, media=media)
    print(f"{r.name:34s} {r.tokens:7d} {100 * r.bitwise_frac:7.2f}% {r.max_abs:10.3g} {r.mean_abs:10.3g} "
          f"{r.kl_k3:10.3g}  {r.engine_stats['vision_encodes']} tower runs for 8 samples", flush=True)
    return r


def _agent_rows(args, model, tok, results) -> None:
    """The multi-turn and agent rows (text models)."""
    # multi-turn: the --tiny model gets the compact character chat tokenizer (its ids
    # fit the model's vocabulary); a model folder uses its own chat template
    try:
        mt_tok = tok if tok is not None else char_chat_tokenizer(string.printable)
        r = multi_turn_setting(model, mt_tok, numerics=args.numerics, temperature=args.temperature, seed=args.seed)
        results.append(r)
        st = r.engine_stats
        print(f"{r.name:34s} {r.tokens:7d} {100 * r.bitwise_frac:7.2f}% {r.max_abs:10.3g} {r.mean_abs:10.3g} "
              f"{r.kl_k3:10.3g}  {st['preemptions']} / {st['prompt_tokens_cached']} / "
              f"{st['look_ahead_steps']}; {st['turns_mean']:.1f} turns per episode", flush=True)
    except TemplateError as e:
        print(f"{'multi-turn, scripted tool':34s} skipped: {e}", flush=True)
    try:
        # optional dependencies (the `serve` extra and openai): the row is skipped without them
        from rlfuse.serve.agent_check import agent_setting
    except ImportError as e:
        print(f"{'agent via OpenAI API':34s} skipped: {e} (pip install 'rlfuse[serve]' openai)", flush=True)
    else:
        try:
            r = agent_setting(model, mt_tok, numerics=args.numerics, temperature=args.temperature, seed=args.seed)
            results.append(r)
            st = r.engine_stats
            print(f"{r.name:34s} {r.tokens:7d} {100 * r.bitwise_frac:7.2f}% {r.max_abs:10.3g} {r.mean_abs:10.3g} "
                  f"{r.kl_k3:10.3g}  {st['rollout/agent_calls_per_episode']:.1f} calls per episode, "
                  f"{100 * st['rollout/agent_merged_frac']:.0f}% merged, "
                  f"{st['rollout/agent_split_samples']:.0f} split samples", flush=True)
        except TemplateError as e:
            print(f"{'agent via OpenAI API':34s} skipped: {e}", flush=True)


def run(args) -> int:
    try:
        setup_threads(args.threads)
    except ValueError as e:
        return fail(e)
    if args.moe and not args.tiny:
        return fail(ValueError("check: --moe picks the --tiny model's kind; a checkpoint's config.json says its own"))
    given = [x for x, on in (("MODEL_DIR", args.model), ("--tiny", args.tiny), ("--shape", args.shape)) if on]
    if len(given) != 1:
        return fail(ValueError("check: give one of MODEL_DIR (an HF model folder), --tiny (a small random model) or "
                               f"--shape (random weights at a published shape); got {' and '.join(given) or 'none'}"))
    if args.hybrid and not args.tiny:
        return fail(ValueError("check: --hybrid picks the tiny hybrid model; give it with --tiny (a model folder's "
                               "config.json says whether it is a hybrid)"))
    if args.next and (not args.tiny or args.hybrid or args.moe or args.vision):
        return fail(ValueError("check: --next picks the tiny Qwen3-Next; give it with --tiny and without --hybrid / "
                               "--moe / --vision (a model folder's config.json says its own kind)"))
    if args.vision and args.moe:
        return fail(ValueError("check: --vision picks the tiny Qwen3-VL (with --hybrid: Qwen3.5-VL); give it without "
                               "--moe"))
    if args.vision and (not args.tiny or args.prompts):
        return fail(ValueError("check: --vision builds image-text prompts for the --tiny Qwen3-VL; give it with --tiny "
                               "and without --prompts"))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    max_batch = args.max_batch or (256 if cuda else 8)
    max_tokens = args.max_tokens or (128 if cuda else 24)
    try:
        out = make_folder(args.out, "--out")
        model, tok = _model(args, device)
        media = None
        if args.vision:
            prompts, media = _vision_prompts(args, model, max_batch)
        else:
            prompts = _prompts(args, tok, model.config.vocab_size, max_batch)
    except (ValueError, OSError) as e:
        return fail(e)
    block = 16
    need = max(len(p) for p in prompts) + max_tokens
    # a pool that holds two (GPU: four) of the longest sequences at full length: preemption is
    # forced, and at 256 sequences the GPU run is not spent recomputing them
    small_pool = (4 if cuda else 2) * -(-need // block)
    settings = default_sweep(max_batch, small_pool_blocks=small_pool, chunk_tokens=max(block, need // 3))
    if media is not None:  # long prompts are repeats of short ones: their images would move
        settings = [s for s in settings if not s.min_prompt_len]
    lora = f", LoRA on {len(lora_modules(model))} projections" if lora_modules(model) else ""
    print(f"rlfuse check: {model.config.architecture}{lora} on {device} ({model.lm_head_weight.dtype}), numerics "
          f"{args.numerics}, {len(settings)} settings, up to {max_batch} sequences x {max_tokens} tokens")
    print(f"{'setting':34s} {'tokens':>7s} {'bitwise':>8s} {'max|d|':>10s} {'mean|d|':>10s} {'kl_k3':>10s}  "
          "engine: preemptions / cached prompt tokens / look-ahead steps / shared-prefix decode steps")
    results, t0 = [], time.perf_counter()
    with use_backend(args.backend):
        for s in settings:
            t1 = time.perf_counter()
            r = run_setting(model, prompts, s, numerics=args.numerics, max_tokens=max_tokens,
                            temperature=args.temperature, seed=args.seed, media=media)
            results.append(r)
            st = r.engine_stats
            print(f"{r.name:34s} {r.tokens:7d} {100 * r.bitwise_frac:7.2f}% {r.max_abs:10.3g} {r.mean_abs:10.3g} "
                  f"{r.kl_k3:10.3g}  {st['preemptions']} / {st['prompt_tokens_cached']} / {st['look_ahead_steps']} / "
                  f"{st['shared_prefix_steps']}  ({time.perf_counter() - t1:.1f} s: " +
                  ", ".join(f"{k} {v:.1f}" for k, v in r.seconds.items()) + ")",
                  flush=True)
        if args.vision:
            print(f"{'multi-turn and agent rows':34s} skipped with --vision (text rows: rlfuse check --tiny)")
        else:
            if args.tiny and not (args.moe or args.hybrid or args.lora_rank):
                results.append(_image_row(args, device, model.lm_head_weight.dtype))
            _agent_rows(args, model, tok, results)
        report = {"numerics": args.numerics, "device": device, "dtype": str(model.lm_head_weight.dtype),
                  "model": args.model or args.shape or "tiny", "adapter": args.adapter or (f"random rank {args.lora_rank}"
                                                                             if args.lora_rank else None),
                  "settings": [r.row() for r in results]}
        # the replay runs the text model without images: rows of image prompts are not replayed
        differing = None if args.vision else next((r for r in results if r.first_diff is not None
                                                   and r.name != IMAGE_ROW), None)
        if differing is not None:
            i, pos = differing.first_diff
            prompt, completion = differing.sequences[i]
            lp_t = args.temperature if args.temperature > 0 else 1.0
            probes = [layer_drift(model, prompt, completion, pos, numerics=n, temperature=lp_t) for n in NUMERICS]
            plot_layer_drift(probes, out / "layer_drift.png")
            mine = next(p for p in probes if p.numerics == args.numerics)
            first = mine.first_divergence
            report["first_divergence"] = {"setting": differing.name, "completion": i, "position": pos,
                                          "layer": first[0] if first else None, "op": first[1] if first else None,
                                          "layer_max_abs": {p.numerics: p.layer_max_abs for p in probes}}
            where = (f"layer {first[0]}, {first[1]}" if first else
                     "nowhere in a single-sequence replay (the difference needs the rollout's batch)")
            print(f"first difference: setting '{differing.name}', completion {i}, token {pos}; "
                  f"replayed: hidden states diverge first at {where}; plot: {out / 'layer_drift.png'}")
    (out / "check.json").write_text(json.dumps(report, indent=2))
    total = sum(r.tokens for r in results)
    equal = sum(round(r.bitwise_frac * r.tokens) for r in results)
    print(f"{equal}/{total} tokens bitwise equal over all settings ({time.perf_counter() - t0:.0f} s); "
          f"wrote {out / 'check.json'}")
    if args.numerics == "exact" and equal != total:
        print("rlfuse check: exact numerics found differences", file=sys.stderr)
        return 1
    return 0
