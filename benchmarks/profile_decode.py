"""Where a decode step's time goes: GEMMs per projection, attention, norms and rope, the LM
head, sampling, the rest, and the host gaps between kernels.

Model: a shape of `rlfuse bench generate` (`--shape`, default Qwen3-0.6B; the Qwen3.5 hybrids
and the MoE shapes too), random bf16 weights. Workload: B
sequences in steady decode (prompts of P random ids, every sequence decoding at once, CUDA
graphs and look-ahead as in a real run). Two measurements, per numerics:

1. Steps. `LLM.step()` is timed over N steady steps (wall clock, one batch of B all along),
   then the same N steps run under torch.profiler (CUPTI traces the kernels inside CUDA
   graph replays). Each kernel is put in a category by its name; GPU busy time is the union
   of kernel intervals, and host gap = wall - busy (the GPU idle between kernels: Python,
   scheduling, launches, the one read-back per step).
2. Projections. Each linear of a layer (q, k, v, o, gate, up, down) and the LM head is timed
   alone at M = B rows through the model's own `Linear` (the numerics' kernel), against its
   weight-read bound (weight bytes / copy bandwidth): a projection is called once per layer
   on that layer's weights (read from HBM, as in a step), from a CUDA-graph replay as the
   decode graphs run it (an eager Triton launch would add tens of us of host time); the
   two heads eagerly; CUDA events, median. The sum over layers is the GEMM time per step
   per projection. The LM head is read twice per
   step: the fp32 logits the sampler draws from, then the sampled tokens' log-probs.

    OUT=out python benchmarks/profile_decode.py                # B 256, P 512, fast and exact
    OUT=out python benchmarks/profile_decode.py --fuse off on  # unfused vs fused projections
    OUT=out python benchmarks/profile_decode.py --group 8 --prompt 256 --share off on  # GRPO groups
    OUT=out python benchmarks/profile_decode.py --shape 3.5-2b --numerics fast  # a Qwen3.5 hybrid
    OUT=out python benchmarks/profile_decode.py --kv-cache-dtype fp8_e4m3         # the fp8 KV cache
    python benchmarks/profile_decode.py --small                # CPU smoke test (no profile)
Writes $OUT/profile_decode.json and $OUT/profile_decode.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent / "kernels"))
from _timing import graphed, median_seconds  # noqa: E402 -- benchmarks/kernels/_timing.py

from rlfuse.engine.benchmark import SHAPES, build_model, copy_bandwidth
from rlfuse.engine.config import EngineConfig, SamplingParams
from rlfuse.engine.llm import LLM
from rlfuse.kernels.backend import use_numerics
from rlfuse.kernels.loss.logprob import token_logprobs
from rlfuse.run.profile import union_length

# (category, pattern on the kernel name); first match wins, order matters. Our Triton kernels
# are named after their op (`_logprob_fwd_kernel`, `_attn_fwd_kernel`, `_paged_attn_combine_kernel`:
# tests/test_engine_bench.py checks each lands in its op's category).
CATEGORIES = [
    ("qk-norm+rope+kv", r"qk_norm_rope"),  # the fused q/k norms, RoPE and KV store
    ("linear-attn", r"chunk_prep|state_pass|state_bwd|chunk_bwd|conv_|recurrent|gated_norm"),  # Gated DeltaNet
    ("attention", r"paged|attn|flash|store_kv"),
    ("norm", r"rmsnorm|norm"),
    ("rope", r"rope"),
    ("swiglu", r"swiglu|silu"),
    ("moe", r"grouped|topk_softmax|^_combine_kernel$"),  # routing, the experts' GEMMs, the combine
    ("sampling", r"sampl|cutoff|compact|threshold|gumbel|chunk_stats|histogram|argmax|topk|sort|exponential"),
    ("log-prob", r"logprob|log_softmax|logsumexp"),
    ("gemm", r"gemm|nvjet|xmma|cutlass|cublas|_linear_|matmul|splitk|sm90|lora"),
    ("copy/index", r"copy|index|gather|scatter|fill|cat|elementwise|vectorized|reduce"),
]
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINEAR_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj")
FUSED = ("qkv", "gate_up", "linear.in_proj")  # the fused groups (rlfuse.model.fuse), timed as one GEMM each
HEADS = ("lm_head", "logprob")


def category(name: str) -> str:
    low = name.lower()
    for cat, pat in CATEGORIES:
        if re.search(pat, low):
            return cat
    return "other"


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def steady_engine(model, numerics: str, B: int, P: int, max_new: int, seed: int, fuse: bool = True,
                  group: int = 1, share: bool = True, kv_cache_dtype: str = "auto") -> LLM:
    ecfg = EngineConfig(max_num_seqs=B, max_num_batched_tokens=16384, max_model_len=P + max_new + 64,
                        gpu_memory_fraction=0.85, seed=seed, numerics=numerics, fuse_projections=fuse,
                        share_prefix_decode=share, kv_cache_dtype=kv_cache_dtype)
    llm = LLM(model, None, ecfg)
    llm.capture_graphs()
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(n=group, max_tokens=max_new, temperature=0.6, ignore_eos=True)
    for i in range(B // group):  # `group` sequences per prompt (its blocks shared through the prefix cache)
        llm.add_request(torch.randint(0, min(10000, model.config.vocab_size), (P,), generator=g).tolist(), params, request_id=f"r{i}")
    # prefill everything, then a few decode steps so the look-ahead pipeline is full
    while llm.stats.prompt_tokens_computed + llm.stats.prompt_tokens_cached < B * P:
        llm.step()
    for _ in range(4):
        llm.step()
    return llm


def time_steps(llm: LLM, n: int, dev) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        llm.step()
    _sync(dev)
    return (time.perf_counter() - t0) / n


def host_profile(llm: LLM, n: int, dev, top: int = 25) -> list:
    """The engine's Python over n steps under cProfile (it slows them: compare functions, not
    the wall): [(function, calls, own s per step, cumulative s per step)], most own time first."""
    import cProfile
    import pstats
    pr = cProfile.Profile()
    _sync(dev)
    pr.enable()
    for _ in range(n):
        llm.step()
    _sync(dev)
    pr.disable()
    st = pstats.Stats(pr)
    rows = sorted(((f"{Path(f).name}:{ln}({fn})", cc, tt / n, ct / n) for (f, ln, fn), (cc, _, tt, ct, _) in
                   st.stats.items()), key=lambda r: -r[2])[:top]
    for name, calls, tt, ct in rows:
        print(f"    host {tt * 1e6:8.1f} us own {ct * 1e6:9.1f} us cum  {calls:7d}  {name}", flush=True)
    return rows


def profile_steps(llm: LLM, n: int, dev) -> dict:
    from torch.profiler import ProfilerActivity, profile
    _sync(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            llm.step()
        _sync(dev)
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    by_name = collections.Counter()
    by_cat = collections.Counter()
    spans = []
    for e in kernels:
        t = e.time_range
        d = (t.end - t.start) / 1e6  # us -> s
        by_name[e.name] += d
        by_cat[category(e.name)] += d
        spans.append((t.start, t.end))
    spans.sort()
    busy = union_length(spans) / 1e6
    window = (spans[-1][1] - spans[0][0]) / 1e6 if spans else 0.0
    return dict(profiled_wall_s_per_step=wall / n, kernel_window_s_per_step=window / n,
                gpu_busy_s_per_step=busy / n, kernels_per_step=len(kernels) / n,
                by_category_s_per_step={k: v / n for k, v in by_cat.most_common()},
                top_kernels_s_per_step=[(k[:120], v / n, category(k)) for k, v in by_name.most_common(30)])


def _groups(model) -> dict[str, list]:
    """Projection name -> that projection (or fused group) of every layer that has it, in
    layer order: full-attention and dense-MLP projections, a hybrid's linear-attention ones
    (`linear.<name>`); an MoE block's experts are not timed here (they are not one Linear)."""
    out: dict[str, list] = {}
    for layer in model.model.layers:
        mixer, mlp = layer.mixer, layer.mlp
        for n in PROJ:
            m = getattr(mixer if n[0] in "qkvo" else mlp, n, None)
            if isinstance(m, torch.nn.Module) and hasattr(m, "weight"):
                out.setdefault(n, []).append(m)
        for n in LINEAR_PROJ:
            m = getattr(mixer, n, None) if layer.mixer_name == "linear_attn" else None
            if isinstance(m, torch.nn.Module) and hasattr(m, "weight"):
                out.setdefault(f"linear.{n}", []).append(m)
        for name, owner, attr in (("qkv", mixer, "qkv_fused"), ("gate_up", mlp, "gate_up_fused"),
                                  ("linear.in_proj", mixer, "in_proj_fused")):
            group = getattr(owner, attr, None)
            if group is not None and group.live(owner):
                out.setdefault(name, []).append(group)
    return out


