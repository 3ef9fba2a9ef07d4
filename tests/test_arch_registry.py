"""The architecture registry (rlfuse/model/arch): docs/models.md is generated from it, the
config reads each family's switches from it, and a new family (here a made-up hybrid stack
with a linear-attention mixer and its own MLP) plugs in as one ArchSpec, with no change to
shared code. Run: python -m pytest -q tests/test_arch_registry.py"""

from pathlib import Path

import pytest
import torch
from torch import nn

from rlfuse.model import ARCHS, ArchSpec, CausalLM, ModelConfig, Packed
from rlfuse.model.arch.docs import render
from rlfuse.model.layers import MLP, Attention, Linear
from rlfuse.model.vision import VisionConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"
TINY = dict(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8)


def test_models_md_is_up_to_date():
    assert DOC.read_text() == render(), (
        "docs/models.md is out of date: run `python -m rlfuse.model.arch.docs > docs/models.md`")
    for k, s in ARCHS.items():
        assert f"| `{k}` | `{s.hf_class}` |" in DOC.read_text()


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_each_family_round_trips_through_its_switches(model_type):
    spec = ARCHS[model_type]
    moe = {"moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}} if spec.has_moe else {}
    if spec.has_vision:  # a vision tower writing into TINY's width, mRoPE over its head_dim / 2 = 4 frequencies
        moe["vision"] = VisionConfig(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                                     deepstack_visual_indexes=(0,) if model_type == "qwen3_vl" else (),  # Qwen3.5: none
                                     vision_start_token_id=11, vision_end_token_id=12,
                                     image_token_id=13, video_token_id=14)
        moe["mrope_section"] = (2, 1, 1)
    if spec.moe_shared_expert:  # Qwen3.5-MoE: a shared expert, the top-k weights always renormalized
        moe["moe"] |= {"shared_expert_intermediate_size": 8, "norm_topk_prob": True}
    tiny = TINY if spec.dense_mlp else {k: v for k, v in TINY.items() if k != "intermediate_size"}
    cfg = ModelConfig(model_type=model_type, **tiny, **moe)
    for f, v in spec.fixed.items():
        assert getattr(cfg, f) is v
    back = ModelConfig.from_hf(cfg.to_hf())
    assert back == cfg and back.architecture == spec.hf_class
    assert not any(f in cfg.to_hf() for f in spec.fixed if f != "qk_norm")  # hard-coded switches are not written


class ToyLinearAttention(nn.Module):
    """A stand-in token mixer with the mixer interface (not a real linear attention)."""

    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.in_proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x, positions, attn, inv_freq, cos_sin=None):
        return torch.tanh(self.in_proj(x))


def test_a_hybrid_family_is_one_spec(monkeypatch):
    hybrid = ArchSpec(model_type="toy_hybrid", hf_class="ToyHybridForCausalLM",
                      mixers={"full_attention": ("self_attn", Attention),
                              "linear_attention": ("linear_attn", ToyLinearAttention)},
                      mlp=lambda cfg, i: MLP(cfg),
                      layer_types=lambda cfg: ["linear_attention", "linear_attention", "linear_attention",
                                               "full_attention"][:cfg.num_hidden_layers],
                      fixed={"qk_norm": True})
    monkeypatch.setitem(ARCHS, "toy_hybrid", hybrid)
    cfg = ModelConfig(model_type="toy_hybrid", **TINY)
    model = CausalLM(cfg)
    names = set(model.state_dict())
    assert "model.layers.0.linear_attn.in_proj.weight" in names and "model.layers.3.self_attn.q_norm.weight" in names
    assert not any(n.startswith("model.layers.0.self_attn") for n in names)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    h = model(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 1, 2, 0, 1]), Packed.from_lengths([3, 2]))
    assert h.shape == (5, 16) and torch.isfinite(h).all()
    assert cfg.to_hf()["architectures"] == ["ToyHybridForCausalLM"]


def test_an_unknown_layer_type_is_refused(monkeypatch):
    monkeypatch.setitem(ARCHS, "toy_bad", ArchSpec(model_type="toy_bad", hf_class="ToyBad",
                                                   mixers={"full_attention": ("self_attn", Attention)},
                                                   mlp=lambda cfg, i: MLP(cfg),
                                                   layer_types=lambda cfg: ["mamba"] * cfg.num_hidden_layers))
    with pytest.raises(ValueError, match=r"ToyBad: layer 0 has layer type 'mamba'; this architecture builds "
                                         r"\['full_attention'\]"):
        CausalLM(ModelConfig(model_type="toy_bad", **TINY))
