"""LoRA in the trainers (model.lora): every trainer (SFT, GRPO with a KL term, DPO, PPO)
trains the adapters only -- the base stays bitwise unchanged, the optimizer holds state
for A and B alone, the LoRA metrics are logged, the checkpoint holds adapter/ and no
model/; the KL / DPO reference is the base (adapters off); a LoRA run resumed from a
checkpoint continues bitwise like the uninterrupted one; the config section reads from
YAML and --set, and names its field in errors; `rlfuse eval` takes a LoRA checkpoint.
Run: python -m pytest -q tests/test_lora_train.py
"""

import json

import pytest
import torch
from train_setup import tiny_cfg, tiny_recipe, tiny_session

from rlfuse.cli import main
from rlfuse.model.lora import LoRAConfig, adapters_off, has_lora, lora_parameters
from rlfuse.run import checkpoint as ck
from rlfuse.run.config import replace
from rlfuse.run.config.docs import render
from rlfuse.train.dpo import run_dpo
from rlfuse.train.grpo import run_grpo
from rlfuse.train.loop import reference_model
from rlfuse.train.ppo import run_ppo
from rlfuse.train.sft import run_sft

LORA = "model.lora={rank: 4, alpha: 8}"
_CLOCK = ("time/", "tokens_per_s", "memory/")
RUNS = {
    "sft": (run_sft, True, ()),
    "grpo": (run_grpo, False, ("grpo.kl_coef=0.1",)),
    "dpo": (run_dpo, False, ("dpo.steps=3", "dpo.batch_size=6")),
    "dpo_live": (run_dpo, False, ("dpo.steps=3", "dpo.batch_size=6", "dpo.reference=live")),
    "ppo": (run_ppo, False, ("ppo.steps=2", "ppo.prompts_per_step=4", "ppo.samples_per_prompt=2",
                             "ppo.max_new_tokens=3", "ppo.kl_coef=0.1")),
}


def _cfg(tmp_path, kind, *over):
    sections = {}
    if kind.startswith("dpo"):
        sections = dict(data={"train": "builtin:arithmetic_pref", "train_size": 40}, rewards=[{"name": "arithmetic"}])
    return tiny_cfg(tmp_path, LORA, "checkpoint.save_final=true", *RUNS[kind][2], *over, **sections)


@pytest.mark.parametrize("kind", list(RUNS))
def test_every_trainer_trains_the_adapters_only(tmp_path, kind):
    run, need_target, _ = RUNS[kind]
    cfg = _cfg(tmp_path, kind)
    ses = tiny_session(cfg, need_target)
    assert has_lora(ses.model)
    base = {n: p.detach().clone() for n, p in ses.model.named_parameters() if ".lora_" not in n}
    res = run(cfg, session=ses)
    model = res["model"]
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if ".lora_" not in n)
    assert any(p.abs().sum() > 0 for n, p in lora_parameters(model) if n.endswith("lora_B"))  # B left zero
    last = ck.latest(tmp_path)
    assert (last / "adapter" / "adapter_model.safetensors").is_file() and not (last / "model").exists()
    opt = torch.load(last / "optimizer.pt", weights_only=False)
    assert [t.shape for t in opt["exp_avg"]] == [p.shape for _, p in lora_parameters(model)]
    assert (tmp_path / "final" / "adapter_config.json").is_file()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["stage"] == kind.removesuffix("_live")]
    assert trained and all(r["lora/trainable_params"] == sum(p.numel() for _, p in lora_parameters(model))
                           and r["lora/saved_train_state_gib"] > 0 for r in trained)


def test_the_reference_is_the_base_model():
    """KL and DPO reference of a LoRA model: the model itself with its adapters off."""
    cfg = tiny_cfg("/tmp/unused", LORA)
    ses = tiny_session(cfg)
    with torch.no_grad():
        for _, p in lora_parameters(ses.model):
            p.normal_(0, 0.5)
    ref = reference_model(ses.model)
    ids = torch.arange(6)
    from rlfuse.model import Packed
    attn = Packed.from_lengths([6])
    with torch.no_grad(), adapters_off(ses.model):
        want = ses.model(ids, torch.arange(6), attn)
    with torch.no_grad():
        assert torch.equal(ref(ids, torch.arange(6), attn), want)
        assert not torch.equal(ses.model(ids, torch.arange(6), attn), want)


def _rows(run_dir, stage):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(_CLOCK)} for r in rows if r["stage"] == stage}


