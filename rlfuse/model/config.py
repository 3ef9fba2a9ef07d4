"""Model configuration read from a Hugging Face `config.json` (Llama, Qwen2, Qwen3, Qwen3.5).

`ModelConfig.from_hf(dict_or_path)` validates and normalizes; `to_hf()` writes a dict
that `transformers.AutoConfig` reads back. Unknown architectures and malformed fields
raise ValueError naming the file and field: a required field missing; a head count,
head_dim, eps, rope theta or max_position_embeddings that is null, zero, negative or not a
number. Absent optional fields take the HF default, logged where it matters
(num_key_value_heads, head_dim, max_position_embeddings).
`check_kernel_support` rejects, at load, a head_dim the Triton kernels cannot run.
Hybrid models (Qwen3.5: `layer_types` mixing "linear_attention" Gated DeltaNet layers with
"full_attention" ones) carry the linear-attention shapes and the partial rotary factor; the
text tower of a multimodal folder (`Qwen3_5ForConditionalGeneration`, `text_config`) is
read as the text model (TEXT_TOWERS).
Test: python -m pytest -q tests/test_weights.py tests/test_bad_inputs.py
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from rlfuse.kernels.attention import supports_head_dim

log = logging.getLogger(__name__)


def read_json(path: Path) -> Any:
    """The JSON in the UTF-8 file `path` (config.json, tokenizer and adapter configs); a
    ValueError naming the file if it is not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None

