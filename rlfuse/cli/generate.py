"""`rlfuse generate`: complete prompts with the built-in engine.

    rlfuse generate MODEL_DIR --prompt "2+2=" --prompt "Hello" --max-tokens 64
    rlfuse generate MODEL_DIR --prompts-file prompts.txt --chat --temperature 0.7 --n 4 --json
    rlfuse generate BASE_MODEL_DIR --adapter PEFT_ADAPTER_DIR --prompt "2+2="
One completion per line (text), or with --json one JSON object per completion: prompt
index, sample index, output ids, text, finish reason, sum of log-probs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlfuse.api import load_model
from rlfuse.cli.common import add_engine_arguments, engine_config, fail, setup_threads
from rlfuse.engine import LLM, SamplingParams

HELP = "generate completions for prompts with the built-in engine"


def add_arguments(p) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.epilog = ("output: one line per completion, `[P.S] (REASON) TEXT`: prompt P, sample S of it, and why it "
                "ended: stop (the end-of-sequence token or a --stop string) or length (--max-tokens reached)")
    p.add_argument("model", help="HF model folder (config.json, safetensors, tokenizer.json), a training "
                                 "checkpoint folder (either layout, one-process or sharded) or a run folder "
                                 "(its final/, else its latest checkpoint)")
    p.add_argument("--adapter", default=None, help="a PEFT LoRA adapter folder (adapter_config.json + "
                                                   "adapter_model.safetensors) applied to MODEL, unmerged")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="most new tokens per completion")
    p.add_argument("--min-tokens", type=int, default=0, help="fewest new tokens before a stop can end a completion")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens holding "
                                                             "this probability (1: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than min-p times the most "
                                                            "likely one (0: none)")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed gives the same completions)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_arguments(p)
    p.add_argument("--json", action="store_true", help="one JSON object per completion")


def run(args) -> int:
    try:
        setup_threads(args.threads)
    except ValueError as e:
        return fail(e)
    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += [line.rstrip("\n") for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    if not prompts:
        return fail(ValueError("no prompts: give --prompt TEXT or --prompts-file FILE"))
    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                                seed=args.seed, stop=tuple(args.stop))
        cfg = engine_config(args)
        model, tok = load_model(args.model, device=args.device or "auto", dtype=args.dtype, device_option="--device",
                                adapter=args.adapter or None)
        if args.chat:
            prompts = [tok.chat_prompt_ids([{"role": "user", "content": q}]) for q in prompts]
        llm = LLM(model, tok, cfg)
        outs = llm.generate(prompts, params)
    except ValueError as e:
        return fail(e)
    if not args.json:  # the legend of the lines below, on stderr so that stdout stays the completions
        print("# [prompt.sample] (stop: end of sequence or a --stop string | length: --max-tokens reached) "
              "completion", file=sys.stderr)
    for j, o in enumerate(outs):
        if args.json:
            print(json.dumps(dict(prompt=j // args.n, sample=o.index, output_token_ids=o.output_token_ids,
                                  text=o.text, finish_reason=o.finish_reason,
                                  logprob_sum=float(o.logprobs.sum()))))
        else:
            print(f"[{j // args.n}.{o.index}] ({o.finish_reason}) {o.text}")
    return 0
