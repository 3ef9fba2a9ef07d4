"""`rlfuse eval CONFIG [--checkpoint DIR]`: greedy evaluation on the recipe's eval set.

DIR is an HF model folder or a checkpoint folder (its model/ is used; a sharded
checkpoint's dcp/ is read in this one process); default: the recipe's model.path. A
LoRA run's checkpoint (its adapter/) or final/ (a PEFT folder), or `--adapter DIR`, is
applied to the recipe's base model. Prints the metrics and writes RUN_DIR/eval.json."""

from __future__ import annotations

import json
from pathlib import Path

from rlfuse.cli.common import add_config_arguments, agent_flags, fail, load_run_config, setup_threads
from rlfuse.model.lora_peft import CONFIG_FILE as ADAPTER_CONFIG
from rlfuse.rollout import evaluate
from rlfuse.run import check_model_folder
from rlfuse.run.config import replace
from rlfuse.train import open_session

HELP = "evaluate a checkpoint on a recipe's eval set"


def add_arguments(p):
    add_config_arguments(p, resume=False, uses=("grpo.max_new_tokens",))  # the answers' length
    p.add_argument("--checkpoint", default=None, help="model folder or checkpoint folder to evaluate")
    p.add_argument("--adapter", default=None, help="a PEFT LoRA adapter folder applied to the recipe's model "
                                                   "(or to --checkpoint's), unmerged")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N problems")


def run(args) -> int:
    try:
        cfg = load_run_config(args)
        setup_threads(args.threads)
        adapter = args.adapter
        if args.checkpoint:
            check_model_folder(args.checkpoint, "--checkpoint")
            path = Path(args.checkpoint)
            if (path / "adapter").is_dir() or (path / ADAPTER_CONFIG).is_file():  # a LoRA run's
                if adapter:
                    raise ValueError(f"eval: --checkpoint {path} holds a LoRA adapter already; drop --adapter")
                adapter = str(path / "adapter" if (path / "adapter").is_dir() else path)
            else:
                path = path / "model" if (path / "model" / "config.json").exists() else path
                tok = cfg.model.tokenizer if cfg.model.tokenizer not in ("", "char") else str(path)
                cfg = replace(cfg, **{"model.path": str(path), "model.random_init": None, "model.tokenizer": tok})
        if adapter:
            cfg = replace(cfg, **{"model.lora": {"path": adapter}})
        ses = open_session(cfg, write_config=False, **agent_flags(cfg))
        prompts = ses.eval_prompts()
        if not prompts:
            raise ValueError("eval: the recipe has no eval set (data.eval) and its train set is not a builtin task")
        prompts = prompts[:args.limit] if args.limit else prompts
        res = evaluate(ses.sampler, prompts, ses.rewards(), max_new_tokens=cfg.grpo.max_new_tokens)
    except ValueError as e:
        return fail(e)
    res = {"model": cfg.model.path, **({"adapter": adapter} if adapter else {}), **res}
    out = ses.run_dir / "eval.json"
    out.write_text(json.dumps(res, indent=2))
    print(f"eval of {res['model'] or 'the recipe model'} on {int(res.get('num_problems', len(prompts)))} held-out "
          f"problems (greedy):")
    for k, v in res.items():
        if k not in ("model", "num_problems"):
            print(f"  {k:<24} {v:.4g}" if isinstance(v, float) else f"  {k:<24} {v}")
    print(f"written to {out}")
    return 0