def test_lora_resume_continues_bitwise(tmp_path):
    extra = ("grpo.kl_coef=0.1", "checkpoint.every=2", "model.dtype=bfloat16")
    full = tiny_cfg(tmp_path / "full", LORA, *extra)
    a = run_grpo(full, session=tiny_session(full))["model"]
    part = tiny_cfg(tmp_path / "part", LORA, *extra)
    run_grpo(part, session=tiny_session(part), stop_after=2)
    resumed = tiny_cfg(tmp_path / "part", LORA, *extra, "checkpoint.resume=auto")
    b = run_grpo(resumed, session=tiny_session(resumed))["model"]
    ra, rb = _rows(tmp_path / "full", "grpo"), _rows(tmp_path / "part", "grpo")
    assert ra[3] == rb[3] and ra[4] == rb[4]
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(lora_parameters(a), lora_parameters(b)))
    assert all(p.dtype == torch.bfloat16 for p in b.parameters())
    # a checkpoint of full weights does not resume into a LoRA run, and the other way round
    plain = tiny_cfg(tmp_path / "part", *extra, "checkpoint.resume=auto")
    with pytest.raises(ck.CheckpointError, match="holds a LoRA adapter, but the run has no model.lora"):
        run_grpo(plain, session=tiny_session(plain))


def test_config_section(tmp_path):
    cfg = tiny_cfg(tmp_path, "model.lora.rank=8", "model.lora.targets=[q_proj, v_proj]")
    assert cfg.model.lora == LoRAConfig(rank=8, targets=("q_proj", "v_proj"))
    assert tiny_cfg(tmp_path, "model.lora={}").model.lora == LoRAConfig()
    assert tiny_cfg(tmp_path).model.lora is None
    assert replace(cfg, **{"model.lora": None}).model.lora is None
    with pytest.raises(ValueError, match=r"model\.lora\.rank must be a positive integer, got 0"):
        tiny_cfg(tmp_path, "model.lora.rank=0")
    with pytest.raises(ValueError, match=r"unknown key 'ranks' in model.lora; valid keys: rank, alpha"):
        tiny_cfg(tmp_path, "model.lora.ranks=8")
    page = render()
    assert "| `model.lora.rank` | `int` | `16` |" in page and "| `model.lora` |" in page


def test_eval_cli_takes_a_lora_checkpoint(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path / "r.yaml", model={"lora": {"rank": 4}})
    rc = main(["grpo", str(recipe), "--set", f"logging.run_dir={tmp_path / 'run'}", "--set",
               "checkpoint.save_final=true"])
    assert rc == 0, capsys.readouterr().err
    for ckpt in (tmp_path / "run" / "final", ck.latest(tmp_path / "run")):
        rc = main(["eval", str(recipe), "--checkpoint", str(ckpt), "--set", f"logging.run_dir={tmp_path / 'ev'}",
                   "--limit", "4"])
        assert rc == 0, capsys.readouterr().err
        res = json.loads((tmp_path / "ev" / "eval.json").read_text())
        assert res["adapter"].startswith(str(ckpt)) and res["num_problems"] == 4


def test_export_merged_writes_an_hf_folder_with_the_adapters_logits(tmp_path):
    """model.lora.export_merged: beside the PEFT folder final/, final_merged/ is an HF folder
    that plain transformers loads with the logits of base + adapter (PEFT's and ours)."""
    import peft
    import transformers
    from test_model import _hf_logits, _ours_logits, _seqs
    from tiny_hf import rel_err

    from rlfuse.kernels import use_backend
    from rlfuse.model.weights import save_model

    cfg = tiny_cfg(tmp_path / "run", LORA, "model.lora.export_merged=true")
    model = run_sft(cfg, session=tiny_session(cfg, True))["model"]
    final, merged = tmp_path / "run" / "final", tmp_path / "run" / "final_merged"
    assert (final / "adapter_config.json").is_file() and (merged / "config.json").is_file()
    assert not (merged / "adapter_config.json").exists()
    save_model(model, tmp_path / "base")  # the frozen base alone (adapters are no part of an HF checkpoint)
    seqs = _seqs(model.config.vocab_size, seed=3)
    with torch.no_grad(), use_backend("torch"):
        ours = _ours_logits(model, seqs)
        with adapters_off(model):
            base = _ours_logits(model, seqs)
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        got = _hf_logits(load(merged, dtype=torch.float32).eval(), seqs)
        with_peft = _hf_logits(peft.PeftModel.from_pretrained(load(tmp_path / "base", dtype=torch.float32),
                                                              final).eval(), seqs)
    assert rel_err(got, with_peft) < 1e-5 and rel_err(got, ours) < 1e-5  # fp32: as tests/test_lora.py
    assert rel_err(ours, base) > 1e-3  # the trained adapter changes the logits
    from rlfuse.api.models import resolve_model_folder
    with pytest.raises(ValueError, match=r"is a LoRA adapter .*--adapter .*final, or the merged model .*final_merged"):
        resolve_model_folder(tmp_path / "run")  # e.g. `rlfuse generate RUN`: both ways out are named
    # without the key, no merged folder
    plain = tiny_cfg(tmp_path / "plain", LORA, "sft.steps=1")
    run_sft(plain, session=tiny_session(plain, True))
    assert (tmp_path / "plain" / "final" / "adapter_config.json").is_file()
    assert not (tmp_path / "plain" / "final_merged").exists()
