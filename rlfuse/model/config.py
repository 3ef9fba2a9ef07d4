"""Model configuration read from a Hugging Face `config.json` (Llama, Qwen2, Qwen3).

`ModelConfig.from_hf(dict_or_path)` validates and normalizes; `to_hf()` writes a dict
that `transformers.AutoConfig` reads back. Unknown architectures and malformed fields
raise ValueError naming the file and field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

ARCHITECTURES = {
    # model_type -> (HF architecture class name, qkv bias default, qk-norm)
    "llama": ("LlamaForCausalLM", False, False),
    "qwen2": ("Qwen2ForCausalLM", True, False),
    "qwen3": ("Qwen3ForCausalLM", False, True),
}
_ARCH_TO_TYPE = {v[0]: k for k, v in ARCHITECTURES.items()}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    model_type: str
    """One of "llama", "qwen2", "qwen3"."""
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
    attention_bias: bool = False
    """Bias on q/k/v projections (always on for Qwen2)."""
    mlp_bias: bool = False
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"

    def __post_init__(self):
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"model_type {self.model_type!r} is not supported (expected one of {sorted(ARCHITECTURES)})")
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
                raise ValueError(f"{where}: no such file")
            try:
                src = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
        return _from_hf_dict(src, where)

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that `transformers.AutoConfig.for_model` accepts."""
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
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
        return d


def _from_hf_dict(d: dict, where: str) -> ModelConfig:
    def need(key):
        if key not in d or d[key] is None:
            raise ValueError(f"{where}: missing required field {key!r}")
        return d[key]

    model_type = d.get("model_type")
    if model_type is None:
        archs = d.get("architectures") or []
        model_type = next((_ARCH_TO_TYPE[a] for a in archs if a in _ARCH_TO_TYPE), None)
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{where}: field 'model_type' is {model_type!r}; rlfuse supports {sorted(ARCHITECTURES)} "
                         f"(architectures {sorted(_ARCH_TO_TYPE)})")
    if d.get("use_sliding_window"):
        raise ValueError(f"{where}: field 'use_sliding_window' is true; sliding-window attention is not supported")
    n_heads = need("num_attention_heads")
    hidden = need("hidden_size")
    head_dim = d.get("head_dim") or (hidden // n_heads if isinstance(hidden, int) and isinstance(n_heads, int) else None)
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{where}: field 'rope_parameters' must be an object, got {type(rope).__name__}")
    rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"{where}: field 'rope_parameters.rope_type' is {rope_type!r}; supported: 'default', 'llama3'")
    if rope_type == "llama3":
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if k not in scaling:
                raise ValueError(f"{where}: llama3 rope scaling needs field 'rope_parameters.{k}'")
    _, bias_default, qk_norm = ARCHITECTURES[model_type]
    dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
    kw = dict(
        model_type=model_type,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_hidden_layers=need("num_hidden_layers"),
        num_attention_heads=n_heads,
        num_key_value_heads=d.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=None if rope_type == "default" else scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=True if model_type == "qwen2" else bool(d.get("attention_bias", False)),
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm=qk_norm,
        hidden_act=d.get("hidden_act", "silu"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
        torch_dtype=str(dtype).replace("torch.", ""),
    )
    try:
        return ModelConfig(**kw)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