def time_projections(model, B: int, dev, numerics: str, bw: float) -> list[dict]:
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = model.lm_head_weight.dtype
    W = model.lm_head_weight
    ids = torch.randint(0, W.shape[0], (B,), device=dev, generator=g)
    # the engine's two LM-head reads per step: fp32 logits for sampling, then the sampled
    # tokens' log-probs through the fused log-prob kernel (what the trainer runs)
    heads = {"lm_head": lambda x: (torch.mm(x, W.t(), out_dtype=torch.float32) if dev.type == "cuda"
                                   else torch.mm(x, W.t()).float()),
             "logprob": lambda x: token_logprobs(x, W, ids, 1.0)}
    for name, mods in list(_groups(model).items()) + [(k, [v]) for k, v in heads.items()]:
        per_layer = name not in heads
        w = mods[0].weight if per_layer else W
        x = torch.randn(B, w.shape[1], device=dev, dtype=dtype, generator=g)

        def f(mods=mods, x=x):
            for m in mods:  # every layer's own weights: read from HBM as in a step, not from L2
                m(x)
        with torch.no_grad(), use_numerics(numerics):
            if dev.type == "cuda":
                per_step = median_seconds(graphed(f) if per_layer else f, 20)
            else:  # the CPU smoke run: two calls, wall clock
                f()
                t0 = time.perf_counter()
                f()
                per_step = time.perf_counter() - t0
        t = per_step / len(mods)
        wbytes = w.numel() * w.element_size()
        rows.append(dict(proj=name, out=w.shape[0], inp=w.shape[1], us=t * 1e6, bound_us=wbytes / bw * 1e6,
                         pct_bound=100 * (wbytes / bw) / t, ms_per_step=per_step * 1e3))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny fp32 model on CPU (smoke test)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--numerics", nargs="+", default=["fast", "exact"])
    ap.add_argument("--host", action="store_true", help="also the engine's Python per step under cProfile")
    ap.add_argument("--group", type=int, default=1, help="sequences per prompt (a GRPO group: the prompt's "
                    "cached blocks shared); B must be a multiple")
    ap.add_argument("--share", nargs="+", choices=["off", "auto", "on"], default=["auto"],
                    help="EngineConfig.share_prefix_decode: false, null (where it pays), true (matters with "
                         "--group > 1); 'off on' runs both")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b",
                    help="the model (random weights), as `rlfuse bench generate --shape`")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto",
                    help="EngineConfig.kv_cache_dtype (the weight-read bound ignores the KV cache either way)")
    ap.add_argument("--fuse", nargs="+", choices=["off", "on"], default=["on"],
                    help="fused q/k/v and gate/up GEMMs (EngineConfig.fuse_projections); 'off on' runs both")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    B, P, N = (8, 16, 3) if args.small else (args.batch, args.prompt, args.steps)
    bw = copy_bandwidth(dev, (64 if args.small else 1024) * 2**20)
    model = build_model(args.small, dev, 0, args.shape)
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    res = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__,
               commit=os.environ.get("RLFUSE_COMMIT", "unknown"), batch=B, prompt=P, steps=N, group=args.group,
               shape=args.shape, kv_cache_dtype=args.kv_cache_dtype,
               copy_bandwidth_GBps=bw / 1e9, weight_bytes=wbytes, runs={})
    # fusing re-points the model's parameters for good: the unfused runs go first
    runs = [(fuse, num, sh) for fuse in sorted(set(args.fuse), key=["off", "on"].index) for num in args.numerics
            for sh in sorted(set(args.share), key=["off", "auto", "on"].index)]
    for fuse, num, sh in runs:
        key = num + ("" if len(set(args.fuse)) == 1 else f" {'fused' if fuse == 'on' else 'unfused'}") \
            + ("" if len(set(args.share)) == 1 else f" share {sh}")
        llm = steady_engine(model, num, B, P, max_new=3 * N + 64, seed=0, fuse=fuse == "on",
                            group=args.group if not args.small else 2, share={"off": False, "auto": None, "on": True}[sh],
                            kv_cache_dtype=args.kv_cache_dtype)
        step_s = time_steps(llm, N, dev)
        r = dict(step_s=step_s, weight_read_bound_s=wbytes / bw)
        if args.host:
            r["host_top"] = host_profile(llm, N, dev)
        if dev.type == "cuda":
            r.update(profile_steps(llm, N, dev))
            r["host_gap_s_per_step"] = max(0.0, step_s - r["gpu_busy_s_per_step"])
        r["projections"] = time_projections(model, B, dev, num, bw)
        res["runs"][key] = r
        llm.sleep()
        del llm
        print(f"[{key}] step {step_s * 1e3:.2f} ms (weight-read bound {wbytes / bw * 1e3:.2f} ms)", flush=True)
        for k, v in r.get("by_category_s_per_step", {}).items():
            print(f"  {k:12s} {v * 1e3:8.3f} ms/step", flush=True)
        if "host_gap_s_per_step" in r:
            print(f"  {'host gap':12s} {r['host_gap_s_per_step'] * 1e3:8.3f} ms/step "
                  f"(busy {r['gpu_busy_s_per_step'] * 1e3:.3f}, profiled wall {r['profiled_wall_s_per_step'] * 1e3:.3f})")
        for k, v, c in r.get("top_kernels_s_per_step", [])[:20]:
            print(f"    {v * 1e6:9.1f} us  [{c}] {k}")
        for p in r["projections"]:
            print(f"  {p['proj']:9s} {p['out']:>6d}x{p['inp']:<5d} {p['us']:8.1f} us  bound {p['bound_us']:7.1f} us "
                  f"({p['pct_bound']:4.0f}%)  {p['ms_per_step']:6.3f} ms/step")
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "profile_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out, "profile_decode.md"), "w") as f:
        f.write(table(res))
    print(table(res))


