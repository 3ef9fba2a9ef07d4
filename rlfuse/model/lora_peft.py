"""PEFT adapter folders in and out, and the merged HF export.

A PEFT LoRA folder is `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with tensors named
`base_model.model.<module>.lora_A.weight` (r, in) and `...lora_B.weight` (out, r), the
module names being the `transformers` ones, which are ours. So:

    load_peft_adapter(model, folder)        # attach + load A and B
    save_peft_adapter(model, folder)        # PeftModel.from_pretrained(hf_model, folder) loads it
    load_peft_weights(model, folder)        # into adapters attached already (resume)
    save_merged(model, folder)              # an HF folder with W + s B A rounded into W

MoE experts (`lora.experts`): transformers 5 stores an MoE block's experts as two 3-D
parameters, which PEFT (>= 0.17) adapts with `target_parameters` (its `ParamWrapper`): the
config lists "mlp.experts.down_proj" and "mlp.experts.gate_up_proj", and each block's
adapters are two pairs of tensors, one per parameter, with the E experts' ranks stacked:
    lora_A.weight (E r, in)   row e r + j   = our A[e, j]          (A: (E, r, in))
    lora_B.weight (out, r E)  column j E + e = our B[e, :, j]       (B: (E, out, r))
PEFT wraps the module once per parameter, in sorted order of the names, so the first
(down_proj) sits at `<block>.experts.lora_*` and the second (gate_up_proj) at
`<block>.experts.base_layer.lora_*`. PEFT's ParamWrapper refuses dropout: such a folder
says lora_dropout 0 (dropout is a training setting; the run's own config gives it).
Only plain LoRA is read: DoRA, adapter biases, modules_to_save, per-module rank or alpha
patterns, per-layer subsets and parameter targets other than the experts' are refused with
a ValueError naming the file and field.
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

from rlfuse.model.arch import ARCHS
from rlfuse.model.causal_lm import CausalLM
from rlfuse.model.config import read_json
from rlfuse.model.lora import (
    ALL_LINEAR,
    ATTENTION_TARGETS,
    FUSED_LINEAR_ATTENTION_TARGETS,
    LINEAR_ATTENTION_TARGETS,
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
_PREFIX = "base_model.model."
# PEFT's target_parameters for the experts' adapters, in PEFT's (sorted) wrapping order, and
# where each one's tensors sit under the experts module
EXPERT_TARGETS = ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")
_EXPERT_KEYS = {"": ("down_A", "down_B"), ".base_layer": ("gate_up_A", "gate_up_B")}
_DEFAULTS = LoRAConfig()
# adapter_config.json fields that would change the math if set: (field, the value we support)
_UNSUPPORTED = (("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False), ("lora_bias", False),
                ("modules_to_save", None), ("rank_pattern", {}), ("alpha_pattern", {}),
                ("layers_to_transform", None), ("trainable_token_indices", None))
# what 'all-linear' adapts on a dense model and on a hybrid one (its linear-attention layers
# too, their input projections unfused (Qwen3.5) or fused (Qwen3-Next)). A hybrid model's adapter on exactly the dense set reads as all-linear and is then
# refused at load (its in_proj_* would lack adapters): give such a folder's targets explicitly.
_DENSE = ATTENTION_TARGETS + MLP_TARGETS
_ALL_LINEAR_SETS = (set(_DENSE), set(_DENSE + LINEAR_ATTENTION_TARGETS),
                    set(_DENSE + FUSED_LINEAR_ATTENTION_TARGETS) | {"out_proj"})
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
    experts = _expert_targets(d.get("target_parameters"), cfg_path)
    try:
        with safe_open(w_path, framework="pt") as f:
            keys = list(f.keys())
    except SafetensorError:
        raise ValueError(f"{w_path}: not a readable safetensors file (damaged or truncated?)") from None
    modules: dict[str, str] = {}
    for k in keys:
        if experts and _expert_key(k) is not None:
            continue  # read by _load_expert_adapters
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
                         experts=experts)
    except ValueError as e:
        msg = str(e)
        for ours, theirs in _PEFT_NAMES.items():  # name the key the user finds in this file
            msg = msg.replace(f"lora.{ours} ", f"{theirs} (lora.{ours}) ", 1)
        raise ValueError(f"{cfg_path}: {msg}") from None
    return cfg, modules


def _expert_targets(targets, cfg_path: Path) -> bool:
    """Whether the folder adapts the MoE experts (target_parameters = EXPERT_TARGETS);
    any other parameter target is refused."""
    if not targets:
        return False
    if not isinstance(targets, list) or sorted(targets) != sorted(EXPERT_TARGETS):
        raise ValueError(f"{cfg_path}: target_parameters = {targets!r} is not supported (rlfuse adapts parameters "
                         f"only as per-expert adapters on both of {list(EXPERT_TARGETS)})")
    return True


def _expert_key(key: str) -> tuple[str, str] | None:
    """(experts module name, our adapter parameter) of a PEFT tensor name of the experts'
    adapters, e.g. '...mlp.experts.base_layer.lora_A.weight' -> ('...mlp.experts', 'gate_up_A')."""
    body = key[len(_PREFIX):]
    for suffix, (a, b) in _EXPERT_KEYS.items():
        for which, ours in (("lora_A", a), ("lora_B", b)):
            tail = f".experts{suffix}.{which}.weight"
            if body.endswith(tail):
                return body[:-len(tail)] + ".experts", ours
    return None


def _agree(asked: LoRAConfig, found: LoRAConfig, where: Path) -> LoRAConfig:
    """The folder's settings, with the asked dropout and export_merged; a field set away
    from its default in `asked` must equal the folder's."""
    for f in ("rank", "alpha", "targets", "rslora"):
        a, d, got = getattr(asked, f), getattr(_DEFAULTS, f), getattr(found, f)
        if a != d and a != got:
            raise ValueError(f"lora.{f} = {a!r} but the adapter at {where} has {got!r}: set lora.{f} to {got!r} "
                             f"or leave it out")
    if asked.experts and not found.experts:
        raise ValueError(f"lora.experts is true but the adapter at {where} has no expert adapters (its "
                         f"target_parameters do not list {list(EXPERT_TARGETS)})")
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
    """The folder's per-expert adapters (PEFT's target_parameters layout, module docstring)
    into the model's: both or neither must have them."""
    w_path = folder / WEIGHTS_FILE
    want = dict(expert_lora_modules(model))
    with safe_open(w_path, framework="pt") as f:
        found = {k: _expert_key(k) for k in f.keys()}
        found = {k: v for k, v in found.items() if v is not None}
        if bool(want) != bool(found):
            raise ValueError(f"{w_path}: {'holds' if found else 'has no'} expert adapters (target_parameters "
                             f"{list(EXPERT_TARGETS)}) but the model {'has none' if found else 'has'} (lora.experts)")
        missing = {(n, p) for n, m in want.items() for p in m.adapter_params} - set(found.values())
        if missing or len(found) != 4 * len(want):
            extra = sorted(k for k, (n, _) in found.items() if n not in want)
            raise ValueError(f"{w_path}: the expert adapters differ from the model's: missing {sorted(missing)[:3]}, "
                             f"unexpected {extra[:3]}")
        for key, (name, param) in found.items():
            p = getattr(want[name], param)
            E, rows, cols = p.shape  # A: (E, r, in); B: (E, out, r)
            t = f.get_tensor(key)
            shape = (E * rows, cols) if param.endswith("_A") else (rows, cols * E)
            if tuple(t.shape) != shape or not t.is_floating_point():
                raise ValueError(f"{w_path}: {key} is {tuple(t.shape)} {t.dtype}; the model's adapter expects "
                                 f"{shape} floating point (E = {E} experts)")
            p.copy_(t.reshape(E, rows, cols) if param.endswith("_A") else t.reshape(rows, cols, E).permute(2, 0, 1))


