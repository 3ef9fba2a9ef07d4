"""A transformer trunk with a scalar head: reward models and PPO critics.

`ScalarHeadModel` is `CausalLM`'s trunk (same parameter names, same forward to final
hidden states) with HF's `*ForSequenceClassification` head in place of the LM head:
    score = Linear(D, num_labels, bias=False)        named `score.weight`, (num_labels, D)
so a Llama / Qwen2 / Qwen3 sequence-classification checkpoint (`model.*` + `score.weight`)
loads 1:1 (`load_scalar_head_model`). Two readouts of the head:
  * `token_values(h_ND)`: one scalar per hidden row (a PPO critic's V(s_t));
  * `sequence_scores(input_ids, attn)`: per packed sequence, the head at its last token
    whose id is not pad_token_id -- HF's pooling rule (`(arange(S) * (ids != pad)).argmax()`:
    the rightmost non-pad token, position 0 when every token is pad). A sequence that ends
    in EOS with EOS == pad is therefore scored at the token before the EOS, as in HF.

Shape legend: T packed tokens, B sequences, N rows, D hidden, L num_labels.
Test: python -m pytest -q tests/test_reward_model.py
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from rlfuse.kernels.backend import use_settings
from rlfuse.model.causal_lm import CausalLM
from rlfuse.model.config import TEXT_TOWERS, ModelConfig
from rlfuse.model.layers import Linear, Packed
from rlfuse.model.weights import hf_parameters, load_state_dict_from_files, parse_dtype

log = logging.getLogger(__name__)


class ScalarHeadModel(CausalLM):
    """Trunk + `score` head; `forward` still returns final hidden states (T, D)."""

    def __init__(self, cfg: ModelConfig, num_labels: int = 1):
        super().__init__(cfg)  # the architecture's trunk (dense or hybrid: `rlfuse.model.arch`)
        self.lm_head = None  # the head is `score` (HF *ForSequenceClassification has no lm_head)
        self.num_labels = num_labels
        self.score = Linear(cfg.hidden_size, num_labels, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        raise TypeError("a ScalarHeadModel has no LM head (its head is `score`)")

    @property
    def device(self) -> torch.device:
        return self.score.weight.device

    def token_values(self, hidden_ND: torch.Tensor) -> torch.Tensor:
        """(N, D) hidden rows -> (N,) fp32 scalars (num_labels must be 1)."""
        if self.num_labels != 1:
            raise ValueError(f"token_values needs a single-output head, this one has num_labels={self.num_labels}")
        with use_settings(self.kernels):
            return self.score(hidden_ND).float().squeeze(-1)

    def sequence_scores(self, input_ids_T: torch.Tensor, attn: Packed) -> torch.Tensor:
        """Packed sequences -> (B, num_labels) fp32 head outputs at each one's last non-pad token."""
        _, positions_T = _packed_index(attn.cu_seqlens, input_ids_T.shape[0])
        h_TD = self.forward(input_ids_T, positions_T, attn)
        rows = last_non_pad_rows(input_ids_T, attn.cu_seqlens, self.config.pad_token_id)
        with use_settings(self.kernels):
            return self.score(h_TD[rows]).float()

    @torch.no_grad()
    def init_head_(self, std: float = 0.0, generator: torch.Generator | None = None) -> None:
        """Reset `score` to normal(0, std) (0: all zeros, i.e. every output starts at 0)."""
        if std == 0.0:
            self.score.weight.zero_()
        else:
            self.score.weight.normal_(0.0, std, generator=generator)

    @classmethod
    def from_causal_lm(cls, lm: CausalLM) -> "ScalarHeadModel":
        """A critic initialized from a policy: a copy of its trunk (not shared), zero head.
        A policy's LoRA adapters are not copied: the critic starts from the base trunk."""
        ref = lm.model.embed_tokens.weight
        with torch.device("meta"):
            out = cls(lm.config).to(ref.dtype)
        out = out.to_empty(device=ref.device)
        with torch.no_grad():
            for (name, p), (src_name, q) in zip(out.model.named_parameters(), hf_parameters(lm.model), strict=True):
                assert name == src_name, (name, src_name)
                p.copy_(q)
        out.init_head_()
        out.kernels = lm.kernels
        return out