def table(res: dict) -> str:
    nums = list(res["runs"])
    cats = sorted({c for r in res["runs"].values() for c in r.get("by_category_s_per_step", {})})
    lines = [f"Decode step breakdown, {res['device']}, shape {res.get('shape', '0.6b')}, KV cache "
             f"{res.get('kv_cache_dtype', 'auto')}, B={res['batch']}, prompt {res['prompt']} "
             f"(x{res.get('group', 1)} sequences each), {res['steps']} steady steps, commit {res['commit']} (ms per step)", "",
             "| item | " + " | ".join(nums) + " |", "|---|" + "---|" * len(nums)]

    def row(label, f):
        lines.append(f"| {label} | " + " | ".join(f(res["runs"][n]) for n in nums) + " |")
    row("step (wall, graphs)", lambda r: f"{r['step_s'] * 1e3:.2f}")
    row("weight-read bound", lambda r: f"{r['weight_read_bound_s'] * 1e3:.2f}")
    for c in cats:
        row(f"kernels: {c}", lambda r, c=c: f"{r.get('by_category_s_per_step', {}).get(c, 0) * 1e3:.3f}")
    row("GPU busy (union)", lambda r: f"{r.get('gpu_busy_s_per_step', 0) * 1e3:.3f}")
    row("host gap (wall - busy)", lambda r: f"{r.get('host_gap_s_per_step', 0) * 1e3:.3f}")
    row("kernels per step", lambda r: f"{r.get('kernels_per_step', 0):.0f}")

    def proj(r, p):
        hit = [q for q in r["projections"] if q["proj"] == p]
        return f"{hit[0]['ms_per_step']:.3f} ({hit[0]['pct_bound']:.0f}%)" if hit else "-"
    for p in PROJ + FUSED + tuple(f"linear.{n}" for n in LINEAR_PROJ) + HEADS:
        if not any(q["proj"] == p for r in res["runs"].values() for q in r["projections"]):
            continue
        row(f"{p} alone x layers (% of its bound)", lambda r, p=p: proj(r, p))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
