"""GRPO step on a Qwen3- or Qwen3.5-shaped random model (GPU): full fine-tune or LoRA, with memory by component.
MoE shapes too: `--shape 30b-a3b` (Qwen3-30B-A3B, 61 GB of bf16 weights: one H200) and
`--shape 35b-a3b` (Qwen3.5-35B-A3B's text model); `--lora-experts` adds per-expert adapters.

Workload (issue 23's): 8 prompts x 8 completions, prompts of 128 random ids, up to 1024 new
tokens (a random model almost never emits EOS, so ~1024), temperature 1, dapo loss,
gradient checkpointing, micro-batches of 16384 tokens. Reward: share of even token ids (any
reward with variance works). Shapes: the published Qwen3-{0.6B,1.7B,4B,8B} configs and the
Qwen3.5-{0.8B,2B} hybrids' text towers (`--shape 3.5-0.8b / 3.5-2b`; `rlfuse.engine.benchmark.SHAPES`),
random bf16 weights made on the GPU. `--hybrid-vs-dense`: issue 34's target, the Qwen3.5-2B
shape (1.9 B) and the dense Qwen3-1.7B shape (1.7 B) full fine-tune, one process each, and
the ratio of their step times (target <= 1.3). `--lora R`:
rank R (alpha 2R) on every linear layer (q k v o gate up down), base frozen. The KV pool
holds the whole batch (64 sequences x 1152 tokens) and no more, so its size is the batch's.

Memory by component, from torch.cuda.memory_allocated before and after each is made:
weights; LoRA A and B; optimizer state (fp32 masters + Adam moments of what trains); the KV
pool; and per step the peak of generate and of score + train (max_memory_allocated, reset at
each phase edge). "train extra" = train peak - what is resident when training starts
(gradients + activations + the log-prob chunks); of it, the fp32 gradient buffers are
4 bytes x trainable parameters. Steps: the first is a warm-up (CUDA graph capture, Triton
compilation) and is reported separately.

    OUT=out python benchmarks/bench_grpo_step.py                        # 0.6B full fine-tune, 3 steps
    OUT=out python benchmarks/bench_grpo_step.py --shape 8b --lora 16   # one case
    OUT=out python benchmarks/bench_grpo_step.py --table                # every shape, full FT and LoRA 16
    OUT=out python benchmarks/bench_grpo_step.py --hybrid-vs-dense      # Qwen3.5-2B vs Qwen3-1.7B shapes
    OUT=out python benchmarks/bench_grpo_step.py --demo                 # + `rlfuse demo --size gpu`
    python benchmarks/bench_grpo_step.py --small [--lora 4 | --table]   # CPU smoke test (tiny model)
`--table` runs each case in its own process (an out-of-memory case fails alone), LoRA cases
first, under one time budget (`--budget-s`); a full fine-tune whose weights + optimizer state +
fp32 gradients (18 bytes a parameter) exceed the card is skipped with that reason.
Writes $OUT/bench_grpo_step.json and .md (one case) or $OUT/bench_grpo_table.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlfuse.engine.benchmark import SHAPES, random_model  # noqa: E402

NAMES = {"30b-a3b": "Qwen3-30B-A3B", "35b-a3b": "Qwen3.5-35B-A3B"}  # else Qwen3-<SHAPE> / Qwen3.5-<SHAPE>
from rlfuse.kernels.backend import new_compiles, record_compiles, triton_compiles  # noqa: E402
from rlfuse.model.arch.qwen3_5 import tiny_hybrid_fields  # noqa: E402

REWARD = "def even(prompts, completions, completion_ids, **kw):\n" \
         "    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]\n"
SMALL = dict(model_type="qwen3", qk_norm=True, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512,
             tie_word_embeddings=True)
SMALL_HYBRID = tiny_hybrid_fields()  # --small with a 3.5-* shape
GIB = 2**30
FULL_FT_BYTES = 2 + 12 + 4  # a parameter in a full fine-tune: bf16 weight, fp32 master + 2 moments, fp32 gradient
SHARE_LABEL = {None: "auto", True: "yes", False: "no"}  # engine.share_prefix_decode in the tables
TABLE = [("4b", 16), ("8b", 16), ("0.6b", 16), ("1.7b", 16), ("0.6b", 0), ("1.7b", 0), ("4b", 0), ("8b", 0)]
HYBRID_VS_DENSE = [("1.7b", 0), ("3.5-2b", 0)]  # the dense shape first, then the hybrid of about its size


class PhaseMemory:
    """The trainer's sampler, reading CUDA memory at the phase edges: resident before
    generate and its peak; resident after the engine sleeps (the KV pool released), from
    where the score + train peak is counted."""

    def __init__(self, inner, device: torch.device):
        self.inner, self.cuda = inner, device.type == "cuda"
        self.before_generate = self.generate_peak = self.after_sleep = 0

    def _now(self, reset: bool = False) -> int:
        if not self.cuda:
            return 0
        torch.cuda.synchronize()
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def wake(self) -> None:
        self.inner.wake()

    def generate(self, *args, **kwargs):
        self.before_generate = self._now(reset=True)
        out = self.inner.generate(*args, **kwargs)
        self._now()
        self.generate_peak = torch.cuda.max_memory_allocated() if self.cuda else 0
        return out

    def sleep(self) -> None:
        self.inner.sleep()
        self.after_sleep = self._now(reset=True)


def allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def run_case(out: Path, *, small: bool, numerics: str = "fast", shape: str = "0.6b", lora: int = 0,
             lora_experts: bool = False, steps: int = 3, micro_batch_tokens: int = 16384, checkpointing: bool = True,
             fuse: bool = True, warm: bool = False, share: bool | None = None, log_compiles: bool = False,
             kv: str = "auto", init: str = "stream") -> dict:
    """One GRPO case in this process: {case, memory by component (bytes), step rows}."""
    from rlfuse.data.prompts import Prompt, PromptStream
    from rlfuse.engine import EngineConfig
    from rlfuse.model import CausalLM, ModelConfig
    from rlfuse.rollout.rewards import RewardSet
    from rlfuse.rollout.sampler import EngineSampler
    from rlfuse.run import apply_lora, build_engine, char_tokenizer
    from rlfuse.run.config.run_config import load_config
    from rlfuse.train.grpo import GRPOStep
    from rlfuse.train.sft import make_optimizer

    dev = torch.device("cuda" if torch.cuda.is_available() and not small else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sh = (SMALL_HYBRID if shape.startswith("3.5") else SMALL) if small else SHAPES[shape]
    P, G, new, plen = (8, 8, 1024, 128) if not small else (2, 4, 16, 16)
    case = {"shape": "tiny" if small else shape, "mode": f"LoRA r{lora}" if lora else "full FT", "numerics": numerics,
            "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "micro_batch_tokens": micro_batch_tokens, "gradient_checkpointing": checkpointing, "fused": fuse,
            "warm_kernels": warm, "share_prefix_decode": share, "kv_cache_dtype": kv}
    with torch.device("meta"):
        n_params = sum(p.numel() for p in CausalLM(ModelConfig(**sh)).parameters())
    case["params_B"] = n_params / 1e9
    if not lora and dev.type == "cuda":
        need, total = n_params * FULL_FT_BYTES, torch.cuda.mem_get_info()[1]
        if need > total:
            return case | {"skipped": f"full fine-tune needs {need / GIB:.0f} GiB for weights + optimizer state + "
                                      f"fp32 gradients alone ({FULL_FT_BYTES} B x {n_params / 1e9:.2f} B params); "
                                      f"the card has {total / GIB:.0f} GiB"}
    (out / "reward_even.py").write_text(REWARD)
    block = EngineConfig().block_size
    cfg = load_config({
        "model": {"random_init": sh, "init": init, "dtype": str(dtype).removeprefix("torch."),
                  "gradient_checkpointing": checkpointing,
                  **({"lora": {"rank": lora, "alpha": 2.0 * lora, "experts": lora_experts}} if lora else {})},
        "engine": {"numerics": numerics, "fuse_projections": fuse, "share_prefix_decode": share, "kv_cache_dtype": kv,
                   "max_num_seqs": P * G, "max_model_len": plen + new,
                   "num_kv_blocks": P * G * math.ceil((plen + new) / block)},
        "rewards": [{"name": f"{out}/reward_even.py:even"}],
        "optim": {"lr": 1e-6, "schedule": "constant"},
        "grpo": {"steps": steps, "prompts_per_step": P, "group_size": G, "max_new_tokens": new, "temperature": 1.0,
                 "loss_type": "dapo", "micro_batch_tokens": micro_batch_tokens if not small else 256,
                 "warm_kernels": warm},
        "logging": {"run_dir": str(out / "grpo_step"), "tensorboard": False, "progress": False},
    })
    tok = char_tokenizer("abc")  # only for decoding text; prompts are token ids
    mem = {}
    m0 = allocated(dev)
    model = random_model(sh, dev, dtype, seed=0)
    model.gradient_checkpointing = checkpointing
    mem["weights"] = allocated(dev) - m0
    case["weights_counted"] = sum(p.numel() * p.element_size() for p in model.parameters())  # vs the measured
    apply_lora(model, cfg.model, seed=0)
    mem["lora_params"] = allocated(dev) - m0 - mem["weights"]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    case["trainable_M"] = trainable / 1e6
    m1 = allocated(dev)
    opt = make_optimizer(model, cfg)
    mem["optimizer_state"] = allocated(dev) - m1
    m2 = allocated(dev)
    llm = build_engine(model, tok, cfg.engine)
    mem["kv_pool"] = llm.kv.nbytes
    mem["engine_other"] = allocated(dev) - m2 - llm.kv.nbytes
    mem["fp32_gradients"] = 4 * trainable  # counted: MasterAdamW's fp32 accumulators, alive in the train phase
    sampler = PhaseMemory(EngineSampler(llm, tok), dev)
    gen = torch.Generator().manual_seed(0)
    prompts = [Prompt(torch.randint(0, min(10000, sh["vocab_size"]), (plen,), generator=gen).tolist(), "", {},
                      f"p{i}") for i in range(P * steps)]
    tr = GRPOStep(cfg, model, sampler, RewardSet(cfg.rewards), PromptStream(prompts, seed=0), opt)
    rows = []
    specs = []  # --log-compiles: (step, kernel, Triton's specialization JSON) of each compile
    for step in range(steps):
        c0 = triton_compiles()
        t0 = time.perf_counter()
        with record_compiles(skip=False) if log_compiles and dev.type == "cuda" else contextlib.nullcontext([]) as reqs:
            m = tr.step(step)
        wall = time.perf_counter() - t0
        specs += [(step, f"{mod}.{name}", spec) for mod, name, spec, _ in reqs]
        compiled = new_compiles(c0, triton_compiles())  # Triton compiles this step paid for
        train_peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
        row = {"step": step, "warmup": step == 0, "wall_s": wall, "triton_compiles": compiled,
               "generate_peak": sampler.generate_peak, "before_generate": sampler.before_generate,
               "after_sleep": sampler.after_sleep, "train_peak": train_peak,
               "train_extra": train_peak - sampler.after_sleep,
               **{k: float(v) for k, v in m.items() if k.startswith(("time/", "tokens_per_s/", "mismatch/",
                                                                        "completion_len/", "loss", "grad_norm",
                                                                        "compile/"))}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    llm.sleep()
    del tr, sampler, llm, opt, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if log_compiles:
        (out / f"compiles_{numerics}.json").write_text(json.dumps(specs, indent=1))
        for line in variant_diffs(specs):
            print(line, flush=True)
    return case | {"memory": mem, "steps": rows}


def _flat(x, path=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _flat(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _flat(v, f"{path}[{i}]")
    else:
        yield path, x


def variant_diffs(specs: list) -> list[str]:
    """For each kernel compiled more than once: the specialization fields that differ
    between its variants (what made Triton compile it again), with the step of each."""
    by_kernel: dict[str, list] = {}
    for step, name, spec in specs:
        by_kernel.setdefault(name, []).append((step, dict(_flat(json.loads(spec)))))
    lines = []
    for name, vs in sorted(by_kernel.items()):
        if len(vs) < 2:
            continue
        keys = sorted({k for _, f in vs for k in f})
        diff = [k for k in keys if len({repr(f.get(k)) for _, f in vs}) > 1]
        lines.append(f"{name}: {len(vs)} variants (steps {[st for st, _ in vs]})")
        lines += [f"    {k}: {[f.get(k) for _, f in vs]}" for k in diff[:12]]
    return lines


def gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def table_md(cases: list[dict]) -> list[str]:
    lines = ["| shape | mode | params | trainable | step s | generate s | train s | rollout tok/s | weights GiB | "
             "LoRA A,B GiB | optimizer state GiB | KV pool GiB | generate peak GiB | train peak GiB | "
             "train extra GiB (fp32 grads) |", "|" + "---|" * 15]
    for c in cases:
        head = f"| {c['shape']} | {c['mode']} | {c['params_B']:.2f} B |"
        if "skipped" in c or "error" in c:
            lines.append(f"{head} | {'skipped: ' + c['skipped'] if 'skipped' in c else 'failed: ' + c['error']} |"
                         + " |" * 11)
            continue
        r, m = c["steps"][-1], c["memory"]
        lines.append(f"{head} {c['trainable_M']:.1f} M | {r['time/step']:.2f} | {r['time/generate']:.2f} | "
                     f"{r['time/train']:.2f} | {r['tokens_per_s/rollout']:.0f} | {gib(m['weights'])} | "
                     f"{gib(m['lora_params'])} | {gib(m['optimizer_state'])} | {gib(m['kv_pool'])} | "
                     f"{gib(r['generate_peak'])} | {gib(r['train_peak'])} | {gib(r['train_extra'])} "
                     f"({gib(m['fp32_gradients'])}) |")
    return lines


def run_table(out: Path, args, header: str, todo: list[tuple[str, int]] | None = None) -> int:
    """Every case of `todo` (default TABLE) in a child process, in order, within args.budget_s."""
    deadline, cases = time.monotonic() + args.budget_s, []
    todo = todo or (TABLE if not args.small else [("0.6b", 4), ("0.6b", 0)])
    for shape, rank in todo:
        left = min(args.case_s, deadline - time.monotonic())
        base = {"shape": shape, "mode": f"LoRA r{rank}" if rank else "full FT", "params_B": float("nan")}
        if left < 30:
            cases.append(base | {"skipped": "out of the time budget (--budget-s)"})
            continue
        path = out / f"case_{shape}_{rank}.json"
        path.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--shape", shape, "--lora", str(rank), "--steps", str(args.steps),
               "--numerics", args.numerics, "--micro-batch-tokens", str(args.micro_batch_tokens),
               "--case-json", str(path)] + (["--small"] if args.small else []) \
            + (["--no-checkpointing"] if args.no_checkpointing else [])
        print(f"== {shape} {base['mode']}: {' '.join(cmd[1:])} (cap {left:.0f} s)", flush=True)
        try:
            proc = subprocess.run(cmd, timeout=left, capture_output=True, text=True)
            tail = (proc.stdout + proc.stderr)[-3000:]
            print(tail, flush=True)
        except subprocess.TimeoutExpired:
            cases.append(base | {"error": f"over its time cap of {left:.0f} s"})
            continue
        if proc.returncode == 0 and path.exists():
            cases.append(json.loads(path.read_text()))
        else:
            oom = "OutOfMemoryError" in tail or "out of memory" in tail
            cases.append(base | {"error": "out of memory" if oom else f"exit {proc.returncode}: "
                                 + " ".join(tail.strip().splitlines()[-1:])[:200]})
        (out / "bench_grpo_table.json").write_text(json.dumps({"header": header, "cases": cases}, indent=1))
    ratio = []
    if todo == HYBRID_VS_DENSE and all("steps" in c for c in cases):
        t_dense, t_hybrid = (c["steps"][-1]["time/step"] for c in cases)
        ratio = ["", f"Qwen3.5-2B shape / Qwen3-1.7B shape step time: {t_hybrid / t_dense:.2f}x (target <= 1.3x)"]
    md = "\n".join([f"### GRPO step by shape, full fine-tune and LoRA: {header}", "",
                    "Last measured step (after a warm-up step); memory from torch.cuda.memory_allocated / "
                    "max_memory_allocated (benchmarks/bench_grpo_step.py docstring)", "", *table_md(cases),
                    *ratio]) + "\n"
    (out / "bench_grpo_table.md").write_text(md)
    print(md)
    return 0


def gpu_name(small: bool, table: bool) -> str:
    if small or not torch.cuda.is_available():
        return "cpu"
    if table:  # the parent stays off the GPU: a CUDA context here would take memory from its cases
        smi = shutil.which("nvidia-smi")
        name = smi and subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                                      capture_output=True, text=True).stdout.strip()
        return name or "GPU (see each case's device)"
    return torch.cuda.get_device_name()


def demo_bench(out: Path) -> dict:
    run_dir = out / "demo"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sys; from rlfuse.cli import main; sys.exit(main())",
                    "demo", "--size", "gpu", "--run-dir", str(run_dir)], check=True)
    res = json.loads((run_dir / "demo.json").read_text())
    res["wall_s"] = time.perf_counter() - t0
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b",
                    help="Qwen3 shape, Qwen3.5 (3.5-*) or an MoE one (30b-a3b, 35b-a3b); random weights")
    ap.add_argument("--hybrid-vs-dense", action="store_true",
                    help="the Qwen3.5-2B and Qwen3-1.7B shapes, full fine-tune, one process each, and their ratio")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA rank on every linear layer; 0: full FT")
    ap.add_argument("--lora-experts", action="store_true", help="MoE shapes with --lora: per-expert adapters too")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps, the first a warm-up (default 3; 2 in --table)")
    ap.add_argument("--table", action="store_true", help="every shape, full FT and LoRA 16, one process each")
    ap.add_argument("--budget-s", type=float, default=480, help="--table: time for all cases together")
    ap.add_argument("--case-s", type=float, default=200, help="--table: time cap of one case (the first compiles)")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384, help="grpo.micro_batch_tokens")
    ap.add_argument("--no-checkpointing", action="store_true",
                    help="no gradient checkpointing (saves the recompute; needs memory for a micro-batch's activations)")
    ap.add_argument("--case-json", help=argparse.SUPPRESS)  # --table's child writes its case here
    ap.add_argument("--demo", action="store_true", help="also run `rlfuse demo --size gpu`")
    ap.add_argument("--small", action="store_true", help="tiny model, CPU-sized (smoke test)")
    ap.add_argument("--fuse", choices=("on", "off", "both"), default="on",
                    help="engine.fuse_projections (q/k/v and gate/up as one GEMM each); both: off then on")
    ap.add_argument("--share-prefix-decode", choices=("auto", "on", "off", "both"), default="auto",
                    help="engine.share_prefix_decode (a group's prompt K/V read once per decode step): auto = null "
                         "(where it pays), on = true, off = false; both: off then on")
    ap.add_argument("--log-compiles", action="store_true",
                    help="write $OUT/compiles_<numerics>.json: each Triton compile of each step with its "
                         "specialization (which argument values made a new variant)")
    ap.add_argument("--warm-kernels", action="store_true",
                    help="grpo.warm_kernels true: compile the update's kernels in worker processes during the "
                         "first rollout (an A/B of the first step: run each in a fresh process on a cold "
                         "TRITON_CACHE_DIR)")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3", "both"), default="auto",
                    help="engine.kv_cache_dtype; both: the model dtype's cache, then fp8 (side by side)")
    ap.add_argument("--init", choices=("stream", "keyed"), default="stream",
                    help="model.init of the random weights: keyed draws them on the GPU (a 32B shape in seconds, "
                         "not minutes on the CPU); other values than stream's, same timings")
    ap.add_argument("--numerics", choices=("fast", "exact", "both"), default="fast",
                    help="engine.numerics of the step; both: fast then exact in one process (side by side)")
    args = ap.parse_args()
    args.steps = args.steps or (2 if args.table else 3)
    if args.hybrid_vs_dense:
        args.table = True
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    gpu = gpu_name(args.small, args.table)
    commit = os.environ.get("RLFUSE_COMMIT") or subprocess.run(  # run_gpu.sh sets it
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    workload = "tiny (smoke)" if args.small else "8 prompts x 8, 128-token prompts, <=1024 new, bf16 random weights"
    header = f"{workload}; {gpu}, torch {torch.__version__}, commit {commit}"
    if args.case_json:
        res = run_case(out, small=args.small, numerics=args.numerics, shape=args.shape, lora=args.lora,
                       lora_experts=args.lora_experts,
                       steps=args.steps, micro_batch_tokens=args.micro_batch_tokens,
                       checkpointing=not args.no_checkpointing)
        Path(args.case_json).write_text(json.dumps(res, indent=1))
        return 0
    if args.table:
        if args.numerics == "both":
            raise SystemExit("--table runs one numerics; give --numerics fast or exact")
        flag = "--hybrid-vs-dense" if args.hybrid_vs_dense else "--table"
        header += f", command `python benchmarks/bench_grpo_step.py {flag}{' --small' if args.small else ''}`"
        return run_table(out, args, header, HYBRID_VS_DENSE if args.hybrid_vs_dense else None)
    cases = [run_case(out, small=args.small, numerics=n, shape=args.shape, lora=args.lora,
                      lora_experts=args.lora_experts, steps=args.steps,
                      micro_batch_tokens=args.micro_batch_tokens, checkpointing=not args.no_checkpointing, fuse=f,
                      warm=args.warm_kernels, share=sh, log_compiles=args.log_compiles, kv=kv, init=args.init)
             for kv in (("auto", "fp8_e4m3") if args.kv_cache_dtype == "both" else (args.kv_cache_dtype,))
             for n in (("fast", "exact") if args.numerics == "both" else (args.numerics,))
             for f in ((False, True) if args.fuse == "both" else (args.fuse == "on",))
             for sh in ((False, True) if args.share_prefix_decode == "both"
                        else ({"auto": None, "on": True, "off": False}[args.share_prefix_decode],))]
    result = {"gpu": gpu, "torch": torch.__version__, "commit": commit, "small": args.small, "cases": cases}
    (out / "bench_grpo_step.json").write_text(json.dumps(result, indent=2))  # kept if the demo fails
    if args.demo:
        try:
            result["demo"] = demo_bench(out)
        except (subprocess.CalledProcessError, OSError, ValueError) as e:
            result["demo_error"] = repr(e)
            print(f"demo failed: {e!r}", file=sys.stderr)
            args.demo = False
        (out / "bench_grpo_step.json").write_text(json.dumps(result, indent=2))
    mode = f"LoRA rank {args.lora} on all linear layers" if args.lora else "full fine-tune"
    flags = "".join(f" {f}" for f, on in ((f"--shape {args.shape}", args.shape != "0.6b"),
                                           (f"--lora {args.lora}", args.lora),
                                           ("--lora-experts", args.lora_experts), ("--demo", args.demo),
                                           (f"--micro-batch-tokens {args.micro_batch_tokens}",
                                            args.micro_batch_tokens != 16384),
                                           ("--no-checkpointing", args.no_checkpointing),
                                           (f"--fuse {args.fuse}", args.fuse != "on"),
                                           (f"--kv-cache-dtype {args.kv_cache_dtype}", args.kv_cache_dtype != "auto"),
                                           (f"--share-prefix-decode {args.share_prefix_decode}",
                                            args.share_prefix_decode != "auto"),
                                           ("--warm-kernels", args.warm_kernels)) if on)
    name = NAMES.get(args.shape) or (f"Qwen{args.shape.upper()}" if args.shape.startswith("3.5")
                                     else f"Qwen3-{args.shape.upper()}")
    lines = [f"### GRPO step: {name}-shaped, {mode}; {header}",
             f"command `python benchmarks/bench_grpo_step.py{flags}`", "",
             "| numerics | fused | shared prefix | step | generate s | score s | train s | step s | rollout tok/s | train tok/s | peak MiB | "
             "mean new tokens | max abs dlogp | Triton compiles |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        if "skipped" in c:
            lines.append(f"| {c['numerics']}{' + fp8 KV' if c.get('kv_cache_dtype') == 'fp8_e4m3' else ''} | "
                         f"{'yes' if c['fused'] else 'no'} | "
                         f"{SHARE_LABEL[c.get('share_prefix_decode')]} | skipped: {c['skipped']} |" + " |" * 10)
            continue
        for r in c["steps"]:
            peak = max(r["generate_peak"], r["train_peak"]) / 2**20
            lines.append(f"| {c['numerics']}{' + fp8 KV' if c.get('kv_cache_dtype') == 'fp8_e4m3' else ''} | "
                         f"{'yes' if c['fused'] else 'no'} | "
                         f"{SHARE_LABEL[c.get('share_prefix_decode')]} | {r['step']}{' (warm-up)' if r['warmup'] else ''} | "
                         f"{r['time/generate']:.2f} | {r['time/score']:.2f} | {r['time/train']:.2f} | "
                         f"{r['time/step']:.2f} | {r['tokens_per_s/rollout']:.0f} | {r['tokens_per_s/train']:.0f} | "
                         f"{peak:.0f} | {r['completion_len/mean']:.0f} | {r['mismatch/max_abs']:.2e} | "
                         f"{sum(r.get('triton_compiles', {}).values())} |")
    lines += ["", "Memory by component (last case):", "", *table_md(cases[-1:])]
    if args.demo:
        d = result["demo"]
        lines += ["", f"Demo (`rlfuse demo --size gpu`): held-out accuracy after SFT {d['accuracy_sft']:.3f} -> "
                      f"after GRPO {d['accuracy_grpo']:.3f} on {d['eval_problems']} problems; SFT {d['sft_steps']} "
                      f"steps {d['time_sft_s']:.0f} s, GRPO {d['grpo_steps']} steps {d['time_grpo_s']:.0f} s, "
                      f"total {d['time_total_s']:.0f} s"]
    md = "\n".join(lines) + "\n"
    (out / "bench_grpo_step.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
