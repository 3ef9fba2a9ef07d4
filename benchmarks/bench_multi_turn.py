"""Multi-turn rollouts vs single-turn on the same token budget (Qwen3-0.6B shape, GPU).

A random Qwen3-0.6B-shaped model (bf16) plays 64 episodes (8 prompts x 8) of `turns` model
turns of `turn_tokens` tokens each (a random model almost never emits EOS); after every
turn a tool sleeps `tool_ms` and answers with a ~30-token observation. The single-turn row
generates 64 completions of turns * turn_tokens tokens. Reported: model tokens/s, the
engine's idle share while waiting for tools (rollout/engine_idle_frac), the prefix-cache
share of continuation prompts, and, in exact numerics, the rollout-vs-trainer mismatch over
every model token of every turn (rlfuse.rollout.exactness.compare), and each multi-turn
row's tokens/s over the single-turn row's (issue 38's target: >= 0.85x with 50 ms tools).

    OUT=out python benchmarks/bench_multi_turn.py          # GPU
    OUT=out python benchmarks/bench_multi_turn.py --env-workers 8   # the former default: tools queue
    python benchmarks/bench_multi_turn.py --small          # CPU smoke test (tiny model)
Writes $OUT/bench_multi_turn.json and $OUT/bench_multi_turn.md (a table for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import string
import time
from pathlib import Path

import torch

from rlfuse.engine import LLM, EngineConfig, SamplingParams
from rlfuse.engine.benchmark import QWEN3_06B
from rlfuse.model import CausalLM, ModelConfig
from rlfuse.rollout import ChatRenderer, Step, char_chat_tokenizer, run_episodes
from rlfuse.rollout.exactness import compare
from rlfuse.run.config import RolloutConfig

# the engine benchmark's Qwen3-0.6B shape; an 8K context is plenty for 4 turns of 256 tokens
SHAPE = QWEN3_06B | dict(max_position_embeddings=8192)
SMALL = dict(model_type="qwen3", qk_norm=True, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024,
             tie_word_embeddings=True)


class SleepTool:
    """Sleeps `tool_ms`, answers with a fixed ~30-character observation, ends after `turns` turns."""

    def __init__(self, turns: int, tool_ms: float):
        self.turns, self.delay = turns, tool_ms / 1000

    def reset(self, row, *, seed):
        self.n = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn):
        self.n += 1
        time.sleep(self.delay)
        return Step(messages=[{"role": "tool", "content": f"result {self.n}: 12345 * 678 = 8369910"}],
                    done=self.n >= self.turns)


def run(small: bool, turns: int, turn_tokens: int, tool_ms_list, out: Path, *, env_workers: int = 0,
        prompts: int | None = None, group: int | None = None, numerics_list=("fast", "exact")) -> list[dict]:
    dev = "cpu" if small else "cuda"
    model = CausalLM(ModelConfig(**(SMALL if small else SHAPE)))
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
    model = model.to(device=dev, dtype=torch.float32 if small else torch.bfloat16)
    tok = char_chat_tokenizer(string.printable)
    rows = [{"prompt": f"Problem {i}: multiply the numbers and explain."}
            for i in range(prompts or (2 if small else 8))]
    G = group or (2 if small else 8)
    cfg = RolloutConfig(max_turns=turns, max_turn_tokens=turn_tokens, max_total_tokens=turns * (turn_tokens + 64),
                        env_workers=env_workers)
    results = []
    for numerics in numerics_list:
        llm = LLM(model, tok, EngineConfig(numerics=numerics, max_model_len=cfg.max_total_tokens + 128))
        renderer = ChatRenderer(tok)
        prompt_ids = [renderer.start([{"role": "user", "content": r["prompt"]}])[1] for r in rows]
        llm.generate(prompt_ids[:1], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up (graphs, compile)
        t0 = time.perf_counter()
        outs = llm.generate(prompt_ids, SamplingParams(n=G, temperature=1.0, max_tokens=turns * turn_tokens,
                                                       ignore_eos=True, seed=0))
        dt = time.perf_counter() - t0
        n = sum(len(o.output_token_ids) for o in outs)
        single = n / dt
        results.append({"numerics": numerics, "mode": "single-turn", "tool_ms": None, "model_tokens": n,
                        "seconds": dt, "tokens_per_s": single, "vs_single_turn": 1.0})
        for tool_ms in tool_ms_list:
            t0 = time.perf_counter()
            eps, m = run_episodes(llm, renderer, lambda ms=tool_ms: SleepTool(turns, ms), rows, cfg=cfg,
                                  group_size=G, sampling=dict(temperature=1.0), seed=0)
            dt = time.perf_counter() - t0
            n = sum(sum(e.loss_mask) for e in eps)
            row = {"numerics": numerics, "mode": f"{turns} turns", "tool_ms": tool_ms, "model_tokens": n,
                   "seconds": dt, "tokens_per_s": n / dt, "vs_single_turn": n / dt / single,
                   "env_workers": env_workers or "auto", "engine_idle_frac": m["rollout/engine_idle_frac"],
                   "continuation_cached_frac": m["rollout/continuation_cached_frac"],
                   "turns_mean": m["rollout/turns_mean"]}
            if numerics == "exact" and tool_ms == tool_ms_list[-1]:
                llm.sleep()
                t, r, _ = compare(model, eps, numerics="exact", micro_batch_tokens=16384)
                row["mismatch_max_abs"] = float((t - r).abs().max())
                row["bitwise_frac"] = float((t == r).float().mean())
                llm.wake()
            results.append(row)
            print(json.dumps(row), flush=True)
        llm.sleep()
        del llm
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_multi_turn.json").write_text(json.dumps(results, indent=2))
    lines = ["| numerics | rollout | tool sleep | env workers | model tokens | s | tok/s | vs single-turn | engine idle | "
             "cached continuation | exact mismatch |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        sleep = "" if r["tool_ms"] is None else f"{r['tool_ms']:g} ms"
        lines.append(f"| {r['numerics']} | {r['mode']} | {sleep} | {r.get('env_workers', '')} "
                     f"| {r['model_tokens']} | {r['seconds']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['vs_single_turn']:.2f}x | "
                     f"{r.get('engine_idle_frac', float('nan')):.3f} | {r.get('continuation_cached_frac', float('nan')):.3f} "
                     f"| {r.get('mismatch_max_abs', '')} |")
    (out / "bench_multi_turn.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny model on the CPU (smoke test)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=None, help="tokens per turn (default 256; 8 with --small)")
    ap.add_argument("--tool-ms", type=float, nargs="+", default=[0.0, 50.0])
    ap.add_argument("--env-workers", type=int, default=0,
                    help="rollout.env_workers (default 0: auto, one per episode; 8 was the former default)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts (default 8; 2 with --small)")
    ap.add_argument("--group", type=int, default=None, help="episodes per prompt (default 8; 2 with --small)")
    ap.add_argument("--numerics", nargs="+", default=["fast", "exact"], choices=["fast", "exact"])
    args = ap.parse_args()
    run(args.small, args.turns, args.turn_tokens or (8 if args.small else 256), args.tool_ms,
        Path(os.environ.get("OUT", "out")), env_workers=args.env_workers, prompts=args.prompts, group=args.group,
        numerics_list=args.numerics)


if __name__ == "__main__":
    main()
