"""Training-state memory of LoRA against the full fine-tune, computed from the Qwen3 shapes
(no weights, no GPU: the models are built on the meta device). An estimate, not a
measurement: it counts the bytes the optimizer state and gradients take by formula
(`rlfuse.model.lora.lora_memory`); activations, the KV pool and allocator slack come on top.

    PYTHONPATH=$PWD python benchmarks/lora_memory.py [--rank 16]
Prints the markdown table docs/lora.md shows.
"""

import argparse

import torch

from rlfuse.engine.benchmark import QWEN3_SHAPES
from rlfuse.model import CausalLM, ModelConfig
from rlfuse.model.lora import LoRAConfig, attach_lora, lora_memory

GIB = 2**30


def row(name: str, shape: dict, rank: int) -> str:
    cfg = ModelConfig(**shape)
    with torch.device("meta"):
        model = CausalLM(cfg).to(torch.bfloat16)
    weights = sum(p.numel() for p in model.parameters()) * 2
    attach_lora(model, LoRAConfig(rank=rank))
    m = lora_memory(model)
    n = m["lora/frozen_params"]
    # full fine-tune, bf16 weights: weights 2 + gradient 2 + fp32 master 4 + Adam moments 8 bytes a parameter
    full = 16 * n
    lora = full - m["lora/saved_train_state_gib"] * GIB
    return (f"| {name} | {n / 1e9:.2f} B | {m['lora/trainable_params'] / 1e6:.1f} M | {full / GIB:.1f} GiB | "
            f"{lora / GIB:.1f} GiB | {weights / GIB:.1f} GiB |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    print(f"| shape | parameters | LoRA rank {args.rank} (all linear) | full FT: weights + training state "
          f"(estimate) | LoRA: weights + training state (estimate) | bf16 weights alone |")
    print("|---|---|---|---|---|---|")
    for name, shape in QWEN3_SHAPES.items():
        print(row(f"Qwen3-{name.upper()}", shape, args.rank))


if __name__ == "__main__":
    main()
