"""PEFT adapter folders in and out, and the merged HF export.

A PEFT LoRA folder is `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with tensors named
`base_model.model.<module>.lora_A.weight` (r, in) and `...lora_B.weight` (out, r), the
module names being the `transformers` ones, which are ours. So:

    load_peft_adapter(model, folder)        # attach + load A and B
    save_peft_adapter(model, folder)        # PeftModel.from_pretrained(hf_model, folder) loads it
    load_peft_weights(model, folder)        # into adapters attached already (resume)
    save_merged(model, folder)              # an HF folder with W + s B A rounded into W

Only plain LoRA is read: DoRA, adapter biases, modules_to_save, per-module rank or alpha
patterns and per-layer subsets are refused with a ValueError naming the file and field.
The merged export rounds W + s B A (computed in fp32) to the weight's dtype, which loses
part of a small update in bf16: the unmerged adapter is what the engine and the trainer
run, the merged folder is for tools that cannot apply an adapter.
Test: python -m pytest -q tests/test_lora.py
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from rlfuse.model.causal_lm import CausalLM
from rlfuse.model.config import read_json
from rlfuse.model.lora import (
    ALL_LINEAR,
    ATTENTION_TARGETS,
    MLP_TARGETS,
    TARGETS,
    LoRAConfig,
    attach_lora,
    expert_lora_modules,
    lora_config,
    lora_modules,
)
from rlfuse.model.weights import (
    atomic_folder,
    checkpoint_names,
    copy_side_files,
    hf_parameters,
    save_model,
    save_tensors_file,
)

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
EXPERTS_FILE = "rlfuse_expert_adapters.safetensors"
"""MoE models: the per-expert adapters (lora.experts), beside the PEFT files; PEFT ignores it."""
_PREFIX = "base_model.model."
_DEFAULTS = LoRAConfig()
# adapter_config.json fields that would change the math if set: (field, the value we support)
_UNSUPPORTED = (("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False), ("lora_bias", False),
                ("modules_to_save", None), ("rank_pattern", {}), ("alpha_pattern", {}),
                ("layers_to_transform", None), ("target_parameters", None), ("trainable_token_indices", None))
# what 'all-linear' adapts on a dense model and on a hybrid one (its linear-attention layers
# too). A hybrid model's adapter on exactly the dense set reads as all-linear and is then
# refused at load (its in_proj_* would lack adapters): give such a folder's targets explicitly.
_ALL_LINEAR_SETS = (set(ATTENTION_TARGETS + MLP_TARGETS), set(TARGETS))
_PEFT_NAMES = {"rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout"}  # LoRAConfig field -> PEFT key


def _tensor_key(module: str, which: str) -> str:
    return f"{_PREFIX}{module}.{which}.weight"


def read_peft_config(folder: str | Path, what: str = "adapter") -> tuple[LoRAConfig, dict[str, str]]:
    """The folder's LoRA settings as a LoRAConfig (path = folder) and the tensor names of
    its adapter_model.safetensors -> module name (e.g. 'model.layers.0.self_attn.q_proj').
    `what` names the folder's origin in errors (e.g. 'model.lora.path')."""
    folder = Path(folder)
    cfg_path, w_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    holds = f"a PEFT LoRA adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE}"
    if not folder.is_dir():
        raise ValueError(f"{what} {folder}: {'is a file' if folder.exists() else 'no such folder'} ({holds})")
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise ValueError(f"{what} {folder}: no {p.name} ({holds})")
    d = read_json(cfg_path)
    if not isinstance(d, dict) or d.get("peft_type") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type must be 'LORA', got {d.get('peft_type') if isinstance(d, dict) else d!r}")
    for key, ok in _UNSUPPORTED:
        v = d.get(key, ok)
        if v != ok and not (ok is None and v in ([], {})) and not (ok == {} and v is None):
            raise ValueError(f"{cfg_path}: {key} = {v!r} is not supported (only plain LoRA: {key} = {ok!r})")
    try:
        with safe_open(w_path, framework="pt") as f:
            keys = list(f.keys())
    except SafetensorError:
        raise ValueError(f"{w_path}: not a readable safetensors file (damaged or truncated?)") from None
    modules: dict[str, str] = {}
    for k in keys:
        mod, _, tail = k[len(_PREFIX):].rpartition(".lora_")
        if not k.startswith(_PREFIX) or tail not in ("A.weight", "B.weight"):
            raise ValueError(f"{w_path}: unexpected tensor {k!r} (expected {_PREFIX}<module>.lora_A.weight "
                             f"and .lora_B.weight)")
        modules[k] = mod
    leaves = {m.rsplit(".", 1)[-1] for m in modules.values()}
    bad = sorted(leaves - set(TARGETS))
    if bad:
        raise ValueError(f"{w_path}: adapters on {bad}; rlfuse adapts only {list(TARGETS)}")
    try:
        cfg = LoRAConfig(rank=d.get("r"), alpha=d.get("lora_alpha"), dropout=d.get("lora_dropout", 0.0),
                         rslora=bool(d.get("use_rslora", False)),
                         targets=ALL_LINEAR if leaves in _ALL_LINEAR_SETS else tuple(sorted(leaves)), path=str(folder),
                         experts=(folder / EXPERTS_FILE).is_file())
    except ValueError as e:
        msg = str(e)
        for ours, theirs in _PEFT_NAMES.items():  # name the key the user finds in this file
            msg = msg.replace(f"lora.{ours} ", f"{theirs} (lora.{ours}) ", 1)
        raise ValueError(f"{cfg_path}: {msg}") from None
    return cfg, modules