def _expert_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """PEFT's tensors of the model's per-expert adapters (the inverse of `_load_expert_adapters`)."""
    out = {}
    for name, m in expert_lora_modules(model):
        for suffix, (a, b) in _EXPERT_KEYS.items():
            A, B = getattr(m, a).detach(), getattr(m, b).detach()
            out[f"{_PREFIX}{name}{suffix}.lora_A.weight"] = A.reshape(-1, A.shape[2]).contiguous().cpu()
            out[f"{_PREFIX}{name}{suffix}.lora_B.weight"] = B.permute(1, 2, 0).reshape(B.shape[1], -1).contiguous().cpu()
    return out


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
        for which in ("lora_A", "lora_B"):
            t = getattr(m, which).detach().contiguous().cpu()
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()  # a view into a fused or joined buffer (rlfuse.model.fuse): its own storage
            tensors[_tensor_key(hf_name(name), which)] = t
    experts = _expert_tensors(model)
    tensors |= experts
    leaves = {name.rsplit(".", 1)[-1] for name, _ in mods}  # what this model adapts, in TARGETS order
    targets = [t for t in TARGETS if t in leaves]
    if ARCHS[model.config.model_type].peft_maps_mlp_targets and set(MLP_TARGETS) & leaves:
        # said, not silent: PEFT reads these targets as the experts' (their transformers-v4 names), drops the
        # dense layers' adapters and adds expert adapters of another rank (measured with PEFT 0.21.2)
        log.warning("save_peft_adapter: PEFT maps target_modules %s of a %s model onto its experts' fused "
                    "parameters, so PEFT + transformers do not apply this folder's dense-MLP adapters (rlfuse loads "
                    "it; lora.export_merged writes a folder with every adapter merged)",
                    sorted(set(MLP_TARGETS) & leaves), model.config.model_type)
    with atomic_folder(folder) as tmp:
        save_tensors_file(tensors, tmp / WEIGHTS_FILE, {"format": "pt"})
        peft_cfg = _peft_config(cfg, targets, base_model_name_or_path)
        if experts:  # PEFT's ParamWrapper refuses dropout (a training setting: the run's config gives it)
            peft_cfg |= {"target_parameters": list(EXPERT_TARGETS), "lora_dropout": 0.0}
        (tmp / CONFIG_FILE).write_text(json.dumps(peft_cfg, indent=2))
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
