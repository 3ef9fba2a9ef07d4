"""Model configuration read from a Hugging Face `config.json` (the families `rlfuse.model.arch` registers).

`ModelConfig.from_hf(dict_or_path)` validates and normalizes; `to_hf()` writes a dict
that `transformers.AutoConfig` reads back. Unknown architectures and malformed fields
raise ValueError naming the file and field: a required field missing; a head count,
head_dim, eps, rope theta or max_position_embeddings that is null, zero, negative or not a
number. Absent optional fields take the HF default, logged where it matters
(num_key_value_heads, head_dim, max_position_embeddings).
`check_kernel_support` rejects, at load, a head_dim the Triton kernels cannot run.
Test: python -m pytest -q tests/test_weights.py tests/test_bad_inputs.py
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from rlfuse.kernels.attention.varlen import supports_head_dim
from rlfuse.model.arch import ARCHS
from rlfuse.model.arch.fields import flag as _flag
from rlfuse.model.arch.fields import number as _number
from rlfuse.model.layers.moe_config import MoEConfig, moe_config_from_hf
from rlfuse.model.vision.config import VisionConfig

log = logging.getLogger(__name__)


def read_json(path: Path) -> Any:
    """The JSON in the UTF-8 file `path` (config.json, tokenizer and adapter configs); a
    ValueError naming the file if it is not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None