def _agree(asked: LoRAConfig, found: LoRAConfig, where: Path) -> LoRAConfig:
    """The folder's settings, with the asked dropout and export_merged; a field set away
    from its default in `asked` must equal the folder's."""
    for f in ("rank", "alpha", "targets", "rslora"):
        a, d, got = getattr(asked, f), getattr(_DEFAULTS, f), getattr(found, f)
        if a != d and a != got:
            raise ValueError(f"lora.{f} = {a!r} but the adapter at {where} has {got!r}: set lora.{f} to {got!r} "
                             f"or leave it out")
    if asked.experts and not found.experts:
        raise ValueError(f"lora.experts is true but the adapter at {where} has no {EXPERTS_FILE} (no expert adapters)")
    return LoRAConfig(rank=found.rank, alpha=found.alpha, targets=found.targets, rslora=found.rslora,
                      dropout=asked.dropout, path=str(where), export_merged=asked.export_merged,
                      experts=found.experts)


@torch.no_grad()
def load_peft_adapter(model: CausalLM, folder: str | Path, cfg: LoRAConfig | None = None, *,
                      what: str = "adapter") -> LoRAConfig:
    """Attach adapters shaped as the folder's and load its A and B (cast to the model's
    dtype). `cfg` (e.g. the run's `model.lora`) gives the dropout and must agree with the
    folder on what it sets; `what` names the folder's origin in errors. Returns the config
    in effect."""
    folder = Path(folder)
    found, modules = read_peft_config(folder, what)
    eff = _agree(cfg, found, folder) if cfg is not None else found
    attach_lora(model, eff)
    load_peft_weights(model, folder, modules)
    log.info("LoRA: loaded the adapter %s (rank %d, alpha %g, %d modules)", folder, eff.rank, eff.alpha,
             len(modules) // 2)
    return eff


@torch.no_grad()
def load_peft_weights(model: CausalLM, folder: str | Path, modules: dict[str, str] | None = None) -> None:
    """Copy the folder's A and B into the model's adapters (attached already, e.g. a
    resumed run's): the folder must adapt exactly the model's modules, at its rank."""
    folder = Path(folder)
    if modules is None:
        modules = read_peft_config(folder)[1]
    name = checkpoint_names(model)  # the folder names modules as the HF model does (Qwen3-VL: model.language_model.)
    mods = {name(n): m for n, m in lora_modules(model)}
    wanted = set(modules.values())
    w_path = folder / WEIGHTS_FILE
    if wanted - set(mods):
        raise ValueError(f"{w_path}: adapts modules the model does not have or does not adapt, e.g. "
                         f"{sorted(wanted - set(mods))[:3]} (an adapter for another model?)")
    if set(mods) - wanted:
        raise ValueError(f"{w_path}: no adapter for {len(set(mods) - wanted)} of the model's {len(mods)} adapted "
                         f"modules, e.g. {sorted(set(mods) - wanted)[:3]}; per-layer subsets are not supported")
    with safe_open(w_path, framework="pt") as f:
        for key, mod in modules.items():
            t = f.get_tensor(key)
            p = getattr(mods[mod], "lora_A" if key.endswith("lora_A.weight") else "lora_B")
            if tuple(t.shape) != tuple(p.shape):
                r_at = 0 if key.endswith("lora_A.weight") else 1  # A is (r, in), B is (out, r)
                why = (f"rank {t.shape[r_at]} in the file, {p.shape[r_at]} in {CONFIG_FILE}"
                       if t.ndim == 2 and t.shape[r_at] != p.shape[r_at] else "an adapter for another model shape?")
                raise ValueError(f"{w_path}: {key} has shape {tuple(t.shape)}, the model's adapter expects "
                                 f"{tuple(p.shape)} ({why})")
            if not t.is_floating_point():
                raise ValueError(f"{w_path}: {key} is {t.dtype}; expected floating-point adapter weights")
            p.copy_(t)
    _load_expert_adapters(model, folder)


def _load_expert_adapters(model: CausalLM, folder: Path) -> None:
    """The per-expert adapters of EXPERTS_FILE into the model's (both or neither present)."""
    e_path = folder / EXPERTS_FILE
    want = {f"{n}.{p}": getattr(m, p) for n, m in expert_lora_modules(model) for p in m.adapter_params}
    if not want and not e_path.is_file():
        return
    if not want or not e_path.is_file():
        raise ValueError(f"{folder}: {'holds' if e_path.is_file() else 'has no'} {EXPERTS_FILE} but the model "
                         f"{'has no' if not want else 'has'} expert adapters (lora.experts)")
    with safe_open(e_path, framework="pt") as f:
        keys = set(f.keys())
        if keys != set(want):
            raise ValueError(f"{e_path}: tensors {sorted(keys ^ set(want))[:3]} differ from the model's expert adapters")
        for key, p in want.items():
            t = f.get_tensor(key)
            if tuple(t.shape) != tuple(p.shape) or not t.is_floating_point():
                raise ValueError(f"{e_path}: {key} is {tuple(t.shape)} {t.dtype}; the model's adapter expects "
                                 f"{tuple(p.shape)} floating point")
            p.copy_(t)


def save_peft_adapter(model: CausalLM, folder: str | Path, *, base_model_name_or_path: str | None = None,
                      tokenizer_dir: str | Path | None = None) -> Path:
    """Write adapter_config.json + adapter_model.safetensors as PEFT does, so
    `peft.PeftModel.from_pretrained(transformers_model, folder)` applies this adapter
    (atomically: a temporary sibling renamed over `folder`); the tokenizer files of
    `tokenizer_dir` go beside them."""
    mods = lora_modules(model)
    if not mods:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters")
    cfg = lora_config(model)
    folder = Path(folder)
    tensors = {}
    hf_name = checkpoint_names(model)  # PEFT applies the folder to the transformers model: its module names
    for name, m in mods:
        tensors[_tensor_key(hf_name(name), "lora_A")] = m.lora_A.detach().contiguous().cpu()
        tensors[_tensor_key(hf_name(name), "lora_B")] = m.lora_B.detach().contiguous().cpu()
    experts = {f"{n}.{p}": getattr(m, p).detach().contiguous().cpu()
               for n, m in expert_lora_modules(model) for p in m.adapter_params}
    if experts:  # said, not silent: PEFT's layout for 3-D expert parameters is not written yet
        log.warning("save_peft_adapter: the per-expert adapters of %d MoE layers go to %s, which PEFT does not "
                    "read; the PEFT folder applies the projection adapters only (lora.export_merged writes a "
                    "folder with every adapter merged)", len(expert_lora_modules(model)), EXPERTS_FILE)
    with atomic_folder(folder) as tmp:
        save_tensors_file(tensors, tmp / WEIGHTS_FILE, {"format": "pt"})
        if experts:
            save_tensors_file(experts, tmp / EXPERTS_FILE, {"format": "pt"})
        leaves = {name.rsplit(".", 1)[-1] for name, _ in mods}  # what this model adapts, in TARGETS order
        targets = [t for t in TARGETS if t in leaves]
        (tmp / CONFIG_FILE).write_text(json.dumps(_peft_config(cfg, targets, base_model_name_or_path), indent=2))
        copy_side_files(tokenizer_dir, tmp)
    return folder


def _peft_config(cfg: LoRAConfig, targets: list[str], base_model_name_or_path: str | None) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
            "lora_dropout": cfg.dropout, "use_rslora": cfg.rslora, "target_modules": targets,
            "bias": "none", "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
            "init_lora_weights": True, "inference_mode": True, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}, "base_model_name_or_path": base_model_name_or_path,
            "revision": None}


@torch.no_grad()
def merged_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """The HF checkpoint's tensors with every adapter merged: W + s B A in fp32, rounded
    to W's dtype (CPU tensors; the live model is untouched)."""
    merged = {f"{n}.weight": m for n, m in lora_modules(model)}
    experts = {}  # MoE blocks' per-expert adapters: each expert's W + s B A
    for n, m in expert_lora_modules(model):
        gu, dn = m.merged()
        experts[f"{n}.gate_up_proj"], experts[f"{n}.down_proj"] = gu.cpu(), dn.cpu()
    out = {}
    for name, p in hf_parameters(model):
        m = merged.get(name)
        if name in experts:
            out[name] = experts[name]
        elif m is None:
            out[name] = p.detach().cpu()
        else:
            w = p.float() + m.scale * (m.lora_B.float() @ m.lora_A.float())
            out[name] = w.to(p.dtype).cpu()
    return out


def save_merged(model: CausalLM, folder: str | Path, **kw) -> Path:
    """An HF folder (config.json + safetensors) of the model with its adapters merged;
    `kw` as `rlfuse.model.weights.save_model`."""
    return save_model(model, folder, tensors=merged_tensors(model), **kw)
