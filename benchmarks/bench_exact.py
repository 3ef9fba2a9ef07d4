"""Exact vs fast numerics on one GPU, side by side in one run (CUDA only).

Qwen3-0.6B-shaped random model (28 layers, D 1024, V 151936, tied), bf16:
  1. check: the `rlfuse check` sweep in both numerics (rows: tokens, bitwise fraction,
     max |delta|), prompts 16..256 tokens, up to --max-batch sequences x --tokens new tokens;
  2. generate: rollout tokens/s, GRPO-shaped (P prompts x n=8, 128-token prompts,
     --gen-tokens new tokens, EOS ignored), CUDA graphs, best of 2 after a warm-up;
  3. train: the trainer's packed forward + token_logprobs + backward, 16k tokens;
  4. linear: the exact (batch-invariant) linear vs F.linear (cuBLAS) at decode and
     training row counts, for the model's projection shapes and the fused q/k/v and
     gate/up ones (CUDA events, median); at decode row counts also each launch plan
     (fused, split, split_last) timed from CUDA-graph replays.
Writes $OUT/bench_exact.json (or ./bench_exact.json) and prints a table.
Run: python benchmarks/bench_exact.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from rlfuse.consistency.check import default_sweep, run_setting
from rlfuse.engine import LLM, EngineConfig, SamplingParams
from rlfuse.engine.benchmark import QWEN3_06B
from rlfuse.kernels.backend import use_numerics
from rlfuse.kernels.linear.triton_gemm import linear_exact_triton
from rlfuse.kernels.loss.logprob import token_logprobs
from rlfuse.model import CausalLM, ModelConfig, Packed

SHAPE = QWEN3_06B | dict(max_position_embeddings=4096)


def _model():
    m = CausalLM(ModelConfig(**SHAPE))
    m.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
    return m.to(device="cuda", dtype=torch.bfloat16)


def _events(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def bench_check(model, max_batch, tokens):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 151936, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 257, (max_batch,), generator=g)]
    need = 256 + tokens
    out = {}
    for numerics in ("exact", "fast"):
        rows = []
        for s in default_sweep(max_batch, small_pool_blocks=2 * -(-need // 16), chunk_tokens=512):
            t0 = time.perf_counter()
            r = run_setting(model, prompts, s, numerics=numerics, max_tokens=tokens, temperature=1.0)
            rows.append({**r.row(), "seconds": round(time.perf_counter() - t0, 2)})
            print(f"check {numerics:5s} {r.name:34s} {r.tokens:6d} {100 * r.bitwise_frac:7.3f}% "
                  f"max {r.max_abs:.3g} mean {r.mean_abs:.3g}", flush=True)
        out[numerics] = rows
    return out


def bench_generate(model, prompts_n, gen_tokens):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 151936, (128,), generator=g).tolist() for _ in range(prompts_n)]
    params = SamplingParams(n=8, temperature=1.0, max_tokens=gen_tokens, ignore_eos=True, seed=0)
    out = {}
    for numerics in ("fast", "exact"):
        llm = LLM(model, config=EngineConfig(numerics=numerics, max_num_seqs=prompts_n * 8,
                                             gpu_memory_fraction=0.6))
        llm.generate(prompts[:2], SamplingParams(n=8, max_tokens=16, ignore_eos=True))  # compile, capture
        best = 0.0
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            best = max(best, sum(len(o.output_token_ids) for o in outs) / dt)
        out[numerics] = round(best, 1)
        print(f"generate {numerics:5s} {prompts_n}x8 prompts, {gen_tokens} new tokens: {best:,.0f} tok/s", flush=True)
        llm.sleep()
        del llm
        torch.cuda.empty_cache()
    out["exact_over_fast"] = round(out["exact"] / out["fast"], 3)
    return out


def bench_train(model, tokens=16384, seq=1024):
    lens = [seq] * (tokens // seq)
    ids = torch.randint(0, 151936, (tokens,), device="cuda")
    pos = torch.cat([torch.arange(n, device="cuda") for n in lens])
    attn = Packed.from_lengths(lens, "cuda")
    model.train()
    out = {}
    for numerics in ("fast", "exact"):
        def step():
            with use_numerics(numerics):
                h = model(ids, pos, attn)
                lp = token_logprobs(h[:-1], model.lm_head_weight, ids[1:], 1.0)
                lp.sum().backward()
        ms = _events(step, reps=5, warm=2)
        model.zero_grad(set_to_none=True)
        out[numerics] = round(ms, 2)
        print(f"train fwd+bwd {numerics:5s} {tokens} tokens: {ms:.1f} ms", flush=True)
    out["exact_over_fast"] = round(out["exact"] / out["fast"], 3)
    return out


def bench_linear():
    shapes = {"qkv-ish q_proj": (2048, 1024), "k_proj": (1024, 1024), "o_proj": (1024, 2048),
              "gate/up": (3072, 1024), "down": (1024, 3072),
              "qkv fused": (4096, 1024), "gate_up fused": (6144, 1024)}  # rlfuse.model.fuse
    rows = []
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
        for M in (1, 64, 256, 16384):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.double(), w.double())
            err_e = (linear_exact_triton(x, w).double() - ref).abs().max().item()
            err_f = (F.linear(x, w).double() - ref).abs().max().item()
            te = _events(lambda: linear_exact_triton(x, w))
            tf = _events(lambda: F.linear(x, w))
            # decode: each launch plan from graph replays (as the engine runs them; no host launch cost)
            plans = {} if M > 256 else {
                plan: round(_graph_ms(lambda plan=plan: linear_exact_triton(x, w, plan=plan)), 4)
                for plan in ("fused", "split", "split_last")}
            rows.append(dict(shape=name, M=M, N=N, K=K, exact_ms=round(te, 4), cublas_ms=round(tf, 4),
                             ratio=round(te / tf, 2), err_exact=err_e, err_cublas=err_f, plans_graph_ms=plans))
            print(f"linear {name:15s} M={M:6d} exact {te * 1e3:8.1f} us  cuBLAS {tf * 1e3:8.1f} us  "
                  f"x{te / tf:5.2f}  err {err_e:.2g} vs {err_f:.2g}"
                  + "".join(f"  {p} {v * 1e3:.1f}" for p, v in plans.items()), flush=True)
    return rows


_CANDIDATES = {  # exact-linear tiles for --sweep-linear (public `tiles=` argument; the defaults are _tiles)
    "64x128x64 c512 w4 s3": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, CHUNK_K=512, num_warps=4, num_stages=3),
    "64x64x64 c512 w4 s3": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, CHUNK_K=512, num_warps=4, num_stages=3),
    "64x128x64 c256 w4 s3": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, CHUNK_K=256, num_warps=4, num_stages=3),
    "64x64x128 c512 w4 s3": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, CHUNK_K=512, num_warps=4, num_stages=3),
    "64x64x64 c256 w4 s4": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, CHUNK_K=256, num_warps=4, num_stages=4),
    "128x128x64 c512 w8 s3": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, CHUNK_K=512, num_warps=8, num_stages=3),
    "128x64x64 c512 w4 s4": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, CHUNK_K=512, num_warps=4, num_stages=4),
    "64x128x64 c1024 w4 s4": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, CHUNK_K=1024, num_warps=4, num_stages=4),
}
# one decoder layer's projections of the 0.6B shape: (N, K, count), separate and fused (rlfuse.model.fuse)
_LAYERS = {"separate": [(2048, 1024, 1), (1024, 1024, 2), (1024, 2048, 1), (3072, 1024, 2), (1024, 3072, 1)],
           "fused": [(4096, 1024, 1), (1024, 2048, 1), (6144, 1024, 1), (1024, 3072, 1)]}


def _graph_ms(fn, reps=10):
    """Median time of one fn() from CUDA-graph replays of `reps` calls (no launch overhead)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return _events(g.replay, reps=10, warm=2) / reps


