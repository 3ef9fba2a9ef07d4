"""Trainer prefix sharing (grpo.share_prefix) against the unshared packing, side by side.

The long-prompt GRPO case: a Qwen3-0.6B-shaped random model (rlfuse.engine.benchmark's
QWEN3_06B: 28 layers, D 1024, 16 q / 8 kv heads, V 151936, tied), bf16, gradient
checkpointing on (as bench_grpo_step.py); --groups groups of one 2,048-token prompt and 8
completions of 256 tokens, packed by the trainer's own path (`shared_contexts`,
`pack_by_tokens`, `PackedBatch.build`) into micro-batches of --micro-batch-tokens. Per
numerics (fast, exact) and layout (unshared, shared):
  * train: forward + token_logprobs + backward over every micro-batch (what one optimizer
    step's accumulate_gradients runs, batches built beforehand), median of --reps;
  * logprob: the no-grad forward + token_logprobs (old / reference / check log-probs);
  * peak memory of each (torch.cuda.max_memory_allocated above the weights and grads);
  * max |log-prob difference| shared vs unshared (exact numerics: must be 0, `bitwise`);
  * the largest per-tensor gradient difference, max |dg| / max |g| (rounding only).
Writes $OUT/bench_prefix.json and $OUT/bench_prefix.md (a table for docs/benchmarks.md).

    OUT=out python benchmarks/bench_prefix.py           # GPU (about a minute on one H100)
    python benchmarks/bench_prefix.py --small           # CPU smoke test (tiny model, seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from rlfuse.engine.benchmark import QWEN3_06B, TINY
from rlfuse.kernels.backend import use_numerics
from rlfuse.kernels.loss.logprob import token_logprobs
from rlfuse.model import CausalLM, ModelConfig
from rlfuse.run.batching import PackedBatch, pack_by_tokens, shared_contexts


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, dev, reps: int) -> float:
    """Median wall time of fn() in ms (synchronized: fn spans many launches and micro-batches);
    the caller has run fn once already (Triton compiles, allocator warm)."""
    ts = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _peak_mb(fn, dev) -> int | None:
    if dev.type != "cuda":
        fn()
        return None
    _sync(dev)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    _sync(dev)
    return round((torch.cuda.max_memory_allocated() - base) / 2**20)


def workload(groups: int, G: int, prompt: int, completion: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(groups):
        p = torch.randint(0, vocab, (prompt,), generator=g).tolist()
        seqs += [(p + torch.randint(0, vocab, (completion,), generator=g).tolist(), prompt) for _ in range(G)]
    return seqs


def batches(seqs, budget: int, share_min: int, dev) -> list[PackedBatch]:
    """The trainer's micro-batches (rlfuse.train.grpo: _micro_batches, then build)."""
    lengths = [len(s) for s, _ in seqs]
    mbs = pack_by_tokens(lengths, budget, shared_contexts(seqs, share_min))
    return [PackedBatch.build([seqs[i] for i in mb], dev, share_min) for mb in mbs]


def run(model, seqs, budget: int, numerics: str, dev, reps: int) -> dict:
    layouts = {"unshared": batches(seqs, budget, 0, dev), "shared": batches(seqs, budget, 1, dev)}
    n_targets = sum(len(s) - n for s, n in seqs)
    w = torch.randn(n_targets, generator=torch.Generator().manual_seed(1)).to(dev) / n_targets
    out: dict = {"numerics": numerics}
    lps, grads = {}, {}
    for p in model.parameters():  # allocated before the first peak, as in a run after its first step
        p.grad = torch.zeros_like(p)
    for name, bs in layouts.items():
        def logprobs(bs=bs):
            with torch.no_grad(), use_numerics(numerics):
                return torch.cat([token_logprobs(model(b.input_ids, b.positions, b.attn)[b.rows],
                                                 model.lm_head_weight, b.targets, 1.0) for b in bs])

        def train(bs=bs):
            start = 0
            for b in bs:  # accumulate_gradients: one backward per micro-batch
                with use_numerics(numerics):
                    h = model(b.input_ids, b.positions, b.attn)
                    lp = token_logprobs(h[b.rows], model.lm_head_weight, b.targets, 1.0)
                (lp * w[start:start + lp.numel()]).sum().backward()
                start += lp.numel()

        model.zero_grad(set_to_none=False)  # the peaks below are the activations' (grads held already)
        row = {"micro_batches": len(bs), "tokens": sum(b.num_tokens for b in bs),
               "train_peak_mb": _peak_mb(train, dev)}  # the first call also compiles (not timed)
        grads[name] = [p.grad.detach().clone() for p in model.parameters()]
        row["logprob_peak_mb"] = _peak_mb(lambda name=name, logprobs=logprobs: lps.__setitem__(name, logprobs()), dev)
        row["train_ms"] = round(_timed(train, dev, reps), 1)
        row["logprob_ms"] = round(_timed(logprobs, dev, reps), 1)
        out[name] = row
        print(f"{numerics:5s} {name:8s} {row}", flush=True)
    d = (lps["shared"].float() - lps["unshared"].float()).abs().max()
    out["logprob_max_abs_diff"] = float(d)
    out["bitwise"] = bool(torch.equal(lps["shared"], lps["unshared"]))
    out["grad_max_rel_diff"] = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                                   for a, b in zip(grads["shared"], grads["unshared"]))
    for k in ("train_ms", "logprob_ms"):
        out[f"{k}_speedup"] = round(out["unshared"][k] / out["shared"][k], 2)
    model.zero_grad(set_to_none=True)
    return out


