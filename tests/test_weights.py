"""Checkpoint save/load and config validation.

  * save -> load round trip is bitwise (single file, sharded with a tiny max_shard_bytes,
    and a bf16 save of an fp32 model equals the fp32 model cast to bf16);
  * what we save loads in `transformers` and gives the same fp32 logits;
  * tokenizer side files travel with `save_model(tokenizer_dir=...)`;
  * load errors name the tensor (missing, unexpected, wrong shape), config errors name
    the field (unknown model_type, missing hidden_size, bad rope type) and the file.
Run: python -m pytest -q tests/test_weights.py
"""

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_hf import FAMILIES, hf_config, rel_err

from rlfuse.kernels import use_backend
from rlfuse.model import CausalLM, ModelConfig, Packed, load_model, save_model


def _ours(family, seed=0) -> CausalLM:
    cfg = ModelConfig.from_hf(hf_config(family).to_dict())
    model = CausalLM(cfg)
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # non-trivial norms and biases, so a swapped tensor shows
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _assert_same_params(a: CausalLM, b: CausalLM):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert sorted(pa) == sorted(pb)
    for name in pa:
        assert pa[name].dtype == pb[name].dtype and torch.equal(pa[name], pb[name]), name


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_exact(family, tmp_path):
    model = _ours(family)
    save_model(model, tmp_path / "ckpt")
    back = load_model(tmp_path / "ckpt")  # dtype from the saved config: the parameters' float32
    assert back.config.torch_dtype == "float32"
    assert back.config == dataclasses.replace(model.config, torch_dtype="float32")
    _assert_same_params(model, back)


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_round_trip_loads_in_transformers(family, tmp_path):
    model = _ours(family, seed=3)
    folder = save_model(model, tmp_path / "ckpt", max_shard_bytes=16 * 1024)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((folder / s).exists() for s in shards)
    assert not (folder / "model.safetensors").exists()
    _assert_same_params(model, load_model(folder))

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert hf.dtype == torch.float32
    ids = torch.randint(0, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), use_backend("torch"):
        ours = model.logits(model(ids, torch.arange(9), Packed.from_lengths([9])))
        theirs = hf(input_ids=ids[None]).logits[0]
    assert rel_err(ours, theirs) < 1e-5


def test_save_in_bf16_equals_cast(tmp_path):
    model = _ours("qwen3")
    save_model(model, tmp_path / "ckpt", dtype="bfloat16")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_model(tmp_path / "ckpt")
    _assert_same_params(model.to(torch.bfloat16), back)


def test_save_overwrites_and_copies_tokenizer_files(tmp_path):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    (tok_dir / "generation_config.json").write_text('{"eos_token_id": [2, 5]}')
    save_model(_ours("llama", seed=1), tmp_path / "ckpt")
    model = _ours("llama", seed=2)
    save_model(model, tmp_path / "ckpt", tokenizer_dir=tok_dir)  # replaces the first save
    _assert_same_params(model, load_model(tmp_path / "ckpt"))
    assert json.loads((tmp_path / "ckpt" / "generation_config.json").read_text())["eos_token_id"] == [2, 5]
    assert (tmp_path / "ckpt" / "tokenizer_config.json").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


@pytest.fixture
def saved(tmp_path):
    folder = save_model(_ours("qwen2"), tmp_path / "ckpt")
    return folder, load_file(folder / "model.safetensors")


def test_missing_tensor_is_named(saved):
    folder, sd = saved
    del sd["model.layers.1.self_attn.k_proj.bias"]
    save_file(sd, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors.*model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(folder)


def test_unexpected_tensor_is_named(saved):
    folder, sd = saved
    sd["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    save_file(sd, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected tensors.*model\.layers\.0\.mlp\.extra\.weight"):
        load_model(folder)


def test_wrong_shape_is_named(saved):
    folder, sd = saved
    sd["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 64)
    save_file(sd, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight.*\(3, 64\)"):
        load_model(folder)


def _hf_dict(**change):
    d = hf_config("llama").to_dict()
    for k, v in change.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


@pytest.mark.parametrize("change,field", [
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "model_type"),
    (dict(hidden_size=None), "hidden_size"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope_type"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}), "low_freq_factor"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
])
def test_config_errors_name_the_field(change, field, tmp_path):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(_hf_dict(**change))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_hf_dict(**change)))
    with pytest.raises(ValueError, match=str(path)):  # the file is named too
        ModelConfig.from_hf(tmp_path)


def test_config_bad_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json.*not valid JSON"):
        load_model(tmp_path)


_SMALL = dict(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, max_position_embeddings=64)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_without_norm_or_bias_flags_round_trips(family, tmp_path):
    """qk_norm and attention_bias left out follow the architecture, so what is saved loads back
    (in our loader and in transformers) as the same model."""
    model = CausalLM(ModelConfig(model_type=family, **_SMALL))
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_model(model, tmp_path / "m")
    back = load_model(tmp_path / "m")
    assert back.config == dataclasses.replace(model.config, torch_dtype="float32")
    _assert_same_params(model, back)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert sorted(n for n, _ in hf.named_parameters()) == sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("family,field,value", [("qwen3", "qk_norm", False), ("llama", "qk_norm", True),
                                                ("qwen2", "qk_norm", True), ("qwen2", "attention_bias", False),
                                                ("qwen3", "mlp_bias", True)])
def test_config_outside_the_architecture_is_refused(family, field, value):
    with pytest.raises(ValueError, match=rf"config field '{field}' is {value}, but \w+ForCausalLM always has "
                                         rf"{field} = {not value} \(transformers has no switch"):
        ModelConfig(model_type=family, **_SMALL, **{field: value})


def test_config_to_hf_round_trip():
    for family in FAMILIES:
        cfg = ModelConfig.from_hf(hf_config(family).to_dict())
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg
        back = transformers.AutoConfig.for_model(**cfg.to_hf())
        assert ModelConfig.from_hf(back.to_dict()) == cfg