ARCHITECTURES = {
    # model_type -> (HF architecture class name, qkv bias default, qk-norm)
    "llama": ("LlamaForCausalLM", False, False),
    "qwen2": ("Qwen2ForCausalLM", True, False),
    "qwen3": ("Qwen3ForCausalLM", False, True),
    "qwen3_5_text": ("Qwen3_5ForCausalLM", False, True),
}
# Architectures whose layers follow `layer_types` (each one of LAYER_TYPES); the others are
# all full attention.
HYBRID = ("qwen3_5_text",)
LAYER_TYPES = ("full_attention", "linear_attention")
# HF's defaults for a hybrid config's absent fields (transformers' Qwen3_5TextConfig)
_HYBRID_DEFAULTS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 32}
# Multimodal wrappers whose text tower rlfuse loads: model_type -> (the text model_type,
# the HF class). Their config.json nests the text fields under `text_config`.
TEXT_TOWERS = {"qwen3_5": ("qwen3_5_text", "Qwen3_5ForConditionalGeneration")}
# What each HF class builds whatever its config.json says (transformers has no switch for it):
# Qwen3 always has the per-head q/k norms, Llama and Qwen2 never; Qwen2 always has q/k/v
# biases; Qwen2 and Qwen3 never an MLP bias. Another value would save a folder that neither
# our loader nor transformers reads back, so ModelConfig refuses it.
_FIXED = {
    "llama": {"qk_norm": False},
    "qwen2": {"qk_norm": False, "attention_bias": True, "mlp_bias": False},
    "qwen3": {"qk_norm": True, "mlp_bias": False},
    "qwen3_5_text": {"qk_norm": True, "mlp_bias": False},
}
_ARCH_TO_TYPE = {v[0]: k for k, v in ARCHITECTURES.items()} | {v[1]: k for k, v in TEXT_TOWERS.items()}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    model_type: str
    """One of "llama", "qwen2", "qwen3", "qwen3_5_text"."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
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
    layer_types: tuple[str, ...] | None = None
    """Hybrid models: each layer's mixer, "full_attention" or "linear_attention" (None: HF's
    default, every 4th layer full). Other architectures: None (all full attention)."""
    partial_rotary_factor: float = 1.0
    """RoPE rotates the first int(head_dim * factor) dims of each head (Qwen3.5: 0.25)."""
    linear_conv_kernel_dim: int | None = None
    """Hybrid models: the causal conv1d width of the linear-attention layers (None: 4)."""
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    """Linear-attention heads: q/k heads of linear_key_head_dim, value heads (a multiple of
    the key heads) of linear_value_head_dim. None: HF's defaults (128, 128, 16, 32)."""

    def __post_init__(self):
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"model_type {self.model_type!r} is not supported (expected one of {sorted(ARCHITECTURES)})")
        _, bias_default, qk_norm = ARCHITECTURES[self.model_type]
        for f, default in (("attention_bias", bias_default), ("qk_norm", qk_norm)):
            if getattr(self, f) is None:
                object.__setattr__(self, f, default)
        for f, fixed in _FIXED[self.model_type].items():
            v = getattr(self, f)
            if not isinstance(v, bool):
                raise ValueError(f"config field {f!r} must be true or false, got {v!r}")
            if v != fixed:
                raise ValueError(f"config field {f!r} is {v}, but {self.architecture} always has {f} = {fixed} "
                                 f"(transformers has no switch for it: such a model would not load back)")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim"):
            v = getattr(self, f)
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
        self._check_hybrid()

    def _check_hybrid(self):
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"config field 'partial_rotary_factor' must be a number in (0, 1], got {f!r}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"config field 'partial_rotary_factor' ({f}) gives a rotary dim of {self.rotary_dim} "
                             f"(head_dim {self.head_dim}); it must be even and at least 2")
        linear = tuple(_HYBRID_DEFAULTS)
        if self.model_type not in HYBRID:
            given = [k for k in ("layer_types", *linear) if getattr(self, k) is not None]
            if f != 1.0:
                given.append("partial_rotary_factor")
            if given:
                raise ValueError(f"config field {given[0]!r} is set, but {self.architecture} is not a hybrid "
                                 f"architecture (hybrid: {list(HYBRID)})")
            return
        for k, default in _HYBRID_DEFAULTS.items():
            v = getattr(self, k)
            if v is None:
                object.__setattr__(self, k, default)
            elif not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"config field {k!r} must be a positive integer, got {v!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"config field 'linear_num_value_heads' ({self.linear_num_value_heads}) must be a "
                             f"multiple of 'linear_num_key_heads' ({self.linear_num_key_heads})")
        types = self.layer_types
        if types is None:  # HF's default: every 4th layer full attention
            types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                     for i in range(self.num_hidden_layers)]
        if isinstance(types, str) or not isinstance(types, (list, tuple)):
            raise ValueError(f"config field 'layer_types' must be a list of {list(LAYER_TYPES)}, got {types!r}")
        for i, t in enumerate(types):
            if t not in LAYER_TYPES:
                raise ValueError(f"config field 'layer_types': layer {i} has type {t!r}, which rlfuse does not "
                                 f"support; supported layer types: {list(LAYER_TYPES)}")
        if len(types) != self.num_hidden_layers:
            raise ValueError(f"config field 'layer_types' lists {len(types)} layers; num_hidden_layers is "
                             f"{self.num_hidden_layers}")
        object.__setattr__(self, "layer_types", tuple(types))

    @property
    def rotary_dim(self) -> int:
        """Head dims RoPE rotates (the first ones; the rest pass through), as HF rounds it."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_hybrid(self) -> bool:
        return self.layer_types is not None

    def layer_type(self, i: int) -> str:
        return "full_attention" if self.layer_types is None else self.layer_types[i]

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type][0]

    @property
    def eos_token_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([e] if isinstance(e, int) else list(e))

    @classmethod
    def from_hf(cls, src: dict | str | Path) -> "ModelConfig":
        """Build from a `config.json` dict, the file, or the checkpoint folder holding it."""
        where = "config"
        if not isinstance(src, dict):
            path = Path(src)
            if path.is_dir():
                path = path / "config.json"
            where = str(path)
            if not path.exists():
                raise ValueError(f"{where}: no such file (expected a config.json, or an HF model folder holding one)")
            src = read_json(path)
        return _from_hf_dict(src, where)

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that `transformers.AutoConfig.for_model` accepts."""
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        if self.partial_rotary_factor != 1.0:
            rope["partial_rotary_factor"] = self.partial_rotary_factor
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
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
        if self.model_type != "qwen2":
            d["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
        if self.model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = False
        if self.model_type in HYBRID:
            d["layer_types"] = list(self.layer_types)
            d["partial_rotary_factor"] = self.partial_rotary_factor
            d.update({k: getattr(self, k) for k in _HYBRID_DEFAULTS})
        return d


_MISSING = object()


def _number(d: dict, key: str, where: str, default=_MISSING, *, integer: bool = False, label: str | None = None):
    """d[key] as a positive (finite) int or float. Absent: `default` (the HF default, when
    the field has one) or an error; null, zero, negative or a non-number: an error naming
    the field -- never a silent default."""
    label = label or key
    kind = "a positive integer" if integer else "a positive finite number"
    if key not in d:
        if default is _MISSING:
            raise ValueError(f"{where}: missing required field {label!r} (expected {kind})")
        return default
    v = d[key]
    if v is None:
        raise ValueError(f"{where}: field {label!r} is null; expected {kind}")
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{where}: field {label!r} is {v!r}; expected {kind}")
    return v if integer else float(v)


def _flag(d: dict, key: str, where: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"{where}: field {key!r} is {v!r}; expected true or false")
    return v


def _from_hf_dict(d: dict, where: str) -> ModelConfig:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object of config fields, got {type(d).__name__}")
    model_type = d.get("model_type")
    if model_type is None:
        archs = d.get("architectures") or []
        model_type = next((_ARCH_TO_TYPE[a] for a in archs if a in _ARCH_TO_TYPE), None)
    if model_type in TEXT_TOWERS:
        d, model_type, where = _text_tower(d, model_type, where)
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{where}: field 'model_type' is {model_type!r}; rlfuse supports "
                         f"{sorted(ARCHITECTURES) + sorted(TEXT_TOWERS)} (architectures {sorted(_ARCH_TO_TYPE)})")
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
    hybrid = _hybrid_fields(d, rope, where) if model_type in HYBRID else {}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta" and k not in _HYBRID_ROPE_KEYS}
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
        intermediate_size=_number(d, "intermediate_size", where, integer=True),
        num_hidden_layers=_number(d, "num_hidden_layers", where, integer=True),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=_number(d, "rms_norm_eps", where, 1e-6),
        rope_theta=rope_theta,
        rope_scaling=None if rope_type == "default" else scaling,
        max_position_embeddings=_number(d, "max_position_embeddings", where, 4096, integer=True),
        tie_word_embeddings=_flag(d, "tie_word_embeddings", where, False),
        attention_bias=None if model_type == "qwen2" else _flag(d, "attention_bias", where, False),
        mlp_bias=_flag(d, "mlp_bias", where, False) if model_type == "llama" else False,  # as HF reads it
        hidden_act=d.get("hidden_act", "silu"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
        torch_dtype=str(dtype).replace("torch.", ""),
        **hybrid,
    )
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


