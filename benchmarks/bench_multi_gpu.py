"""Multi-GPU runs of the real commands (torchrun, NCCL) against one GPU: does it run,
equivalence, GRPO scaling, faults. Needs >= 2 CUDA GPUs (one node).

Every job is a real command (`python3 -m rlfuse ...` or `torchrun --standalone
--nproc_per_node 2 -m rlfuse ...`) on a generated recipe: a Qwen3-shaped random-weight
model (bf16 unless noted), a character tokenizer saved as a folder, prompts of 128 random
letters (128 tokens) with 64-letter SFT completions, reward = share of even token ids
(any reward with variance will do). Run folders live under --work (default /tmp/mgpu);
results go to $OUT/bench_multi_gpu_<phase>.json, every job's log into
$OUT/logs_<phase>.tar.gz, and a table is printed last.

Phases (several may be given; they run in order):
  env     nvidia-smi, device count, NCCL / PyTorch multicast variables, versions
  run     SFT (fp32) and GRPO (bf16, numerics exact) on 1 GPU and on 2 GPUs, 3 steps, same
          global batch and seed: per-step metric and final-weight differences, exact
          mismatch; GRPO fast numerics on 2 GPUs (CUDA graphs after each wake);
          DPO under torchrun on the SFT rows (expected: one error line, no preference pairs)
  kinds   PPO (policy and critic sharded), LoRA GRPO (base and adapters replicated),
          LoRA GRPO in stream mode and GRPO through a server-recorded agent (rollout.agent:
          two chat calls an episode, each rank its own server and engine), bf16, exact
          numerics, on 1 GPU and on 2 GPUs, 3 steps, same global batch and seed: per-step
          metric and final-weight (LoRA: adapter) differences, exact mismatch
  scale   GRPO 8 prompts x 8 completions per GPU, <=1024 new tokens, 1 and 2 GPUs, --shapes
  faults  a rank that raises, a rank SIGKILLed mid-step, --resume on 2 GPUs vs the
          uninterrupted run, the 2-GPU checkpoint resumed on 1 GPU
  moe     full fine-tuning GRPO (bf16, numerics exact) of a Qwen3-MoE shape (--moe-shape,
          default moe-3b: 2.9 B parameters, 64 experts top-8), experts FSDP2-sharded, on each
          of --moe-gpus (1 2 4), 3 steps, same global batch and seed: per-step
          metric differences against 1 GPU (the router losses apart: split-dependent), the
          log-prob mismatch and moe/routing_mismatch (max over ranks: 0 = 0 on every rank),
          step time and peak memory (the fullest GPU), final-weight differences

    OUT=out python3 benchmarks/bench_multi_gpu.py env run
    OUT=out python3 benchmarks/bench_multi_gpu.py scale --scale-runs 0.6b:1 0.6b:2 4b:2
    OUT=out python3 benchmarks/bench_multi_gpu.py kinds
    OUT=out python3 benchmarks/bench_multi_gpu.py moe --moe-gpus 1 2 4 --job-timeout 900
The subprocesses inherit this environment unchanged (the machine's NCCL settings included).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from rlfuse.engine.benchmark import MOE_SHAPES, QWEN3_SHAPES

SHAPES = {**QWEN3_SHAPES, **MOE_SHAPES}

ROOT = Path(__file__).resolve().parents[1]
COMMON_SHAPE = dict(max_position_embeddings=4096)  # over the published 40960: these runs stay short
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, vocab_size=64, max_position_embeddings=1024)  # --small: CPU smoke test of this script
TINY_MOE = dict(TINY, model_type="qwen3_moe",  # --small for MoE shapes; 5 experts shard unevenly on 2 ranks
                moe=dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True))
SMALL = [False]
DEADLINE = [float("inf")]
REWARD = ("import os, signal\n"
          "def even(prompts, completions, completion_ids, **kw):\n"
          "    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]\n"
          "CALLS = [0]\n"
          "def faulty(prompts, completions, completion_ids, *, mode='raise', rank=1, call=2, **kw):\n"
          "    CALLS[0] += 1\n"
          "    if os.environ.get('RANK') == str(rank) and CALLS[0] >= call:\n"
          "        if mode == 'kill':\n"
          "            os.kill(os.getpid(), signal.SIGKILL)\n"
          "        raise RuntimeError(f'injected fault on rank {rank} at reward call {call}')\n"
          "    return even(prompts, completions, completion_ids)\n")
AGENT = ("async def twice(client, row):\n"  # kinds: the second call extends the first (one merged sample)
         "    msgs = [{'role': 'user', 'content': row['prompt']}]\n"
         "    r = await client.chat.completions.create(model='rlfuse-policy', messages=msgs)\n"
         "    msgs += [{'role': 'assistant', 'content': r.choices[0].message.content or ''},\n"
         "             {'role': 'user', 'content': row['prompt'][:16]}]\n"
         "    await client.chat.completions.create(model='rlfuse-policy', messages=msgs)\n"
         "    return None  # the recipe's reward scores the last call's completion\n")
# stream/*: times and gradient slots, per rank by nature (each rank's groups finish in their own order)
NOT_COMPARED = ("time/", "tokens_per_s", "memory/", "stream/", "rollout/agent_wall_s")


# ------------------------------------------------------------------ set-up
def setup(work: Path) -> None:
    """The tokenizer folder, the prompt file and the reward file (same seed every time)."""
    sys.path.insert(0, str(ROOT))
    from rlfuse.rollout import char_chat_tokenizer
    from rlfuse.run.build import char_tokenizer

    work.mkdir(parents=True, exist_ok=True)
    letters = "abcdefghijklmnopqrstuvwxyz"
    char_tokenizer(letters).save(work / "tok")
    char_chat_tokenizer(letters).save(work / "tok_chat")  # with the compact chat template (kinds: the agent)
    rng = random.Random(0)
    with open(work / "prompts.jsonl", "w") as f:
        for _ in range(512):
            f.write(json.dumps({"prompt": "".join(rng.choice(letters) for _ in range(128)),
                                "completion": "".join(rng.choice(letters) for _ in range(64)), "answer": ""}) + "\n")
    (work / "reward.py").write_text(REWARD)
    (work / "agent.py").write_text(AGENT)


def recipe(work: Path, name: str, kind: str, *, shape="0.6b", dtype="bfloat16", numerics="fast", steps=3,
           prompts=8, group=8, new=64, rewards=None, gpu_frac=0.85, ckpt_every=0, save_final=False, max_seqs=32,
           kv_blocks=None, **extra) -> Path:
    import yaml

    cfg = {
        "seed": 0,
        "model": {"random_init": ((TINY_MOE if "moe" in SHAPES[shape] else TINY) if SMALL[0]
                                  else SHAPES[shape] | COMMON_SHAPE), "tokenizer": str(work / "tok"),
                  "dtype": "float32" if SMALL[0] else dtype, "gradient_checkpointing": True},
        "data": {"train": str(work / "prompts.jsonl"), "max_prompt_len": 256},
        "rewards": rewards or [{"name": f"{work}/reward.py:even"}],
        "optim": {"lr": 1e-5, "warmup_steps": 0, "schedule": "constant"},
        "engine": {"max_num_seqs": 32} if SMALL[0] else {"gpu_memory_fraction": gpu_frac, "numerics": numerics,
                                                              "max_num_seqs": max_seqs}
        | ({"num_kv_blocks": kv_blocks, "max_model_len": 1280} if kv_blocks else {}),
        "logging": {"tensorboard": False, "progress": False},
        "checkpoint": {"every": ckpt_every, "save_final": save_final},
    }
    if kind == "sft":
        cfg["sft"] = {"steps": steps, "batch_size": 8, "micro_batch_tokens": 512}
    elif kind == "ppo":
        cfg["ppo"] = {"steps": steps, "prompts_per_step": prompts, "samples_per_prompt": group, "max_new_tokens": new,
                      "temperature": 1.0, "micro_batch_tokens": 16384, "sample_every": 0, "mu": 2,
                      "mini_batches": 2, "kl_coef": 0.05}
    else:
        cfg["grpo"] = {"steps": steps, "prompts_per_step": prompts, "group_size": group, "max_new_tokens": new,
                       "temperature": 1.0, "loss_type": "dapo", "micro_batch_tokens": 16384, "sample_every": 0}
    for k, v in extra.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# ------------------------------------------------------------------ jobs
class Jobs:
    def __init__(self, work: Path, out: Path, phase: str):
        self.work, self.out, self.phase = work, out, phase
        self.logs = work / f"logs_{phase}"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, dict] = {}

    def argv(self, cmd: str, cfg: Path, run_dir: Path, gpus: int, *more: str) -> list[str]:
        base = ["torchrun", "--standalone", "--nproc_per_node", str(gpus), "-m", "rlfuse"] if gpus > 1 else \
            [sys.executable, "-m", "rlfuse"]
        return base + [cmd, str(cfg), "--run-dir", str(run_dir), *more]

    def start(self, name: str, argv: list[str], *, gpu: str | None = None, timeout: float = 300):
        left = DEADLINE[0] - time.time()
        if left < 60:  # --budget-s: record the job as not run rather than be killed mid-job
            return (name, argv, None, None, time.perf_counter(), 0)
        timeout = min(timeout, left)
        env = dict(os.environ)  # the machine's NCCL / multicast settings pass through unchanged
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
        env["PYTHONUNBUFFERED"] = "1"
        if gpu is not None:  # an index among the GPUs this script was given, not a physical id
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[int(gpu)] if visible else gpu
        log = open(self.logs / f"{name}.log", "w")
        log.write(" ".join(argv) + "\n")
        log.flush()
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        return (name, argv, p, log, time.perf_counter(), timeout)

    def wait(self, *handles) -> list[dict]:
        res = []
        for name, argv, p, log, t0, timeout in handles:
            if p is None:
                self.results[name] = r = {"name": name, "cmd": " ".join(argv), "rc": "not run (--budget-s)",
                                          "wall_s": 0, "tail": "", "errors": []}
                res.append(r)
                print(f"[{self.phase}] {name}: not run (--budget-s)", flush=True)
                continue
            try:
                rc = p.wait(timeout=max(1.0, t0 + timeout - time.perf_counter()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                rc = p.wait()
                rc = f"timeout {timeout}s"
            log.close()
            text = (self.logs / f"{name}.log").read_text(errors="replace")
            r = {"name": name, "cmd": " ".join(argv), "rc": rc, "wall_s": round(time.perf_counter() - t0, 1),
                 "tail": text[-1500:], "errors": [ln for ln in text.splitlines() if "rlfuse: error" in ln
                                                  or "exitcode" in ln or "Signal 9" in ln or "SIGKILL" in ln][:8]}
            self.results[name] = r
            res.append(r)
            print(f"[{self.phase}] {name}: rc {rc} in {r['wall_s']} s", flush=True)
        return res

    def run(self, name, argv, **kw) -> dict:
        return self.wait(self.start(name, argv, **kw))[0]

    def finish(self, extra: dict) -> None:
        with tarfile.open(self.out / f"logs_{self.phase}.tar.gz", "w:gz") as tf:
            tf.add(self.logs, arcname=f"logs_{self.phase}")
        data = {"phase": self.phase, "jobs": self.results, **extra}
        (self.out / f"bench_multi_gpu_{self.phase}.json").write_text(json.dumps(data, indent=1, default=str))


def metrics(run_dir: Path, stage: str) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return []
    return [r for r in map(json.loads, p.read_text().splitlines()) if r.get("stage") == stage]


def metric_diff(a: list[dict], b: list[dict], skip: tuple[str, ...] = ()) -> dict:
    """Per step: max |a - b| / max(1, |b|) over the compared metrics (NOT_COMPARED and the
    prefixes in `skip` left out), and the loss pair."""
    out = []
    for x, y in zip(a, b):
        worst, where = 0.0, ""
        for k, v in x.items():
            if k in ("step", "stage") or k.startswith((*NOT_COMPARED, *skip)) or not isinstance(v, (int, float)):
                continue
            w = y.get(k)
            if not isinstance(w, (int, float)):
                continue
            d = abs(v - w) / max(1.0, abs(w))
            if d > worst:
                worst, where = d, k
        out.append({"step": x.get("step"), "max_rel_diff": worst, "where": where, "loss_2gpu": x.get("loss"),
                    "loss_1gpu": y.get("loss"), "loss_abs_diff": abs((x.get("loss") or 0) - (y.get("loss") or 0)),
                    "mismatch_max_abs_2gpu": x.get("mismatch/max_abs"),
                    "mismatch_max_abs_1gpu": y.get("mismatch/max_abs")})
    return {"steps": out, "n_2gpu": len(a), "n_1gpu": len(b)}


def weight_diff(a: Path, b: Path) -> dict:
    from safetensors.torch import load_file

    def load(folder):
        t = {}
        for f in sorted(folder.glob("*.safetensors")):
            t.update(load_file(str(f)))
        return t
    if not a.exists() or not b.exists():
        return {"error": f"missing {a if not a.exists() else b}"}
    x, y = load(a), load(b)
    if sorted(x) != sorted(y):
        return {"error": f"different keys: {sorted(set(x) ^ set(y))[:5]}"}
    mx, n_diff, n = 0.0, 0, 0
    for k in x:
        d = (x[k].double() - y[k].double()).abs()
        mx = max(mx, float(d.max()))
        n_diff += int((d > 0).sum())
        n += d.numel()
    return {"max_abs": mx, "elements_differing": n_diff, "elements": n, "dtype": str(next(iter(x.values())).dtype)}


# ------------------------------------------------------------------ phases
def phase_env(out: Path, work: Path) -> dict:
    import torch

    def sh(*argv):
        try:
            return subprocess.run(argv, capture_output=True, text=True).stdout
        except OSError as e:
            return repr(e)
    smi, topo = sh("nvidia-smi"), sh("nvidia-smi", "topo", "-m")
    env = {k: v for k, v in os.environ.items() if any(s in k for s in ("NCCL", "NVLS", "MULTICAST", "NVSHMEM", "SYMM"))}
    import transformers
    import triton
    info = {"device_count": torch.cuda.device_count(), "names": [torch.cuda.get_device_name(i)
                                                                 for i in range(torch.cuda.device_count())],
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None, "env": env, "nvidia_smi": smi, "topo": topo}
    print(smi)
    print(topo)
    print(json.dumps({k: v for k, v in info.items() if k not in ("nvidia_smi", "topo")}, indent=1))
    (out / "bench_multi_gpu_env.json").write_text(json.dumps(info, indent=1))
    return info


def phase_run(out: Path, work: Path, args) -> dict:
    J = Jobs(work, out, "run")
    sft = recipe(work, "sft", "sft", dtype="float32", save_final=True)
    grpo_x = recipe(work, "grpo_exact", "grpo", numerics="exact", prompts=8, group=4, new=64, save_final=True)
    grpo_f = recipe(work, "grpo_fast", "grpo", numerics="fast", prompts=8, group=4, new=64)
    J.run("dpo_2gpu", J.argv("dpo", sft, work / "dpo2", 2), timeout=120)
    # one-GPU references side by side (one per GPU), then the 2-GPU runs
    J.wait(J.start("sft_1gpu", J.argv("sft", sft, work / "sft1", 1), gpu="0"),
           J.start("grpo_exact_1gpu", J.argv("grpo", grpo_x, work / "grpox1", 1), gpu="1"))
    J.run("sft_2gpu", J.argv("sft", sft, work / "sft2", 2))
    J.run("grpo_exact_2gpu", J.argv("grpo", grpo_x, work / "grpox2", 2))
    J.run("grpo_fast_2gpu", J.argv("grpo", grpo_f, work / "grpof2", 2))
    eq = {
        "sft_fp32": {**metric_diff(metrics(work / "sft2", "sft"), metrics(work / "sft1", "sft")),
                     "weights": weight_diff(work / "sft2" / "final", work / "sft1" / "final")},
        "grpo_exact_bf16": {**metric_diff(metrics(work / "grpox2", "grpo"), metrics(work / "grpox1", "grpo")),
                            "weights": weight_diff(work / "grpox2" / "final", work / "grpox1" / "final")},
        "grpo_fast_2gpu_rows": metrics(work / "grpof2", "grpo"),
    }
    J.finish({"equivalence": eq})
    print("\n| job | rc | wall s |\n|---|---|---|")
    for r in J.results.values():
        print(f"| {r['name']} | {r['rc']} | {r['wall_s']} |")
    for k in ("sft_fp32", "grpo_exact_bf16"):
        print(f"\n{k}: weights {eq[k]['weights']}")
        print("| step | loss 1 GPU | loss 2 GPU | |dloss| | max rel metric diff (which) | mismatch max 1 / 2 |")
        print("|---|---|---|---|---|---|")
        for s in eq[k]["steps"]:
            print(f"| {s['step']} | {s['loss_1gpu']} | {s['loss_2gpu']} | {s['loss_abs_diff']:.2e} | "
                  f"{s['max_rel_diff']:.2e} ({s['where']}) | {s['mismatch_max_abs_1gpu']} / {s['mismatch_max_abs_2gpu']} |")
    for k in ("dpo_2gpu",):
        print(f"{k}: rc {J.results[k]['rc']}: {J.results[k]['errors'][:1]}")
    return eq


def phase_kinds(out: Path, work: Path, args) -> dict:
    """PPO, LoRA GRPO, LoRA stream mode and an agent: 1 GPU vs 2 GPUs (the module docstring's `kinds`)."""
    J = Jobs(work, out, "kinds")
    ppo = recipe(work, "ppo_exact", "ppo", numerics="exact", prompts=8, group=4, new=64, save_final=True)
    lora = recipe(work, "lora_exact", "grpo", numerics="exact", prompts=8, group=4, new=64, save_final=True,
                  model={"lora": {"rank": 16}}, optim={"lr": 1e-4})
    stream = recipe(work, "lora_stream", "grpo", numerics="exact", prompts=8, group=4, new=64, save_final=True,
                    model={"lora": {"rank": 16}}, optim={"lr": 1e-4}, grpo={"overlap": "stream"})
    agent = recipe(work, "agent_exact", "grpo", numerics="exact", prompts=8, group=4, new=64, save_final=True,
                   model={"tokenizer": str(work / "tok_chat")},
                   rollout={"agent": f"{work}/agent.py:twice", "max_turn_tokens": 64, "max_total_tokens": 512})
    fresh = "--overwrite"  # a rerun in the same --work replaces its run folders
    J.wait(J.start("ppo_1gpu", J.argv("ppo", ppo, work / "ppo1", 1, fresh), gpu="0", timeout=args.job_timeout),
           J.start("lora_1gpu", J.argv("grpo", lora, work / "lora1", 1, fresh), gpu="1", timeout=args.job_timeout))
    J.wait(J.start("stream_1gpu", J.argv("grpo", stream, work / "stream1", 1, fresh), gpu="0", timeout=args.job_timeout),
           J.start("agent_1gpu", J.argv("grpo", agent, work / "agent1", 1, fresh), gpu="1", timeout=args.job_timeout))
    n = args.kinds_gpus  # the "2gpu" jobs and folders keep their names at any N
    for run, cmd, cfg in (("ppo", "ppo", ppo), ("lora", "grpo", lora), ("stream", "grpo", stream),
                          ("agent", "grpo", agent)):
        J.run(f"{run}_2gpu", J.argv(cmd, cfg, work / f"{run}2", n, fresh), timeout=args.job_timeout)
    eq = {name: {**metric_diff(metrics(work / f"{run}2", stage), metrics(work / f"{run}1", stage)),
                 "weights": weight_diff(work / f"{run}2" / "final", work / f"{run}1" / "final")}
          for name, run, stage in (("ppo_exact_bf16", "ppo", "ppo"), ("lora_grpo_exact_bf16", "lora", "grpo"),
                                   ("lora_stream_exact_bf16", "stream", "grpo"), ("agent_grpo_exact_bf16", "agent", "grpo"))}
    J.finish({"equivalence": eq, "gpus": n})
    print(f"\n1 GPU vs {n} GPUs\n| job | rc | wall s |\n|---|---|---|")
    for r in J.results.values():
        print(f"| {r['name']} | {r['rc']} | {r['wall_s']} |")
    for k, e in eq.items():
        print(f"\n{k}: final weights {e['weights']}")
        print(f"| step | loss 1 GPU | loss {n} GPUs | max rel metric diff (which) | mismatch max 1 / {n} |")
        print("|---|---|---|---|---|")
        for s in e["steps"]:
            print(f"| {s['step']} | {s['loss_1gpu']} | {s['loss_2gpu']} | {s['max_rel_diff']:.2e} ({s['where']}) | "
                  f"{s['mismatch_max_abs_1gpu']} / {s['mismatch_max_abs_2gpu']} |")
    return eq


# moe/aux_loss, moe/z_loss: share-weighted means over each rank's micro-batches, so another
# split of the batch gives other values by design (rlfuse.model.layers.moe.RouterLoss); their
# coefficients are 0 in these runs, so they do not enter the gradient
ROUTER_LOSSES = ("moe/aux_loss", "moe/z_loss")


def phase_moe(out: Path, work: Path, args) -> dict:
    """Full fine-tuning GRPO of an MoE shape under FSDP2 on each of --moe-gpus GPU counts
    (the module docstring's `moe`), compared with the 1-GPU run of this call or of an
    earlier call in the same --work (so `--moe-gpus 1 2` then `--moe-gpus 4` fit two device
    calls). model.init keyed: each rank draws only its shards; every run starts from the
    same weights."""
    J = Jobs(work, out, "moe")
    cfg = recipe(work, "moe_exact", "grpo", shape=args.moe_shape, numerics="exact", prompts=8, group=4, new=64,
                 save_final=True, model={"init": "keyed"}, engine={"numerics": "exact"})
    for n in args.moe_gpus:  # --overwrite: a rerun in the same --work replaces its run folder
        J.run(f"moe_{n}gpu", J.argv("grpo", cfg, work / f"moe{n}", n, "--overwrite"), gpu="0" if n == 1 else None,
              timeout=args.job_timeout)
    one = metrics(work / "moe1", "grpo")
    res = {"shape": args.moe_shape, "runs": {}}
    for n in sorted({*args.moe_gpus, *(int(d.name[3:]) for d in work.glob("moe[0-9]*") if metrics(d, "grpo"))}):
        rows = metrics(work / f"moe{n}", "grpo")
        job = J.results.get(f"moe_{n}gpu", {"rc": "earlier call", "errors": []})
        r = {"rc": job["rc"], "errors": job["errors"],
             "steps": [{k: row.get(k) for k in ("step", "loss", "time/step", "time/generate", "time/train",
                                               "memory/peak_mb", "mismatch/max_abs", "mismatch/full_max_abs",
                                               "moe/routing_mismatch", "moe/load_max")} for row in rows],
             "memory": {k: v for k, v in (rows[-1] if rows else {}).items() if k.startswith("memory/")}}
        if n > 1 and one:
            r["vs_1gpu"] = {**metric_diff(rows, one, skip=ROUTER_LOSSES),
                            "weights": weight_diff(work / f"moe{n}" / "final", work / "moe1" / "final")}
        res["runs"][n] = r
    J.finish({"moe": res})
    print(f"\nMoE full fine-tuning GRPO, shape {args.moe_shape}, exact numerics\n| job | rc | wall s |\n|---|---|---|")
    for r in J.results.values():
        print(f"| {r['name']} | {r['rc']} | {r['wall_s']} |")
    print("\n| GPUs | step | loss | step s | peak MiB (fullest GPU) | mismatch max | routing mismatch | "
          "max rel metric diff vs 1 GPU (which) |\n|---|---|---|---|---|---|---|---|")
    for n, r in res["runs"].items():
        diffs = {s["step"]: s for s in r.get("vs_1gpu", {}).get("steps", [])}
        for st in r["steps"]:
            d = diffs.get(st["step"])
            dtxt = f"{d['max_rel_diff']:.2e} ({d['where']})" if d else "-"
            print(f"| {n} | {st['step']} | {st['loss']} | {st['time/step']} | {st['memory/peak_mb']} | "
                  f"{st['mismatch/max_abs']} | {st['moe/routing_mismatch']} | {dtxt} |")
    for n, r in res["runs"].items():
        if "vs_1gpu" in r:
            print(f"{n} GPUs vs 1: final weights {r['vs_1gpu']['weights']}")
        print(f"{n} GPU(s) memory (MiB, fullest rank): {r['memory']}")
    return res


def summarize_scale(rows: list[dict], gpus: int, per_gpu_prompts: int, group: int) -> dict:
    timed = [r for r in rows if r.get("step", 0) > 1] or rows[1:]  # step 1 captures graphs and compiles
    mean = lambda k: sum(r.get(k, 0.0) for r in timed) / max(len(timed), 1)  # noqa: E731
    seqs = per_gpu_prompts * group * gpus
    new_tokens = mean("completion_len/mean") * seqs
    return {"gpus": gpus, "steps_timed": [r.get("step") for r in timed], "generate_s": mean("time/generate"),
            "train_s": mean("time/train"), "step_s": mean("time/step"), "completion_len": mean("completion_len/mean"),
            "rollout_tok_s_total": new_tokens / max(mean("time/generate"), 1e-9),
            "rollout_tok_s_per_gpu": new_tokens / max(mean("time/generate"), 1e-9) / gpus,
            "peak_mib": max((r.get("memory/peak_mb", 0.0) for r in rows), default=0.0),
            **({k: rows[-1][k] for k in rows[-1] if k.startswith("memory/")} if rows else {})}


def kv_pool_gib(shape: str, blocks: int) -> float:
    """Bytes of `blocks` KV blocks of 16 tokens: layers x (K, V) x kv heads x head_dim x bf16."""
    sh = SHAPES[shape] | COMMON_SHAPE
    return blocks * 16 * sh["num_hidden_layers"] * 2 * sh["num_key_value_heads"] * sh["head_dim"] * 2 / 2**30


def phase_scale(out: Path, work: Path, args) -> dict:
    J = Jobs(work, out, "scale")
    table = []
    for run in args.scale_runs:
        shape, gpus = run.split(":")
        gpus = int(gpus)
        name = f"grpo_{shape}_{gpus}gpu"
        # 64 sequences x (128 + 1024) tokens = 4608 blocks; a fixed pool makes the KV bytes known
        blocks = 4800
        cfg = recipe(work, name, "grpo", shape=shape, steps=args.scale_steps, prompts=8 * gpus, group=8, new=1024,
                     max_seqs=64, kv_blocks=blocks)
        r = J.run(name, J.argv("grpo", cfg, work / name, gpus), gpu=None if gpus > 1 else "0",
                  timeout=args.job_timeout)
        s = {"shape": shape, "rc": r["rc"], "wall_s": r["wall_s"], "errors": r["errors"],
             **summarize_scale(metrics(work / name, "grpo"), gpus, 8, 8), "kv_gib": kv_pool_gib(shape, blocks)}
        table.append(s)
        print(json.dumps(s), flush=True)
    for s in table:
        one = next((t for t in table if t["shape"] == s["shape"] and t["gpus"] == 1 and t["rc"] == 0), None)
        s["efficiency"] = (one["step_s"] / s["step_s"]) if one and s["rc"] == 0 and s["step_s"] else None
    J.finish({"table": table})
    print("\n| shape | GPUs | rc | generate s | train s | step s | rollout tok/s total | per GPU | efficiency | "
          "peak MiB | KV GiB | params/grads/optim/gathered MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in table:
        mem = "/".join(f"{s.get(f'memory/{k}_mib', float('nan')):.0f}" for k in ("params", "grads", "optimizer", "gathered"))
        eff = f"{s['efficiency']:.3f}" if s.get("efficiency") else "-"
        print(f"| {s['shape']} | {s['gpus']} | {s['rc']} | {s['generate_s']:.2f} | {s['train_s']:.2f} | "
              f"{s['step_s']:.2f} | {s['rollout_tok_s_total']:.0f} | {s['rollout_tok_s_per_gpu']:.0f} | {eff} | "
              f"{s['peak_mib']:.0f} | {s['kv_gib']:.2f} | {mem} |")
    return {"table": table}


def resume_from(src: Path, dst: Path, step: int) -> None:
    """A run folder holding `src`'s step checkpoint and metrics, to be continued with --resume."""
    name = f"step_{step:06d}"
    shutil.rmtree(dst, ignore_errors=True)  # a rerun in the same --work starts from the copy again
    if (src / "checkpoints" / name).exists():
        shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
        for f in ("metrics.jsonl", "config.yaml", "run.json"):
            if (src / f).exists():
                shutil.copy(src / f, dst / f)


def phase_faults(out: Path, work: Path, args) -> dict:
    J = Jobs(work, out, "faults")
    res = {}
    try:
        # resume: 4 steps uninterrupted (checkpoint at step 2), then from its step-2 checkpoint
        # --resume on 2 GPUs (same N: bitwise expected) and on 1 GPU (2 -> 1 resharding)
        full = recipe(work, "res_full", "grpo", numerics="exact", steps=4, prompts=8, group=4, new=64, ckpt_every=2)
        J.run("resume_full_2gpu", J.argv("grpo", full, work / "res_full", 2))
        resume_from(work / "res_full", work / "res_2to2", 2)
        resume_from(work / "res_full", work / "res_2to1", 2)
        J.run("resume_2to2", J.argv("grpo", full, work / "res_2to2", 2, "--resume"))
        J.run("resume_2to1", J.argv("grpo", full, work / "res_2to1", 1, "--resume"), gpu="0")
        for k in ("res_2to2", "res_2to1"):
            res[k] = {**metric_diff(metrics(work / k, "grpo"), metrics(work / "res_full", "grpo")),
                      "weights": weight_diff(work / k / "final", work / "res_full" / "final")}
        for mode in () if args.resume_only else ("raise", "kill"):
            rw = [{"name": f"{work}/reward.py:faulty", "kwargs": {"mode": mode, "rank": 1, "call": 2}}]
            cfg = recipe(work, f"fault_{mode}", "grpo", rewards=rw, steps=4, prompts=8, group=4, new=64)
            r = J.run(f"fault_{mode}", J.argv("grpo", cfg, work / f"fault_{mode}", 2, "--dist-timeout", "60"),
                      timeout=240)
            res[mode] = {"rc": r["rc"], "wall_s": r["wall_s"], "error_lines": r["errors"]}
    finally:
        J.finish({"faults": res})
    print("\n| job | rc | wall s |\n|---|---|---|")
    for r in J.results.values():
        print(f"| {r['name']} | {r['rc']} | {r['wall_s']} |")
    for k in ("raise", "kill"):
        if k in res:
            print(f"fault {k}: {res[k]}")
    for k in ("res_2to2", "res_2to1"):
        if k in res:
            print(f"{k}: weights {res[k]['weights']}; steps " +
                  "; ".join(f"{s['step']}: {s['max_rel_diff']:.1e} ({s['where']})" for s in res[k]["steps"]))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phases", nargs="+", choices=("env", "run", "scale", "faults", "kinds", "moe"))
    ap.add_argument("--work", default="/tmp/mgpu", help="run folders and logs (large: final weights)")
    ap.add_argument("--scale-runs", nargs="+", default=["0.6b:1", "0.6b:2"], metavar="SHAPE:GPUS",
                    help=f"GRPO scaling runs, shape one of {sorted(SHAPES)}")
    ap.add_argument("--scale-steps", type=int, default=4, help="GRPO steps per scaling run (step 1 is warm-up)")
    ap.add_argument("--job-timeout", type=float, default=300)
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="start no job later than this many seconds minus 60 after the start (fit a device call)")
    ap.add_argument("--kinds-gpus", type=int, default=2, help="kinds: GPUs of the data-parallel jobs (2 or 4)")
    ap.add_argument("--moe-shape", default="moe-3b", help=f"moe: the MoE shape, one of {sorted(MOE_SHAPES)}")
    ap.add_argument("--moe-gpus", type=int, nargs="+", default=[1, 2],
                    help="moe: the GPU counts to run (1 is the reference; e.g. 1 2, then 4 in a second call)")
    ap.add_argument("--resume-only", action="store_true", help="faults: only the resume jobs (2 -> 2, 2 -> 1)")
    ap.add_argument("--small", action="store_true", help="tiny fp32 model on CPU (gloo): a smoke test of this script")
    args = ap.parse_args()
    SMALL[0] = args.small
    DEADLINE[0] = time.time() + args.budget_s
    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    setup(work)
    for ph in args.phases:
        t0 = time.perf_counter()
        {"env": lambda: phase_env(out, work), "run": lambda: phase_run(out, work, args),
         "scale": lambda: phase_scale(out, work, args), "faults": lambda: phase_faults(out, work, args),
         "kinds": lambda: phase_kinds(out, work, args), "moe": lambda: phase_moe(out, work, args)}[ph]()
        print(f"=== phase {ph}: {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
