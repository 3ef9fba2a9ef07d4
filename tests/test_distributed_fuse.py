"""Fused projections under FSDP2 (rlfuse.model.fuse.fuse_gathered, GatheredSampler(fuse=True)),
CPU + gloo, 2 ranks, bf16 compute:
  * at each wake the gathered q/k/v and gate/up weights (a hybrid's linear-attention input
    projections too) become fused buffers (`is_fused`),
    FSDP's own gathered storage of those tensors is freed (no second copy), and the forward
    equals the one-process fused model's bitwise;
  * after sleep the groups are gone, the next wake fuses again with the new values (after an
    optimizer step), and the training forward (separate projections) equals the unsharded
    model's bitwise;
  * with `fuse_sharded` (rlfuse.model.fuse_sharded: what configure_fsdp(fuse=True) installs)
    the training forward runs each group joined from FSDP's gathered parts: live inside the
    layer's forward, not outside; fewer GEMMs forward and backward (counted); its output equals
    the one-process FUSED model's bitwise; the engine's wake/sleep puts the joined group back.
Run: python -m pytest -q tests/test_distributed_fuse.py
"""

from __future__ import annotations

import copy
from pathlib import Path
from unittest import mock

import pytest
import torch
from spawn_ranks import free_port, gloo_rank, run_ranks, spawn_ranks, torch_threads
from test_distributed_run import TOL, WEIGHT_TOL, _max_diff, _rows
from test_distributed_stream import GPU, GPU_MODEL, ROLLOUT
from torch.utils._python_dispatch import TorchDispatchMode
from train_setup import tiny_cfg

from rlfuse.kernels import use_backend
from rlfuse.model import CausalLM, ModelConfig, Packed, load_model
from rlfuse.model.fuse import fuse_projections, groups_of, is_fused
from rlfuse.model.fuse_sharded import JoinedLinear, fuse_sharded
from rlfuse.run.distributed import GatheredSampler
from rlfuse.run.distributed import context as D
from rlfuse.run.distributed import fsdp as fsdp_mod
from rlfuse.run.distributed.fsdp import ShardedAdamW, shard_model
from rlfuse.train.grpo import run_grpo
from rlfuse.train.ppo_critic import build_critic

CFG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
# layer 0 a Gated DeltaNet (its in_proj_qkv / z / b / a one group), layer 1 gated attention
HYBRID = ModelConfig(model_type="qwen3_5_text", vocab_size=64, hidden_size=32, intermediate_size=48,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                     max_position_embeddings=64, layer_types=("linear_attention", "full_attention"),
                     linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                     partial_rotary_factor=0.5)


class _Stub:
    """The engine's part of a sampler: wakes and sleeps, records whether it ran fused."""
    def __init__(self, model):
        self.model, self.seen = model, []

    def wake(self):
        self.seen.append(is_fused(self.model))

    def sleep(self):
        pass


class _CountGemms(TorchDispatchMode):
    """Counts the GEMMs (aten mm / addmm) dispatched inside the block, forward and backward."""
    GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in self.GEMMS
        return func(*args, **(kwargs or {}))


def _gemms_of_a_train_step(model, args) -> int:
    with _CountGemms() as count:
        model(*args).float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    return count.n