# rope_parameters keys of hybrid models that are no part of the rope type: the partial
# factor (read below), and the multimodal rope's sections: a text-only input gives the
# three position streams (time, height, width) the same positions, so mrope is plain rope.
_HYBRID_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def _hybrid_fields(d: dict, rope: dict, where: str) -> dict:
    """A hybrid config's layer_types, linear-attention shapes and partial rotary factor."""
    if d.get("attn_output_gate", True) is not True:
        raise ValueError(f"{where}: field 'attn_output_gate' is {d['attn_output_gate']!r}; Qwen3.5's attention "
                         f"always has its output gate (transformers has no switch for it)")
    out: dict[str, Any] = {k: _number(d, k, where, None, integer=True) for k in _HYBRID_DEFAULTS}
    for k, default in _HYBRID_DEFAULTS.items():
        if out[k] is None:
            out[k] = default
            log.info("%s: no %r; using %d (the HF default)", where, k, default)
    types = d.get("layer_types")
    if types is None:
        interval = _number(d, "full_attention_interval", where, 4, integer=True)
        n = _number(d, "num_hidden_layers", where, integer=True)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    elif not isinstance(types, list):
        raise ValueError(f"{where}: field 'layer_types' must be a list of {list(LAYER_TYPES)}, got {types!r}")
    out["layer_types"] = tuple(types)
    if "partial_rotary_factor" in rope:
        prf = _number(rope, "partial_rotary_factor", where, label="rope_parameters.partial_rotary_factor")
    else:  # transformers' Qwen3_5TextConfig default
        prf = _number(d, "partial_rotary_factor", where, 0.25)
    out["partial_rotary_factor"] = prf
    return out


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