def sweep_linear():
    """Per-layer projection time (ms, graph replay) for each candidate vs cuBLAS, M = 64, 256, 16384,
    for the layer's separate projections and for the fused q/k/v and gate/up ones."""
    rows = []
    for layout, layer in _LAYERS.items():
        for M in (64, 256, 16384):
            ws = {(N, K): torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for N, K, _ in layer}
            xs = {K: torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _, K, _ in layer}
            cub = sum(c * _graph_ms(lambda: F.linear(xs[K], ws[(N, K)])) for N, K, c in layer)
            rows.append(dict(layout=layout, M=M, tiles="cuBLAS", layer_ms=round(cub, 4), over_cublas=1.0))
            print(f"sweep {layout:8s} M={M:6d} {'cuBLAS':24s} {cub * 1e3:8.1f} us/layer", flush=True)
            for name, t in {"default (_tiles)": None, **_CANDIDATES}.items():
                try:
                    ms = sum(c * _graph_ms(lambda: linear_exact_triton(xs[K], ws[(N, K)], tiles=t))
                             for N, K, c in layer)
                except Exception as e:  # noqa: BLE001 -- a tile that does not compile (resources) is reported, not fatal
                    print(f"sweep M={M:6d} {name:24s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                rows.append(dict(layout=layout, M=M, tiles=name, layer_ms=round(ms, 4), over_cublas=round(ms / cub, 3)))
                print(f"sweep {layout:8s} M={M:6d} {name:24s} {ms * 1e3:8.1f} us/layer  x{ms / cub:5.2f} cuBLAS",
                      flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sweep and generate")
    ap.add_argument("--only", default="linear,check,generate,train",
                    help="comma list of: sweep (exact-linear tile candidates), linear, check, generate, train")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "bench_exact needs a CUDA device"
    only = set(args.only.split(","))
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": os.environ.get("RLFUSE_COMMIT", "unknown")}
    if "sweep" in only:
        res["sweep_linear"] = sweep_linear()
    if "linear" in only:
        res["linear"] = bench_linear()
    model = _model()
    if "check" in only:
        res["check"] = bench_check(model, 32 if args.quick else 64, 64 if args.quick else 128)
    if "generate" in only:
        res["generate"] = bench_generate(model, 8 if args.quick else 32, 256 if args.quick else 512)
    if "train" in only:
        res["train"] = bench_train(model)
    path = os.path.join(os.environ.get("OUT", "."), "bench_exact.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
    print("wrote", path)


if __name__ == "__main__":
    main()