def _job(rank: int, port: int, out: str, hybrid: bool = False, joined: bool = False) -> None:
    cfg = HYBRID if hybrid else CFG
    torch.set_num_threads(1)
    env = {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    ctx = D.init_distributed(D.launch_env(env), device_type="cpu", timeout_s=60)
    ids = torch.tensor([3, 9, 17, 4, 60, 2, 33])
    args = (ids, torch.arange(len(ids)), Packed.from_lengths([len(ids)]))
    with use_backend("torch"), torch.no_grad():
        plain = CausalLM(cfg)
        plain.init_weights(generator=torch.Generator().manual_seed(0))
        plain = plain.to(torch.bfloat16)
        fused_ref = copy.deepcopy(plain)
        assert fuse_projections(fused_ref) == (3 if hybrid else 4)  # the hybrid's gated attention: no group
        want_fused, want_plain = fused_ref(*args), copy.deepcopy(plain)(*args)
        model = shard_model(plain, ctx)
        res = {}
        if joined:
            # GEMMs of one sharded training step, separate then joined (fuse_sharded installs the groups)
            with torch.enable_grad():
                sep_gemms = _gemms_of_a_train_step(model, args)
                res["joined_all_groups"] = fuse_sharded(model) == (3 if hybrid else 4)
                joined_gemms = _gemms_of_a_train_step(model, args)
            # a group of P projections: one GEMM forward and two backward (dx, dW) instead of P and
            # 2 P (qwen3: 2 layers x (q/k/v, gate/up) saves 2 x 3 x (2 + 1) = 18; the hybrid's
            # linear-attention group (4 parts) and 2 MLPs save 3 x (3 + 1 + 1) = 15)
            saved = 3 * sum(len(names) - 1 for m in model.modules() for _, names in groups_of(m))
            res["fewer_gemms"] = saved == (15 if hybrid else 18) and sep_gemms - joined_gemms == saved
            if rank == 0:
                print(f"GEMMs of a sharded training step ({'qwen3_5' if hybrid else 'qwen3'}): "
                      f"{sep_gemms} separate, {joined_gemms} joined")
            seen = []
            mixer0 = model.model.layers[0].linear_attn if hybrid else model.model.layers[0].self_attn
            group0 = "in_proj_fused" if hybrid else "qkv_fused"
            hook = mixer0.register_forward_pre_hook(
                lambda m, _: seen.append(isinstance(getattr(m, group0), JoinedLinear) and getattr(m, group0).live(m)))
            res["joined_forward_equals_fused"] = torch.equal(model(*args), want_fused)
            hook.remove()
            res["live_inside_forward_only"] = seen == [True] and not getattr(mixer0, group0).live(mixer0)
        sampler = GatheredSampler(model, lambda: _Stub(model), fuse=True)
        sampler.wake()
        assert is_fused(model)
        layer0 = model.model.layers[0]
        mixer, first, group = ((layer0.linear_attn, "in_proj_qkv", "in_proj_fused") if hybrid
                               else (layer0.self_attn, "q_proj", "qkv_fused"))
        w = getattr(mixer, first).weight
        res["buffer_is_the_weight"] = w.data_ptr() == getattr(mixer, group).weight.data_ptr()
        # FSDP2 internals (the test's only use): the all-gather outputs of the fused tensors are freed
        fused_mods = {getattr(m, n) for m in layer0.modules() for _, names in groups_of(m) for n in names}
        sizes = [(fp._module_info.module in fused_mods, fp.all_gather_outputs[0].untyped_storage().size())
                 for fp in layer0._get_fsdp_state()._fsdp_param_group.fsdp_params]
        res["own_storage_freed"] = (sum(f for f, _ in sizes) == (6 if hybrid else 5)
                                    and all(n == 0 for f, n in sizes if f)
                                    and all(n > 0 for f, n in sizes if not f))
        res["fused_equal"] = torch.equal(model(*args), want_fused)
        sampler.sleep()
        res["unfused_after_sleep"] = not is_fused(model)
        res["train_forward_equal"] = torch.equal(model(*args), want_fused if joined else want_plain)
        res["group_back_after_sleep"] = all(
            isinstance(getattr(m, attr), JoinedLinear) if joined else getattr(m, attr) is None
            for m in model.modules() for attr, _ in groups_of(m))
    with use_backend("torch"):  # one optimizer step, then the next wake fuses the new weights
        opt = ShardedAdamW(model, lr=1e-2, compute_dtype=torch.bfloat16)
        model(*args).float().square().mean().backward()
        opt.step(1e-2)
    with use_backend("torch"), torch.no_grad():
        sampler.wake()
        fused_now = model(*args)
        sampler.sleep()
        sep_now = model(*args)
        res["rewake_fused"] = sampler.inner.seen == [True, True]
        res["rewake_values_moved"] = not torch.equal(fused_now, want_fused)
        res["rewake_matches_separate"] = bool((fused_now.float() - sep_now.float()).abs().max() < 0.05)
    if joined:  # PPO's critic (sharded beside the policy) joins its groups too when the run fuses
        critic = build_critic(tiny_cfg(Path(out) / "ppo", "engine.fuse_projections=true"), model, dist=ctx)
        groups = [getattr(m, attr) for m in critic.modules() for attr, _ in groups_of(m)]
        res["critic_joined"] = len(groups) == (3 if hybrid else 4) and all(isinstance(g, JoinedLinear) for g in groups)
    torch.save(res, Path(out) / f"rank{rank}.pt")
    D.shutdown()


# separate_train (the training forwards left unjoined, as before fuse_sharded) is slow-only:
# joined_train covers the same wake / sleep / re-wake checks; ~9 s a case on 2 cores
@pytest.mark.parametrize("joined", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["separate_train", "joined_train"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["qwen3", "qwen3_5"])
def test_fused_projections_on_gathered_weights(tmp_path, hybrid, joined):
    spawn_ranks(_job, 2, free_port(), str(tmp_path), hybrid, joined)
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt")
        assert all(res.values()), (r, res)


# GRPO, exact numerics, fused projections: a one-process run (its engine fuses the model in
# place, so its training forwards are fused too) against 2 gloo ranks, whose training
# forwards join FSDP's gathered parts (`fuse_sharded`, installed by the session), and the
# same 2-rank run with the training forwards left separate (what ran before fuse_sharded).
GRPO_FUSED = ("grpo.kl_coef=0.05", "grpo.mu=2", "grpo.mini_batches=2", "checkpoint.save_final=true",
              "engine.fuse_projections=true", "engine.numerics=exact")


def _grpo_cfg(run_dir: Path, gpu: bool):
    if gpu:  # bf16 on CUDA, Triton's exact GEMMs at full tiles (tests/test_distributed_stream.py's GPU shape)
        return tiny_cfg(run_dir, *GRPO_FUSED, *GPU, "model.kernel_backend=auto", model={"random_init": GPU_MODEL})
    return tiny_cfg(run_dir, *GRPO_FUSED)


def _grpo_job(rank: int, port: int, out: str, gpu: bool = False) -> None:
    if gpu:
        env = {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        ctx = D.init_distributed(D.launch_env(env), device_type="cuda", timeout_s=300)
        D.quiet_non_main(ctx)
    else:
        ctx = gloo_rank(rank, 2, port)
    out = Path(out)
    installed = []

    def spy(model):  # the session's configure_fsdp(fuse=True) call
        installed.append(fuse_sharded(model))
        return installed[-1]

    with mock.patch.object(fsdp_mod, "fuse_sharded", spy):
        run_grpo(_grpo_cfg(out / "joined2", gpu), dist=ctx)
    torch.save(installed, out / f"installed{rank}.pt")
    with mock.patch.object(fsdp_mod, "fuse_sharded", lambda model: 0):  # the training forwards left separate
        run_grpo(_grpo_cfg(out / "separate2", gpu), dist=ctx)
    D.shutdown()


def _final_weights_diff(a: Path, b: Path) -> float:
    wa, wb = load_model(a / "final", dtype="float32"), load_model(b / "final", dtype="float32")
    return max(float((x - y).abs().max()) for x, y in zip(wa.state_dict().values(), wb.state_dict().values()))


@pytest.mark.slow  # one 2-rank job (2 runs) and a one-process run: ~11 s on 2 cores
def test_grpo_two_ranks_joined_training_matches_one_fused_process(tmp_path):
    with torch_threads(1):
        run_grpo(_grpo_cfg(tmp_path / "fused1", False))
        run_ranks(_grpo_job, 2, tmp_path, "GRPO (joined, separate)")
    for r in range(2):  # the session joined the policy's groups (the tiny model's q/k/v and gate/up), once
        installed = torch.load(tmp_path / f"installed{r}.pt")
        assert len(installed) == 1 and installed[0] > 0 and installed[0] % 2 == 0, installed
    one = _rows(tmp_path / "fused1")
    # the training path did change: the two 2-rank runs differ (by fp32 gradient rounding)
    assert _max_diff(_rows(tmp_path / "joined2"), _rows(tmp_path / "separate2"))[0] > 0
    for run in ("joined2", "separate2"):
        rows = _rows(tmp_path / run)
        grpo = [r for r in rows if r["stage"] == "grpo"]
        assert len(grpo) == 4
        # exact: rollout log-probs equal the trainer's bitwise on every step (ratio max 1)
        mismatch = [(r["mismatch/max_abs"], r["mismatch/kl_k3"], r["mismatch/ratio_max"]) for r in grpo]
        assert mismatch == [(0.0, 0.0, 1.0)] * 4, (run, mismatch)
        d, where = _max_diff(rows, one)
        dw = _final_weights_diff(tmp_path / run, tmp_path / "fused1")
        print(f"{run} vs one fused process: max |metric diff| {d:.2e} ({where}); final weights max |diff| {dw:.2e}")
        if run == "joined2":
            assert d <= TOL, where
            assert dw <= WEIGHT_TOL


@pytest.mark.gpu
def test_grpo_two_gpus_joined_training_bf16_exact(tmp_path):
    """2 GPUs (FSDP2, NCCL), bf16, exact numerics, fused projections: the 2-rank runs (joined
    and separate training forwards) against one fused process on one GPU. Mismatch 0 on every
    step; step 1 samples from the same bf16 weights, so its rollout equals the one process's;
    the step-1 loss and gradient norm and the final weights' differences are printed (bf16
    gradients summed across ranks round apart; no bound measured yet)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    run_grpo(_grpo_cfg(tmp_path / "fused1", True))
    spawn_ranks(_grpo_job, 2, free_port(), str(tmp_path), True)
    one = [r for r in _rows(tmp_path / "fused1") if r["stage"] == "grpo"]
    for r in range(2):
        assert torch.load(tmp_path / f"installed{r}.pt")[0] == 4  # 2 layers x (q/k/v, gate/up)
    for run in ("joined2", "separate2"):
        grpo = [r for r in _rows(tmp_path / run) if r["stage"] == "grpo"]
        assert len(grpo) == len(one) == 4
        assert all(r["mismatch/max_abs"] == 0.0 and r["mismatch/ratio_max"] == 1.0 for r in grpo), run
        assert {k: grpo[0].get(k) for k in ROLLOUT} == {k: one[0].get(k) for k in ROLLOUT}, run
        dw = _final_weights_diff(tmp_path / run, tmp_path / "fused1")
        print(f"{run} vs one fused process on GPU, step 1: loss {grpo[0]['loss']} vs {one[0]['loss']}, grad norm "
              f"{grpo[0]['grad_norm']} vs {one[0]['grad_norm']}; final weights max |diff| {dw:.2e}")
