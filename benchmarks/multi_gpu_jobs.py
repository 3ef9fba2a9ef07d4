"""What the multi-GPU benchmarks share (bench_multi_gpu.py, bench_multi_node.py): the generated
work folder (tokenizer, prompts, reward and agent files), the recipes, a job runner that
starts real commands (`python3 -m rlfuse ...` / `torchrun ...`) with a time limit and a
device-call budget, and the comparisons of two runs (per-step metrics, final weights).
`SMALL[0]`: tiny fp32 models on CPU (gloo), the scripts' `--small`; `DEADLINE[0]`: start no
job later than a minute before it (`--budget-s`).
"""

from __future__ import annotations

import json
import os
import random
import signal
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
          "        if mode == 'kill':  # the reward's worker process (user rewards run in one)\n"
          "            os.kill(os.getpid(), signal.SIGKILL)\n"
          "        if mode == 'kill_rank':  # the rank itself: the worker's parent\n"
          "            os.kill(os.getppid(), signal.SIGKILL)\n"
          "        raise RuntimeError(f'injected fault on rank {rank} at reward call {call}')\n"
          "    return even(prompts, completions, completion_ids)\n")
AGENT = ("async def twice(client, row):\n"  # kinds: the second call extends the first (one merged sample)
         "    msgs = [{'role': 'user', 'content': row['prompt']}]\n"
         "    r = await client.chat.completions.create(model='rlfuse-policy', messages=msgs)\n"
         "    msgs += [{'role': 'assistant', 'content': r.choices[0].message.content or ''},\n"
         "             {'role': 'user', 'content': row['prompt'][:16]}]\n"
         "    await client.chat.completions.create(model='rlfuse-policy', messages=msgs)\n"
         "    return None  # the recipe's reward scores the last call's completion\n")
ECHO_ENV = ("from rlfuse.rollout import Step\n"  # kinds2: rollout.env, three turns, letter observations
            "class Echo:\n"
            "    def reset(self, row, *, seed):\n"
            "        self.n = 0\n"
            "        return [{'role': 'user', 'content': row['prompt']}]\n"
            "    def step(self, turn):\n"
            "        self.n += 1\n"
            "        self.last = len(turn.token_ids)\n"
            "        return Step(messages=[{'role': 'tool', 'content': 'abc'[:self.n] * 4}], done=self.n >= 3)\n"
            "    def reward(self):\n"
            "        return self.last / 64\n")
# stream/*: times and gradient slots, per rank by nature (each rank's groups finish in their own order)
NOT_COMPARED = ("time/", "tokens_per_s", "memory/", "stream/", "rollout/agent_wall_s")


# ------------------------------------------------------------------ set-up
def setup(work: Path) -> None:
    """The tokenizer folders, the prompt and preference-pair files, the reward, agent and
    environment files (same seed every time)."""
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
    with open(work / "pairs.jsonl", "w") as f:  # kinds2: DPO (random letters: a random model prefers neither)
        for _ in range(128):
            f.write(json.dumps({"prompt": "".join(rng.choice(letters) for _ in range(128)),
                                "chosen": "".join(rng.choice(letters) for _ in range(64)),
                                "rejected": "".join(rng.choice(letters) for _ in range(64))}) + "\n")
    (work / "reward.py").write_text(REWARD)
    (work / "agent.py").write_text(AGENT)
    (work / "env.py").write_text(ECHO_ENV)


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
        "engine": {"max_num_seqs": 32, "numerics": numerics} if SMALL[0] else {"gpu_memory_fraction": gpu_frac, "numerics": numerics,
                                                              "max_num_seqs": max_seqs}
        | ({"num_kv_blocks": kv_blocks, "max_model_len": 1280} if kv_blocks else {}),
        "logging": {"tensorboard": False, "progress": False},
        "checkpoint": {"every": ckpt_every, "save_final": save_final},
    }
    if kind == "sft":
        cfg["sft"] = {"steps": steps, "batch_size": 8, "micro_batch_tokens": 512}
    elif kind == "dpo":  # pairs.jsonl; `prompts`: the pairs of a step
        cfg["data"]["train"] = str(work / "pairs.jsonl")
        cfg["dpo"] = {"steps": steps, "batch_size": prompts, "micro_batch_tokens": 4096, "beta": 0.1}
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

    def script_argv(self, script: Path, gpus: int, *args: str) -> list[str]:
        """A Python script (not the CLI) on `gpus` processes: torchrun above 1."""
        base = ["torchrun", "--standalone", "--nproc_per_node", str(gpus)] if gpus > 1 else [sys.executable]
        return base + [str(script), *args]

    def start(self, name: str, argv: list[str], *, gpu: str | None = None, timeout: float = 300):
        left = DEADLINE[0] - time.time()
        if left < 60:  # --budget-s: record the job as not run rather than be killed mid-job
            return (name, argv, None, None, time.perf_counter(), 0)
        timeout = min(timeout, left)
        env = dict(os.environ)  # the machine's NCCL / multicast settings pass through unchanged
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
        env["PYTHONUNBUFFERED"] = "1"
        if gpu is not None:  # indices ("0" or "2,3") among the GPUs this script was given, not physical ids
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible.split(",")[int(i)] for i in gpu.split(",")) \
                if visible else gpu
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
                # torchrun's workers run in their own sessions: a SIGKILL of the agent's group
                # orphans them (seen on 4 GPUs); SIGTERM lets the agent stop its workers first
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
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


def print_equivalence(J: Jobs, eq: dict, n: int, extra: dict | None = None) -> None:
    """The 1-vs-N tables of the kinds phases: every job's rc and wall, then per run its final
    weight difference (and `extra[name]`, a line), per step the losses, the largest relative
    metric difference (which metric) and the exact mismatch on 1 and N GPUs."""
    print(f"\n1 GPU vs {n} GPUs\n| job | rc | wall s |\n|---|---|---|")
    for r in J.results.values():
        print(f"| {r['name']} | {r['rc']} | {r['wall_s']} |")
    for k, e in eq.items():
        print(f"\n{k}: final weights {e['weights']}" + (f"; {extra[k]}" if extra and k in extra else ""))
        print(f"| step | loss 1 GPU | loss {n} GPUs | max rel metric diff (which) | mismatch max 1 / {n} |")
        print("|---|---|---|---|---|")
        for s in e["steps"]:
            print(f"| {s['step']} | {s['loss_1gpu']} | {s['loss_2gpu']} | {s['max_rel_diff']:.2e} ({s['where']}) | "
                  f"{s['mismatch_max_abs_1gpu']} / {s['mismatch_max_abs_2gpu']} |")
