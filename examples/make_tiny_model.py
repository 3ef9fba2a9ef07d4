"""Write a tiny random Qwen3-style model with a character tokenizer as an HF folder.

For trying the whole pipeline on a CPU in a minute, no download: the tokenizer's
alphabet is every character of the given JSONL files' text fields, so the model can
read and write exactly that data. A real run starts from a pretrained HF folder instead
(docs/getting-started.md).

    python examples/make_tiny_model.py runs/tiny-model \
        --data examples/data/reverse_train.jsonl examples/data/reverse_eval.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlfuse.model import save_model
from rlfuse.run.build import build_model, char_tokenizer, pick_device
from rlfuse.run.config.sections import ModelSpec

TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=64)
TEXT_FIELDS = ("prompt", "completion", "answer")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="folder to write (config.json, model.safetensors, tokenizer files)")
    ap.add_argument("--data", nargs="+", required=True, help="JSONL files whose characters the tokenizer covers")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    alphabet = set()
    for path in args.data:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            alphabet.update("".join(str(row.get(k, "")) for k in TEXT_FIELDS))
    tokenizer = char_tokenizer("".join(sorted(alphabet)))
    model = build_model(ModelSpec(random_init=TINY), tokenizer, pick_device("cpu"), seed=args.seed)
    save_model(model, args.out)
    tokenizer.save(args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{tokenizer.vocab_size} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