def _packed_index(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_T, pos_T): each packed row's sequence and its position within it."""
    starts = cu_seqlens[:-1].long()
    seq_T = torch.repeat_interleave(torch.arange(len(starts), device=cu_seqlens.device),
                                    cu_seqlens.diff().long(), output_size=T)
    return seq_T, torch.arange(T, device=cu_seqlens.device) - starts[seq_T]


def last_non_pad_rows(input_ids_T: torch.Tensor, cu_seqlens: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """(B,) int64 packed row of each sequence's last token != pad_token_id (HF's rule; the
    sequence's first row when all are pad; its last row when pad_token_id is None)."""
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    if pad_token_id is None:
        return ends - 1
    seq_T, local_T = _packed_index(cu_seqlens, input_ids_T.shape[0])
    keyed = local_T * (input_ids_T != pad_token_id)  # 0 at pad tokens, like HF's token_indices * non_pad_mask
    best = torch.zeros(len(starts), dtype=torch.long, device=input_ids_T.device).scatter_reduce_(
        0, seq_T, keyed, reduce="amax")
    return starts + best


def _num_labels(d: dict, where: str) -> int:
    if "num_labels" in d:
        n = d["num_labels"]
    elif isinstance(d.get("id2label"), dict):
        n = len(d["id2label"])
    else:
        n = 2  # transformers' PretrainedConfig default when neither field is written
        log.info("%s: no 'num_labels' or 'id2label'; num_labels = 2 (the transformers default)", where)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{where}: field 'num_labels' is {n!r}; expected a positive integer")
    return n


def load_scalar_head_model(folder: str | Path, *, device: str | torch.device = "cpu",
                           dtype: str | torch.dtype | None = None, head: str = "required") -> ScalarHeadModel:
    """Load an HF folder as a ScalarHeadModel. head="required": a *ForSequenceClassification
    checkpoint (its `score` head is loaded); head="zero": a causal-LM checkpoint's trunk (its
    lm_head ignored) with a fresh zero single-output head, or a classification checkpoint
    with its head (how a PPO critic starts from a policy or a reward model)."""
    folder = Path(folder)
    cfg = ModelConfig.from_hf(folder)
    raw = json.loads((folder / "config.json").read_text())
    if cfg.vision is not None and raw.get("model_type") in TEXT_TOWERS:
        # scores and values read text (PPO's prompts are text): a Qwen3.5 VLM folder's text tower alone
        cfg = ModelConfig.from_hf(folder, text_only=True)
    where = str(folder / "config.json")
    archs = raw.get("architectures") or []
    is_cls = any(str(a).endswith("ForSequenceClassification") for a in archs)
    if head not in ("required", "zero"):
        raise ValueError(f"head must be 'required' or 'zero', got {head!r}")
    if not is_cls and head == "required":
        raise ValueError(f"{where}: field 'architectures' is {archs!r}; a reward model must be a "
                         f"*ForSequenceClassification checkpoint (LlamaForSequenceClassification, "
                         f"Qwen2ForSequenceClassification, Qwen3ForSequenceClassification)")
    num_labels = _num_labels(raw, where) if is_cls else 1
    dtype = parse_dtype(dtype or cfg.torch_dtype)
    with torch.device("meta"):
        model = ScalarHeadModel(cfg, num_labels).to(dtype)
    model = model.to_empty(device=device)
    if is_cls:
        load_state_dict_from_files(model, folder)
    else:
        model.score.weight.data.zero_()
        _load_trunk(model, folder)
    log.info("loaded %s trunk (%d layers) + score head (%d outputs%s) from %s to %s in %s", cfg.model_type,
             cfg.num_hidden_layers, num_labels, "" if is_cls else ", zero-initialized", folder, device, dtype)
    return model.eval()


def _load_trunk(model: ScalarHeadModel, folder: Path) -> None:
    """The `model.*` tensors of a causal-LM checkpoint into `model` (its lm_head is not ours)."""
    score = model.score
    model.score = None  # so load_state_dict_from_files neither expects nor finds `score.weight`
    try:
        load_state_dict_from_files(model, folder)
    finally:
        model.score = score
