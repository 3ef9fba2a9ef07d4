"""`rlfuse generate`: complete prompts with the built-in engine.

    rlfuse generate MODEL_DIR --prompt "2+2=" --prompt "Hello" --max-tokens 64
    rlfuse generate MODEL_DIR --prompts-file prompts.txt --chat --temperature 0.7 --n 4 --json
One completion per line (text), or with --json one JSON object per completion: prompt
index, sample index, output ids, text, finish reason, sum of log-probs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlfuse.cli.common import fail
from rlfuse.engine import LLM, EngineConfig, SamplingParams
from rlfuse.model.tokenizer import Tokenizer
from rlfuse.run import check_model_folder, load_model_folder

HELP = "generate completions for prompts with the built-in engine"


def add_arguments(p) -> None:
    p.add_argument("model", help="HF model folder (config.json, safetensors, tokenizer.json) or a training "
                                 "checkpoint folder (either layout, one-process or sharded)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="model dtype (default: the checkpoint's)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-fraction", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--json", action="store_true", help="one JSON object per completion")


def run(args) -> int:
    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += [line.rstrip("\n") for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    if not prompts:
        return fail(ValueError("no prompts: give --prompt TEXT or --prompts-file FILE"))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                                seed=args.seed, stop=tuple(args.stop))
        cfg = EngineConfig(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                           gpu_memory_fraction=args.gpu_memory_fraction, enforce_eager=args.enforce_eager)
        check_model_folder(args.model, "MODEL")
        folder = Path(args.model)
        folder = folder / "model" if (folder / "model" / "config.json").exists() else folder  # a checkpoint
        # the model first: a missing or wrong folder is reported as such, not as a missing tokenizer
        model = load_model_folder(folder, device=device, dtype=args.dtype).eval()
        tok = Tokenizer.from_pretrained(folder)
        if args.chat:
            prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=True) for q in prompts]
        llm = LLM(model, tok, cfg)
        outs = llm.generate(prompts, params)
    except ValueError as e:
        return fail(e)
    for j, o in enumerate(outs):
        if args.json:
            print(json.dumps(dict(prompt=j // args.n, sample=o.index, output_token_ids=o.output_token_ids,
                                  text=o.text, finish_reason=o.finish_reason,
                                  logprob_sum=float(o.logprobs.sum()))))
        else:
            print(f"[{j // args.n}.{o.index}] ({o.finish_reason}) {o.text}")
    return 0
