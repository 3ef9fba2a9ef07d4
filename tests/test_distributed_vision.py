"""Image rows data-parallel on CPU (gloo, 2 processes, the tiny Qwen3-VL of
tests/test_vision_train.py on builtin:count_squares) against one process.

One spawned 2-rank job (`_job`) runs:
  * GRPO, full fine-tune with the vision tower trained (`model.train_vision`), exact
    numerics, the mismatch checked every step: the tower is its own FSDP2 group (the
    trainer encodes images before the root's forward), its gradients reduce-scattered like
    the layers';
  * GRPO with LoRA (a replica on every rank, the tower frozen); the ranks' adapters bitwise
    equal (`check_replicas`);
  * SFT and DPO on image rows, the tower trained (tests/test_vision_dpo.py's preference rows).
Each rank's engine encodes the images of its own prompts; `vision/encodes` is summed over
ranks. This process runs the same in one process and checks: every logged metric within
TOL (tests/test_distributed_run.py explains the bound), vision/encodes included; the final
weights (tower included) within WEIGHT_TOL; mismatch 0 at every step on every rank; in one
process, the tower moved where it trains and not under LoRA.
Run: python -m pytest -q -m slow tests/test_distributed_vision.py -s   (-s prints the differences)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from spawn_ranks import gloo_rank, run_ranks, torch_threads
from test_distributed_kinds import TIMED, _weights_diff, adapters_on_ranks, save_adapters
from test_distributed_run import TOL, WEIGHT_TOL, _max_diff
from test_vision_dpo import _cfg as _dpo_cfg
from test_vision_dpo import _rows as _pref_rows
from test_vision_train import _cfg, _parity

from rlfuse.data.tasks import rows_alphabet
from rlfuse.run import build_tokenizer
from rlfuse.run.config import replace
from rlfuse.run.distributed import context as D
from rlfuse.run.metrics import read_metrics
from rlfuse.train import open_session, run_grpo, run_sft
from rlfuse.train.dpo import run_dpo

WORLD = 2
COMMON = {"data.eval_size": 4, "grpo.eval_every": 0, "checkpoint.save_final": True}
RUNS = {  # name -> (trainer, the base config of run_dir, overrides)
    "full": (run_grpo, _cfg, {"model.train_vision": True}),
    "lora": (run_grpo, _cfg, {"model.lora": {"rank": 4, "alpha": 8}}),
    "sft": (run_sft, _cfg, {"model.train_vision": True, "sft.max_seq_len": 48}),
    # 10 pairs: 5 a rank
    "dpo": (run_dpo, lambda run_dir: replace(_dpo_cfg(run_dir.parent), **{"logging.run_dir": str(run_dir)}),
            {"model.train_vision": True}),
}
STAGE = {"full": "grpo", "lora": "grpo"}
# DPO with the tower trained: 8.5e-6 here, and 1.7e-5 (1.7e-3 x lr) with another char vocabulary
# (the rows' image paths in the alphabet), in the tower's merger weights and an MLP: Adam's
# lr * dg / |g| on elements whose gradient is at the rounding level of its per-rank regrouped sum
# (tests/test_distributed_run.py's WEIGHT_TOL assumes 1e-3 x lr; docs/distributed.md, "Equivalence")
WEIGHT_BOUND = {"dpo": 3 * WEIGHT_TOL}


def _run(out: Path, name: str, ctx=None) -> None:
    n = 1 if ctx is None else ctx.world_size
    trainer, base, over = RUNS[name]
    cfg = replace(base(out / f"{name}{n}"), **COMMON, **over)
    tok = None
    if name == "dpo":  # the char alphabet of the rows' text: their image paths (the tmp folder's name) left out
        rows = [json.loads(x) for x in (out / "pref.jsonl").read_text().splitlines()]
        tok = build_tokenizer(cfg.model, rows_alphabet([{k: v for k, v in r.items() if k != "images"} for r in rows]))
    ses = open_session(cfg, dist=ctx, tokenizer=tok, reward_functions={"parity": _parity}, need_target=name == "sft")
    tower0 = [p.detach().clone() for p in ses.model.visual.parameters()] if ctx is None else None
    res = trainer(cfg, session=ses)
    if tower0 is not None:  # the tower trains or stays frozen (LoRA); the 2 ranks' weights match these
        moved = any(not torch.equal(a, b) for a, b in zip(tower0, res["model"].visual.parameters()))
        assert moved == (name != "lora"), name
    if name == "lora":
        save_adapters(ctx, res["model"], out, f"lora{n}")


def _job(rank: int, port: int, out: str) -> None:
    ctx = gloo_rank(rank, WORLD, port)
    for name in RUNS:
        _run(Path(out), name, ctx)
    D.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_vision")
    _pref_rows(out)  # out / pref.jsonl
    with torch_threads(1):
        for name in RUNS:
            _run(out, name)
        run_ranks(_job, WORLD, out, "vision")
    return out


def _rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMED)} for r in read_metrics(run_dir)]


@pytest.mark.slow  # one 2-rank job (4 runs) and four one-process runs: ~35 s on 2 cores
@pytest.mark.parametrize("name", list(RUNS))
def test_images_on_two_ranks_match_one_process(runs, name):
    two, one = _rows(runs / f"{name}2"), _rows(runs / f"{name}1")
    steps = [r for r in two if r["stage"] == STAGE.get(name, name)]
    assert len(steps) == 2
    d, where = _max_diff(two, one)
    dw = adapters_on_ranks(runs, "lora", WORLD)[2] if name == "lora" else _weights_diff(runs / f"{name}2", runs / f"{name}1")
    print(f"vision {name}: 2 ranks vs 1 process, max |metric diff| {d:.2e} ({where}); final weights {dw:.2e}")
    assert d <= TOL, where
    assert dw <= WEIGHT_BOUND.get(name, WEIGHT_TOL)
    for r in steps:
        assert r["grad_norm"] > 0, r
        if name not in STAGE:
            continue
        assert r["vision/encodes"] == 4.0, r  # 4 prompts' images, each encoded once, over both ranks
        assert r["mismatch/max_abs"] == 0.0, r
