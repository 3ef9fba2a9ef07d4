"""The Python API end to end: SFT, then GRPO with a reward written in Python, on the same
weights, then generate and save. The same runs as the getting-started walk-through's
commands (docs/getting-started.md), from a script (docs/python-api.md).

    python examples/make_tiny_model.py runs/tiny-model \
        --data examples/data/reverse_train.jsonl examples/data/reverse_eval.jsonl
    python examples/python_api.py runs/tiny-model --out runs/api
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlfuse import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

HERE = Path(__file__).resolve().parent


def reverse_reward(prompts, completions, answer, **columns):
    """TRL's signature: one float per completion; `answer` is the dataset's column."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="an HF model folder (e.g. from examples/make_tiny_model.py)")
    ap.add_argument("--out", default="runs/api", help="folder for the two run folders and the export")
    ap.add_argument("--sft-steps", type=int, default=80)
    ap.add_argument("--grpo-steps", type=int, default=20)
    args = ap.parse_args(argv)
    out = Path(args.out)

    def rows(name):
        return [json.loads(line) for line in (HERE / "data" / name).read_text().splitlines()]
    train, held_out = rows("reverse_train.jsonl"), rows("reverse_eval.jsonl")
    common = {"model": {"dtype": "float32"}, "data": {"max_prompt_len": 32},
              "logging": {"progress": False, "tensorboard": False}}

    sft = SFTTrainer(args.model, train_dataset=train, eval_dataset=held_out, reward_funcs=[reverse_reward],
                     args=SFTConfig(steps=args.sft_steps, batch_size=32, max_seq_len=32),
                     config={**common, "optim": {"lr": 2e-3, "warmup_steps": 10}, "grpo": {"max_new_tokens": 8}},
                     run_dir=out / "sft", overwrite=True)
    summary = sft.train()
    print(f"sft: {summary['steps']} steps, last loss {summary['history'][-1]['loss']:.3f}")

    # the SFT trainer's model, tokenizer and engine: GRPO updates the same tensors in place
    grpo = GRPOTrainer(sft, reward_funcs=[reverse_reward], train_dataset=train, eval_dataset=held_out,
                       args=GRPOConfig(steps=args.grpo_steps, prompts_per_step=16, group_size=8, max_new_tokens=8),
                       config={**common, "optim": {"lr": 1e-4, "schedule": "constant"}},
                       run_dir=out / "grpo", overwrite=True)
    summary = grpo.train()
    first, last = summary["evals"][0], summary["evals"][-1]
    print(f"grpo: held-out reward {first['reward']:.3f} -> {last['reward']:.3f}")
    print("generate:", grpo.generate(["reverse abc:", "reverse dead:"], max_tokens=8))
    print("saved", grpo.save(out / "export"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