_ARCH_TO_TYPE = {s.hf_class: k for k, s in ARCHS.items()}
# multimodal wrappers whose text tower a family loads: wrapper model_type -> (text model_type,
# wrapper HF class); their config.json nests the text fields under `text_config`
TEXT_TOWERS = {w: (k, cls) for k, s in ARCHS.items() for w, cls in s.text_tower_of.items()}
_ARCH_TO_TYPE |= {cls: w for w, (_, cls) in TEXT_TOWERS.items()}
# the fields of hybrid families (ArchSpec.check_config reads them); None / 1.0 elsewhere
HYBRID_FIELDS = ("layer_types", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    model_type: str
    """An HF model_type registered in `rlfuse.model.arch` (docs/models.md lists them)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int | None = None
    """The dense MLP's width; None only for architectures without dense MLPs (Qwen3.5-MoE)."""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """HF rope parameters without the theta (e.g. {"rope_type": "llama3", "factor": 8, ...})."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None
    """Bias on q/k/v projections (and o_proj for Llama and Qwen3). None: the architecture's
    (always on for Qwen2, off for the others)."""
    mlp_bias: bool = False
    """Bias on the MLP projections (Llama only)."""
    qk_norm: bool | None = None
    """Per-head RMSNorm on q and k before RoPE. None: the architecture's (Qwen3 always has
    it, Llama and Qwen2 never)."""
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    moe: MoEConfig | None = None
    """The mixture-of-experts fields, given exactly for the architectures whose spec says
    `has_moe` (qwen3_moe; `rlfuse.model.layers.moe_config`)."""
    layer_types: tuple[str, ...] | None = None
    """Hybrid models: each layer's mixer, e.g. "full_attention" or "linear_attention" (None
    in a hybrid config: the family's default). Other architectures: None (all full attention)."""
    partial_rotary_factor: float = 1.0
    """RoPE rotates the first int(head_dim * factor) dims of each head (Qwen3.5: 0.25)."""
    linear_conv_kernel_dim: int | None = None
    """Hybrid models: the causal conv1d width of the linear-attention layers."""
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    """Linear-attention heads: q/k heads of linear_key_head_dim, value heads (a multiple of
    the key heads) of linear_value_head_dim. None in a hybrid config: the family's defaults."""
    vision: VisionConfig | None = None
    """Vision-language models (Qwen3-VL, Qwen3.5): the vision tower and the image token ids
    (`rlfuse.model.vision.config`); None for text models."""
    mrope_section: tuple[int, ...] | None = None
    """Vision-language models: the interleaved mRoPE split (t, h, w) of the rotary_dim / 2
    rotary frequencies (`rlfuse.model.vision.positions`); None: the family's default
    (Qwen3-VL (24, 20, 20), Qwen3.5 (11, 11, 10))."""

    def __post_init__(self):
        if self.model_type not in ARCHS:
            raise ValueError(f"model_type {self.model_type!r} is not supported (expected one of {sorted(ARCHS)})")
        spec = ARCHS[self.model_type]
        for f in ("attention_bias", "qk_norm"):
            if getattr(self, f) is None:
                object.__setattr__(self, f, spec.fixed.get(f, spec.defaults.get(f, False)))
        for f, fixed in spec.fixed.items():
            v = getattr(self, f)
            if not isinstance(v, bool):
                raise ValueError(f"config field {f!r} must be true or false, got {v!r}")
            if v != fixed:
                raise ValueError(f"config field {f!r} is {v}, but {self.architecture} always has {f} = {fixed} "
                                 f"(transformers has no switch for it: such a model would not load back)")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim"):
            v = getattr(self, f)
            if f == "intermediate_size" and not spec.dense_mlp:
                if v is not None:
                    raise ValueError(f"config field 'intermediate_size' is {v!r}, but {spec.hf_class} has no dense "
                                     f"MLP (every layer is an MoE block: moe.moe_intermediate_size and "
                                     f"moe.shared_expert_intermediate_size set the widths); leave it out")
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"config field {f!r} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"config field 'num_attention_heads' ({self.num_attention_heads}) must be a multiple "
                             f"of 'num_key_value_heads' ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"config field 'head_dim' must be even for RoPE, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"config field 'hidden_act' must be 'silu', got {self.hidden_act!r}")
        for f in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"config field {f!r} must be a positive finite number, got {v!r}")
        v = self.max_position_embeddings
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"config field 'max_position_embeddings' must be a positive integer, got {v!r}")
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if (self.moe is not None) != spec.has_moe:
            moe_types = sorted(k for k, s in ARCHS.items() if s.has_moe)
            raise ValueError(f"config field 'moe' must be given for model_types {moe_types} and only for them "
                             f"(model_type {self.model_type!r}, moe {self.moe!r})")
        if self.moe is not None:
            self.moe.check(self.num_hidden_layers, shared_expert=spec.moe_shared_expert, fixed=spec.moe_fixed,
                           family=self.model_type)
        if (self.vision is not None or self.mrope_section is not None) and not spec.has_vision:
            vl = sorted(k for k, s in ARCHS.items() if s.has_vision)
            raise ValueError(f"config field 'vision' / 'mrope_section' is set, but {self.architecture} has no vision "
                             f"tower (vision-language model_types: {vl})")
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"config field 'partial_rotary_factor' must be a number in (0, 1], got {f!r}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"config field 'partial_rotary_factor' ({f}) gives a rotary dim of {self.rotary_dim} "
                             f"(head_dim {self.head_dim}); it must be even and at least 2")
        if spec.check_config is not None:
            spec.check_config(self)
            return
        given = [k for k in HYBRID_FIELDS if getattr(self, k) is not None] + (["partial_rotary_factor"] * (f != 1.0))
        if given:
            hybrid = [k for k, s in ARCHS.items() if s.check_config is not None]
            raise ValueError(f"config field {given[0]!r} is set, but {self.architecture} is not a hybrid "
                             f"architecture (hybrid: {hybrid})")

    @property
    def rotary_dim(self) -> int:
        """Head dims RoPE rotates (the first ones; the rest pass through), as HF rounds it."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers mix tokens other than by full attention (`layer_types`)."""
        return self.layer_types is not None

    def layer_type(self, i: int) -> str:
        return "full_attention" if self.layer_types is None else self.layer_types[i]

    @property
    def architecture(self) -> str:
        return ARCHS[self.model_type].hf_class

    @property
    def eos_token_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([e] if isinstance(e, int) else list(e))

    @classmethod
    def from_hf(cls, src: dict | str | Path, *, text_only: bool = False) -> "ModelConfig":
        """Build from a `config.json` dict, the file, or the checkpoint folder holding it.
        text_only: a multimodal folder whose text tower is a family of its own (Qwen3.5's
        `qwen3_5` -> `qwen3_5_text`) gives that text model; without it, the folder's own
        model (vision tower included). A text model's folder is read as it is; a vision-language
        folder with no such text tower (Qwen3-VL) refuses it."""
        where = "config"
        if not isinstance(src, dict):
            path = Path(src)
            if path.is_dir():
                path = path / "config.json"
            where = str(path)
            if not path.exists():
                raise ValueError(f"{where}: no such file (expected a config.json, or an HF model folder holding one)")
            src = read_json(path)
        return _from_hf_dict(src, where, text_only)

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that `transformers.AutoConfig.for_model` accepts."""
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": None if self.rope_scaling is None else rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.torch_dtype,
            "dtype": self.torch_dtype,
        }
        spec = ARCHS[self.model_type]
        if self.intermediate_size is not None:
            d["intermediate_size"] = self.intermediate_size
        for f in ("attention_bias", "mlp_bias"):  # the switches the HF class reads from its config
            if f not in spec.fixed:
                d[f] = getattr(self, f)
        d.update(spec.hf_extra)
        if self.moe is not None:
            d.update(self.moe.to_hf(spec.moe_fixed))
        if spec.write_hf is not None:
            d.update(spec.write_hf(self))
        return d if spec.wrap_hf is None else spec.wrap_hf(d, self)


def _from_hf_dict(d: dict, where: str, text_only: bool = False) -> ModelConfig:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object of config fields, got {type(d).__name__}")
    model_type = d.get("model_type")
    if model_type is None:
        archs = d.get("architectures") or []
        model_type = next((_ARCH_TO_TYPE[a] for a in archs if a in _ARCH_TO_TYPE), None)
    if text_only and model_type not in TEXT_TOWERS and model_type in ARCHS and ARCHS[model_type].has_vision:
        # (a text model's folder is its text tower already: text_only changes nothing there)
        towers = sorted(cls for _, cls in TEXT_TOWERS.values())
        raise ValueError(f"{where}: text_only: a {model_type!r} folder has no text tower loadable alone (the "
                         f"multimodal classes that have one: {towers})")
    if model_type in TEXT_TOWERS and (text_only or model_type not in ARCHS):
        d, model_type, where = _text_tower(d, model_type, where)
    elif model_type in ARCHS and ARCHS[model_type].unwrap_hf is not None:  # a nested (multimodal) config.json
        d = ARCHS[model_type].unwrap_hf(d, where)
    if model_type not in ARCHS:
        raise ValueError(f"{where}: field 'model_type' is {model_type!r}; rlfuse supports "
                         f"{sorted(set(ARCHS) | set(TEXT_TOWERS))} (architectures {sorted(_ARCH_TO_TYPE)})")
    spec = ARCHS[model_type]
    fixed = spec.fixed
    if d.get("use_sliding_window"):
        raise ValueError(f"{where}: field 'use_sliding_window' is true; sliding-window attention is not supported")
    n_heads = _number(d, "num_attention_heads", where, integer=True)
    hidden = _number(d, "hidden_size", where, integer=True)
    # absent num_key_value_heads / head_dim: the HF convention (what transformers itself
    # assumes), logged; null or 0 is an error
    n_kv = _number(d, "num_key_value_heads", where, None, integer=True)
    if n_kv is None:
        n_kv = n_heads
        log.info("%s: no 'num_key_value_heads'; using num_attention_heads = %d (the HF convention)", where, n_heads)
    head_dim = _number(d, "head_dim", where, None, integer=True)
    if head_dim is None:
        if hidden % n_heads:
            raise ValueError(f"{where}: field 'head_dim' is missing and hidden_size ({hidden}) is not a multiple of "
                             f"num_attention_heads ({n_heads}); give head_dim")
        head_dim = hidden // n_heads
        log.info("%s: no 'head_dim'; using hidden_size / num_attention_heads = %d (the HF convention)", where,
                 head_dim)
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{where}: field 'rope_parameters' must be an object, got {type(rope).__name__}")
    if "rope_theta" in rope:
        rope_theta = _number(rope, "rope_theta", where, label="rope_parameters.rope_theta")
    else:
        rope_theta = _number(d, "rope_theta", where, 10000.0)
    extra = spec.read_hf(d, rope, where) if spec.read_hf is not None else {}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta" and k not in spec.rope_keys}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"{where}: field 'rope_parameters.rope_type' is {rope_type!r}; supported: 'default', 'llama3'")
    if rope_type == "llama3":
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if k not in scaling:
                raise ValueError(f"{where}: llama3 rope scaling needs field 'rope_parameters.{k}'")
            _number(scaling, k, where, label=f"rope_parameters.{k}")
    if "max_position_embeddings" not in d:
        log.warning("%s: no 'max_position_embeddings'; assuming a context of 4096 tokens", where)
    dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
    kw = dict(
        model_type=model_type,
        vocab_size=_number(d, "vocab_size", where, integer=True),
        hidden_size=hidden,
        intermediate_size=_number(d, "intermediate_size", where, integer=True) if spec.dense_mlp else None,
        num_hidden_layers=_number(d, "num_hidden_layers", where, integer=True),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=_number(d, "rms_norm_eps", where, 1e-6),
        rope_theta=rope_theta,
        rope_scaling=None if rope_type == "default" else scaling,
        max_position_embeddings=_number(d, "max_position_embeddings", where, 4096, integer=True),
        tie_word_embeddings=_flag(d, "tie_word_embeddings", where, False),
        # a switch the HF class hard-codes is not read from config.json (as transformers reads it)
        attention_bias=None if "attention_bias" in fixed else _flag(d, "attention_bias", where, False),
        mlp_bias=fixed["mlp_bias"] if "mlp_bias" in fixed else _flag(d, "mlp_bias", where, False),
        hidden_act=d.get("hidden_act", "silu"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
        torch_dtype=str(dtype).replace("torch.", ""),
        **extra,
    )
    if ARCHS[model_type].has_moe:
        kw["moe"] = moe_config_from_hf(d, where, kw["num_hidden_layers"], shared_expert=spec.moe_shared_expert,
                                       fixed=spec.moe_fixed, family=model_type)
    try:
        return ModelConfig(**kw)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _text_tower(d: dict, wrapper: str, where: str) -> tuple[dict, str, str]:
    """A multimodal config's text tower: its `text_config` fields (the outer file's
    tie_word_embeddings and dtype win, as transformers reads them), the text model_type."""
    text_type, cls = TEXT_TOWERS[wrapper]
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{where}: a {cls} config needs a 'text_config' object, got {type(text).__name__}")
    text = dict(text)
    for k in ("tie_word_embeddings", "torch_dtype", "dtype"):
        if k in d:
            text[k] = d[k]
    text_model_type = text.get("model_type", text_type)
    if text_model_type != text_type:
        raise ValueError(f"{where}: field 'text_config.model_type' is {text_model_type!r}; a {cls} folder "
                         f"holds a {text_type!r} text tower")
    text["model_type"] = text_type
    return text, text_type, f"{where} (text_config)"


TRITON_HEAD_DIMS = "a power of two in [16, 256]"


def check_kernel_support(cfg: ModelConfig, backend: str, device_type: str, where: str = "model") -> None:
    """ValueError, at load, when the chosen kernels cannot run this model: a head_dim the
    Triton attention kernels do not take, with kernel_backend "triton", or "auto" on CUDA
    (where auto picks Triton). An error rather than a silent switch to the reference kernels,
    which are several times slower on a GPU: the message says how to choose them."""
    uses_triton = backend == "triton" or (backend == "auto" and device_type == "cuda")
    if uses_triton and not supports_head_dim(cfg.head_dim):
        raise ValueError(f"{where}: field 'head_dim' is {cfg.head_dim}; the Triton attention kernels need "
                         f"{TRITON_HEAD_DIMS} (kernel backend {backend!r} on {device_type}); set "
                         f"model.kernel_backend: torch to run this model on the reference kernels (slower)")