def table(rows: list[dict], meta: dict) -> str:
    lines = [f"Trainer prefix sharing, {meta['shape']}, {meta['dtype']}, {meta['groups']} groups x "
             f"{meta['G']} completions, prompt {meta['prompt']} + completion {meta['completion']} tokens, "
             f"micro-batches of {meta['micro_batch_tokens']} tokens, {meta['device']}, torch {meta['torch']}, "
             f"commit {meta['commit']}", "",
             "| numerics | layout | micro-batches | tokens | fwd+bwd ms | log-prob fwd ms "
             "| peak MiB (train / log-prob) | max abs Δ log-prob | bitwise | max rel Δ grad |", "|---" * 10 + "|"]
    for r in rows:
        for name in ("unshared", "shared"):
            x = r[name]
            tail = (f"{r['logprob_max_abs_diff']:.3g} | {r['bitwise']} | {r['grad_max_rel_diff']:.2g}"
                    if name == "shared" else " | | ")
            peak = "-" if x["train_peak_mb"] is None else f"{x['train_peak_mb']} / {x['logprob_peak_mb']}"
            lines.append(f"| {r['numerics']} | {name} | {x['micro_batches']} | {x['tokens']} | {x['train_ms']} | "
                         f"{x['logprob_ms']} | {peak} | {tail} |")
        lines.append(f"| {r['numerics']} | speedup | | | {r['train_ms_speedup']}x | "
                     f"{r['logprob_ms_speedup']}x | | | | |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny fp32 model, short sequences (CPU smoke test)")
    ap.add_argument("--groups", type=int, default=None, help="prompts (default 4; --small 2)")
    ap.add_argument("--micro-batch-tokens", type=int, default=None, help="default 16384 (--small 256)")
    ap.add_argument("--numerics", default="fast,exact")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 3; --small 1)")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.small else "cpu")
    shape, dtype = (TINY, torch.float32) if a.small else (QWEN3_06B, torch.bfloat16)
    G, prompt, completion = (4, 64, 16) if a.small else (8, 2048, 256)
    groups = a.groups or (2 if a.small else 4)
    budget = a.micro_batch_tokens or (256 if a.small else 16384)
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**shape))
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
    model = model.to(device=dev, dtype=dtype).train()
    model.gradient_checkpointing = True
    seqs = workload(groups, G, prompt, completion, shape["vocab_size"])
    reps = a.reps or (1 if a.small else 3)
    rows = [run(model, seqs, budget, n, dev, reps) for n in a.numerics.split(",")]
    # run_gpu.sh sets RLFUSE_COMMIT (the device's .git may be stale)
    commit = os.environ.get("RLFUSE_COMMIT") or os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip()
    meta = dict(shape="tiny" if a.small else "Qwen3-0.6B", dtype=str(dtype).removeprefix("torch."), groups=groups,
                G=G, prompt=prompt, completion=completion, micro_batch_tokens=budget, commit=commit,
                device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_prefix.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = table(rows, meta)
    (out / "bench_prefix.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
