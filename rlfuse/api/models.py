"""Opening a trained or downloaded model for inference: `load_model(path)` -> (model, tokenizer).

PATH is an HF model folder (config.json, *.safetensors, tokenizer.json), a training
checkpoint folder (its model/, either layout), or a run folder (its final/, else its latest
complete checkpoint). `rlfuse generate` and `rlfuse serve` open their MODEL with this.
Test: python -m pytest -q tests/test_serve.py
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rlfuse.model import CausalLM
from rlfuse.model.lora_peft import load_peft_adapter
from rlfuse.model.tokenizer import Tokenizer
from rlfuse.run import check_model_folder, check_vocab, list_checkpoints, load_model_folder, merged_folder, pick_device

log = logging.getLogger(__name__)


def resolve_model_folder(path: str | Path, what: str = "MODEL") -> Path:
    """The folder holding the model's config.json (a sharded checkpoint: its root, with
    dcp/), for an HF folder, a checkpoint folder or a run folder."""
    check_model_folder(str(path), what)
    p = Path(path)
    for q in (p, p / "final", p / "adapter"):
        if (q / "adapter_config.json").exists() and not (p / "config.json").exists():
            merged = merged_folder(q)
            raise ValueError(f"{what}: {q} is a LoRA adapter (a PEFT folder), not a model: give the base model "
                             f"folder and the adapter with --adapter {q}"
                             + (f", or the merged model {merged}" if (merged / "config.json").exists() else ""))
    if (p / "config.json").exists():
        return p
    if (p / "model" / "config.json").exists():  # a checkpoint
        return p / "model"
    if (p / "final" / "config.json").exists():  # a run: its final weights
        log.info("%s: the run's final weights %s", p, p / "final")
        return p / "final"
    ckpts = list_checkpoints(p)
    if ckpts:  # a run without final/: its latest complete checkpoint
        log.info("%s: no final/; the run's latest checkpoint %s", p, ckpts[-1])
        return resolve_model_folder(ckpts[-1], what)
    raise ValueError(f"{what}: {p} has no config.json; expected an HF model folder, a checkpoint folder "
                     "(model/config.json) or a run folder (final/ or checkpoints/step_*)")


def load_model(path: str | Path, *, device: str | torch.device = "auto", dtype: str | torch.dtype | None = None,
               what: str = "MODEL", device_option: str = "device",
               adapter: str | Path | None = None) -> tuple[CausalLM, Tokenizer]:
    """(model in eval mode, its tokenizer) from PATH (see the module docstring). dtype
    defaults to the checkpoint's; device "auto" is CUDA when there is one (a device this
    machine lacks is a ValueError naming `device_option`). The config's vocab_size must
    cover every id the tokenizer can produce. `adapter`: a PEFT LoRA folder applied to the
    model, unmerged."""
    dev = pick_device(device, device_option) if isinstance(device, str) else device
    folder = resolve_model_folder(path, what)
    # the model first: a wrong folder is reported as such, not as a missing tokenizer
    model = load_model_folder(folder, device=dev, dtype=dtype).eval()
    tok = Tokenizer.from_pretrained(folder)
    check_vocab(model.config.vocab_size, tok, str(folder / "config.json"))
    if adapter is not None:
        load_peft_adapter(model, adapter)
    return model, tok
