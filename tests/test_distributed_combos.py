"""The combinations each tested alone elsewhere, data-parallel on CPU (gloo, 2 processes)
against one process: issue 39's "every trainer and rollout kind under torchrun" crossed with
the new architectures (issues 36 and 40).

One spawned 2-rank job (`_job`) runs, each (but DPO) with engine.numerics exact and the
log-prob mismatch checked at every step:
  * `vl_full`: GRPO on image rows with the tiny Qwen3.5-VL of tests/test_qwen3_5_vl_train.py
    (hybrid text tower: one Gated DeltaNet layer, one gated attention), full fine-tune with
    the vision tower trained: every decoder layer (the linear-attention one too) an FSDP2
    group, the tower its own group;
  * `vl_lora`: the same with LoRA (base replicated, the tower frozen);
  * `moe_lora`: GRPO on the tiny Qwen3-MoE of tests/test_distributed_moe_train.py with LoRA on
    the attention, the dense projections and, per expert, the routed experts (`lora.experts`);
  * `moe_ppo`: PPO on that MoE (policy and critic FSDP2-sharded, 2 mini-batches: a rank
    pads with zero-weight micro-batches, whose routing loads must not count);
  * `moe_dpo`: DPO on that MoE (sharded, the reference log-probs precomputed);
  * `hybrid_lora`, `hybrid_ppo`: GRPO with LoRA and PPO on the 2-layer Qwen3.5 hybrid text
    model of tests/test_qwen3_5.py.
After each run every rank saves its adapters (LoRA runs). This process runs the same
recipes in one process and checks: every logged metric within TOL, the final weights (full
fine-tune: the exported folders; LoRA: the adapters) within WEIGHT_TOL
(tests/test_distributed_run.py explains both bounds), the mismatch 0 at every step (the
logged value is the max over ranks), the two ranks' adapters bitwise equal (also verified
inside the job by `check_replicas`, a ValueError on every rank otherwise).
Not compared: moe/aux_loss and moe/z_loss (split-dependent by design:
tests/test_distributed_moe_train.py), the timings and memory, critic/update_ratio (the
sharded optimizer does not measure it).
Run: python -m pytest -q -m slow tests/test_distributed_combos.py -s   (-s prints the differences)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spawn_ranks import gloo_rank, run_ranks, torch_threads
from test_distributed_kinds import TIMED, _weights_diff, adapters_on_ranks, save_adapters
from test_distributed_moe_train import MOE_MODEL, ROUTER_LOSSES
from test_distributed_run import NOT_COMPARED, TOL, WEIGHT_TOL, _max_diff
from test_qwen3_5 import TINY_HYBRID
from test_qwen3_5_vl_train import _cfg as _vl_cfg
from test_vision_train import _parity
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from train_setup import tiny_cfg

from rlfuse.run.config import replace
from rlfuse.run.distributed import context as D
from rlfuse.run.metrics import read_metrics
from rlfuse.train import open_session, run_grpo
from rlfuse.train.dpo import run_dpo
from rlfuse.train.ppo import run_ppo

WORLD = 2
EXACT = ("engine.numerics=exact", "grpo.check_every=1", "checkpoint.save_final=true", "engine.fuse_projections=false",
         "model.kernel_backend=auto")
LORA = "model.lora={rank: 4, alpha: 8}"
PPO = {"steps": 2, "prompts_per_step": 4, "samples_per_prompt": 2, "max_new_tokens": 3, "mini_batches": 2,
       "critic_lr": 1e-2, "kl_coef": 0.1, "micro_batch_tokens": 24}


def _vl(run_dir: Path, **over):
    return replace(_vl_cfg(run_dir), **{"data.eval_size": 4, "grpo.eval_every": 0, "checkpoint.save_final": True,
                                        **over})


def _text(model: dict, *over: str, **sections):
    return lambda run_dir: tiny_cfg(run_dir, *EXACT, "grpo.steps=2", *over, model={"random_init": model}, **sections)


RUNS = {  # name -> (trainer, run_dir -> config)
    "vl_full": (run_grpo, lambda d: _vl(d, **{"model.train_vision": True})),
    "vl_lora": (run_grpo, lambda d: _vl(d, **{"model.lora": {"rank": 4, "alpha": 8}})),
    "moe_lora": (run_grpo, _text(MOE_MODEL, "model.lora={rank: 4, alpha: 8, experts: true}")),
    "moe_ppo": (run_ppo, _text(MOE_MODEL, ppo=PPO)),
    "moe_dpo": (run_dpo, _text(MOE_MODEL, "dpo.steps=2", "dpo.batch_size=6", "dpo.micro_batch_tokens=40",
                               data={"train": "builtin:arithmetic_pref", "train_size": 40, "eval_size": 4},
                               rewards=[{"name": "arithmetic"}])),
    "hybrid_lora": (run_grpo, _text(TINY_HYBRID, LORA)),
    "hybrid_ppo": (run_ppo, _text(TINY_HYBRID, ppo=PPO)),
}
STAGE = {"moe_ppo": "ppo", "hybrid_ppo": "ppo", "moe_dpo": "dpo"}


def _is_lora(name: str) -> bool:
    return name.endswith("_lora")


def _run(out: Path, name: str, ctx=None) -> None:
    n = 1 if ctx is None else ctx.world_size
    trainer, cfg = RUNS[name]
    cfg = cfg(out / f"{name}{n}")
    ses = open_session(cfg, dist=ctx, reward_functions={"parity": _parity} if name.startswith("vl") else None)
    if ctx is not None and not _is_lora(name):
        _check_sharded(ses.model)
    before = {k: p.detach().clone() for k, p in ses.model.named_parameters()} if ctx is None else None
    res = trainer(cfg, session=ses)
    if before is not None:  # what trains moved, what is frozen did not (the 2 ranks' weights match these)
        after = dict(res["model"].named_parameters())
        moved = {k for k, p in before.items() if not torch.equal(p, after[k])}
        assert moved, name
        if name.startswith("vl"):
            assert any(k.startswith("visual.") for k in moved) == (name == "vl_full"), name
    if _is_lora(name):
        save_adapters(ctx, res["model"], out, f"{name}{n}")


def _check_sharded(model) -> None:
    """Every decoder layer (Gated DeltaNet ones too) an FSDP2 group of dim-0 shards; a vision
    tower its own group."""
    groups = [*model.model.layers, *([model.visual] if getattr(model, "visual", None) is not None else [])]
    assert all(isinstance(m, FSDPModule) for m in groups)
    for m in groups:
        assert all(isinstance(p, DTensor) and p.placements[0].is_shard(0) for p in m.parameters())
    if model.config.is_hybrid:
        assert "linear_attn" in {layer.mixer_name for layer in model.model.layers}


def _job(rank: int, port: int, out: str) -> None:
    ctx = gloo_rank(rank, WORLD, port)
    for name in RUNS:
        _run(Path(out), name, ctx)
    D.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_combos")
    with torch_threads(1):
        for name in RUNS:
            _run(out, name)
        run_ranks(_job, WORLD, out, "combination")
    return out


def _rows(run_dir: Path) -> list[dict]:
    skip = (*NOT_COMPARED, *TIMED, *ROUTER_LOSSES, "critic/update_ratio")
    return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in read_metrics(run_dir)]


@pytest.mark.slow  # one 2-rank job (7 runs) and seven one-process runs: ~50 s on 2 cores
@pytest.mark.parametrize("name", list(RUNS))
def test_combination_on_two_ranks_matches_one_process(runs, name):
    two, one = _rows(runs / f"{name}2"), _rows(runs / f"{name}1")
    steps = [r for r in two if r["stage"] == STAGE.get(name, "grpo")]
    assert len(steps) == 2
    d, where = _max_diff(two, one)
    if _is_lora(name):
        a1, a2, dw = adapters_on_ranks(runs, name, WORLD)
        assert any(float(t.abs().max()) > 0 for k, t in a2[0].items() if k.endswith("lora_B"))  # they trained
        if name == "moe_lora":
            assert any(".experts." in k for k in a1)  # per-expert adapters
    else:
        dw = _weights_diff(runs / f"{name}2", runs / f"{name}1")
    print(f"{name}: 2 ranks vs 1 process, max |metric diff| {d:.2e} ({where}); final weights {dw:.2e}")
    assert d <= TOL, where
    assert dw <= WEIGHT_TOL
    for r in steps:
        assert r["grad_norm"] > 0, r
        if name != "moe_dpo":  # DPO samples nothing
            assert r["mismatch/max_abs"] == 0.0, r  # exact numerics: 0 on every rank (max over ranks)
        if name.startswith("vl"):
            assert r["vision/encodes"] == 4.0, r  # 4 prompts' images, each encoded once, over both ranks
        if name.startswith("moe") and "moe/routing_mismatch" in r:
            assert r["moe/routing_mismatch"] == 0.0, r
