"""Fused projections under FSDP2 (rlfuse.model.fuse.fuse_gathered, GatheredSampler(fuse=True)),
CPU + gloo, 2 ranks, bf16 compute:
  * at each wake the gathered q/k/v and gate/up weights (a hybrid's linear-attention input
    projections too) become fused buffers (`is_fused`),
    FSDP's own gathered storage of those tensors is freed (no second copy), and the forward
    equals the one-process fused model's bitwise;
  * after sleep the groups are gone, the next wake fuses again with the new values (after an
    optimizer step), and the training forward (separate projections) equals the unsharded
    model's bitwise.
Run: python -m pytest -q tests/test_distributed_fuse.py
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from spawn_ranks import free_port, spawn_ranks

from rlfuse.kernels import use_backend
from rlfuse.model import CausalLM, ModelConfig, Packed
from rlfuse.model.fuse import fuse_projections, groups_of, is_fused
from rlfuse.run.distributed import GatheredSampler
from rlfuse.run.distributed import context as D
from rlfuse.run.distributed.fsdp import ShardedAdamW, shard_model

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


def _job(rank: int, port: int, out: str, hybrid: bool = False) -> None:
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
        sampler = GatheredSampler(model, lambda: _Stub(model), fuse=True)
        res = {}
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
        res["train_forward_equal"] = torch.equal(model(*args), want_plain)
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
    torch.save(res, Path(out) / f"rank{rank}.pt")
    D.shutdown()


@pytest.mark.parametrize("hybrid", [False, True], ids=["qwen3", "qwen3_5"])
def test_fused_projections_on_gathered_weights(tmp_path, hybrid):
    spawn_ranks(_job, 2, free_port(), str(tmp_path), hybrid)
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt")
        assert all(res.values()), (r, res)
