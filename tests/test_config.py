"""Typed configs: YAML recipes, --set overrides, unknown keys, round trip, built-in recipes."""

from pathlib import Path

import pytest
import yaml

from rlfuse.run.config.io import apply_override, describe, replace, to_dict
from rlfuse.run.config.run_config import RunConfig, load_config, save_config

RECIPES = Path(__file__).resolve().parents[1] / "rlfuse" / "recipes"


def test_overrides_are_typed():
    cfg = load_config(None, ["grpo.clip_high=0.28", "grpo.steps=7", "grpo.dual_clip=3", "optim.betas=[0.9, 0.95]",
                             "model.path=/x/y", "grpo.mask_truncated=true", "data.task={digits: 3}"])
    assert cfg.grpo.clip_high == 0.28 and cfg.grpo.steps == 7 and cfg.grpo.dual_clip == 3.0
    assert cfg.optim.betas == (0.9, 0.95) and cfg.model.path == "/x/y" and cfg.grpo.mask_truncated is True
    assert cfg.data.task == {"digits": 3}
    # YAML 1.1 reads 1e-3 (no dot) as a string; a float field still takes it
    cfg = load_config(None, ["optim.lr=1e-3", "grpo.clip_high=2E-1"])
    assert cfg.optim.lr == 1e-3 and cfg.grpo.clip_high == 0.2
    with pytest.raises(ValueError, match=r"optim.lr: expected a number, got 'fast'"):
        load_config(None, ["optim.lr=fast"])


def test_unknown_key_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown key 'clip_hi' in grpo; valid keys: .*clip_high"):
        load_config(None, ["grpo.clip_hi=0.3"])
    with pytest.raises(ValueError, match=r"unknown key 'grp'; valid keys: model, engine"):
        load_config(None, ["grp.steps=3"])


def test_yaml_unknown_key_and_bad_type_name_the_field(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("grpo:\n  stepz: 3\n")
    with pytest.raises(ValueError, match=r"r.yaml: grpo.stepz: unknown key; valid keys of grpo: steps"):
        load_config(p)
    p.write_text("grpo:\n  steps: three\n")
    with pytest.raises(ValueError, match=r"grpo.steps: expected an integer, got 'three'"):
        load_config(p)
    p.write_text("rewards:\n  - {name: arithmetic, wieght: 2}\n")
    with pytest.raises(ValueError, match=r"rewards\[0\].wieght: unknown key"):
        load_config(p)


def test_choices_are_checked():
    with pytest.raises(ValueError, match="grpo.loss_type must be one of"):
        load_config(None, ["grpo.loss_type=ppo"])
    with pytest.raises(ValueError, match="grpo.cispo_clip_low applies to grpo.loss_type cispo only"):
        load_config(None, ["grpo.cispo_clip_low=true"])
    with pytest.raises(ValueError, match="grpo.kl_ratio .* gspo"):
        load_config(None, ["grpo.kl_ratio=true", "grpo.loss_type=gspo"])
    assert load_config(None, ["grpo.cispo_clip_low=true", "grpo.loss_type=cispo"]).grpo.cispo_clip_low
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        load_config(None, ["grpo.group_size=1"])
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        apply_override({}, "grpo.steps", RunConfig)


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["grpo.clip_high=0.28", "rewards=[{name: format, weight: 0.5}]", "optim.betas=[0.8, 0.9]"])
    path = save_config(cfg, tmp_path / "config.yaml")
    assert load_config(path) == cfg
    assert yaml.safe_load(path.read_text())["grpo"]["clip_high"] == 0.28


def test_replace_dotted_and_validates():
    cfg = replace(RunConfig(), **{"grpo.steps": 3, "rewards": [{"name": "arithmetic"}]})
    assert cfg.grpo.steps == 3 and cfg.rewards[0].name == "arithmetic"
    with pytest.raises(ValueError, match="expected an integer"):
        replace(cfg, **{"grpo.steps": "x"})


def test_describe_lists_every_leaf_with_docs():
    lines = describe(RunConfig)
    assert any(ln.startswith("grpo.clip_high (float, default 0.2)") for ln in lines)
    assert any(ln.startswith("grpo.loss_type") and "dr_grpo" in ln for ln in lines)
    assert len(lines) == len(set(lines)) > 60


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_builtin_recipes_load(recipe):
    cfg = load_config(RECIPES / recipe)
    assert cfg.rewards, "every recipe names its reward functions"
    assert to_dict(cfg)["grpo"]["loss_type"] in ("grpo", "dapo", "dr_grpo", "gspo", "cispo")


def test_engine_section_is_a_typed_engine_config(tmp_path):
    from rlfuse.engine import EngineConfig

    cfg = load_config(None, ["engine.max_num_seqs=8", "engine.cuda_graph_batch_sizes=[4, 1]"])
    assert isinstance(cfg.engine, EngineConfig)
    assert cfg.engine.max_num_seqs == 8 and cfg.engine.cuda_graph_batch_sizes == (1, 4)
    assert load_config(save_config(cfg, tmp_path / "c.yaml")) == cfg
    with pytest.raises(ValueError, match=r"unknown key 'max_seqs' in engine; valid keys: block_size, max_num_seqs"):
        load_config(None, ["engine.max_seqs=8"])
    p = tmp_path / "r.yaml"
    p.write_text("engine:\n  max_seqs: 8\n")
    with pytest.raises(ValueError, match=r"engine.max_seqs: unknown key; valid keys of engine: block_size"):
        load_config(p)
    # the engine's own checks name the section
    with pytest.raises(ValueError, match=r"engine.block_size must be a power of two"):
        load_config(None, ["engine.block_size=24"])
    assert any(ln.startswith("engine.max_num_seqs (int, default 256): Most sequences") for ln in describe(RunConfig))


def test_a_runs_config_yaml_loads_back_from_anywhere(tmp_path, monkeypatch):
    """Issue 37: paths given relative to where the command ran were re-read relative to the
    run folder (`rlfuse eval runs/my_grpo/config.yaml` looked for runs/my_grpo/vowels_train.jsonl,
    then runs/my_grpo/runs/my_sft/final). config.yaml now holds them resolved."""
    from rlfuse.api.config import load_run_config
    from rlfuse.run.config import save_config
    from rlfuse.run.folder import config_changes

    work = tmp_path / "work"
    (work / "runs" / "my_sft" / "final").mkdir(parents=True)
    (work / "vowels_train.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    (work / "tools.py").write_text("")
    monkeypatch.chdir(work)
    cfg = load_config(None, ["data.train=vowels_train.jsonl", "model.path=runs/my_sft/final",
                             "model.random_init=null", "logging.run_dir=runs/my_grpo",
                             "rollout.tools=[calculator, tools.py:lookup]"])
    saved = save_config(cfg, work / "runs" / "my_grpo" / "config.yaml")
    for cwd in (work, tmp_path):  # where the run started, and elsewhere
        monkeypatch.chdir(cwd)
        back = load_run_config(str(saved.relative_to(cwd)) if cwd == work else str(saved))
        assert back.data.train == str(work / "vowels_train.jsonl") and Path(back.data.train).is_file()
        assert back.model.path == str(work / "runs" / "my_sft" / "final")
        assert back.rollout.tools == ["calculator", f"{work / 'tools.py'}:lookup"]
    monkeypatch.chdir(work)
    assert config_changes(yaml.safe_load(saved.read_text()), cfg) == []  # --resume with the relative config
