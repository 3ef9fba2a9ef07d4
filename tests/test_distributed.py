"""Data-parallel FSDP2 training on CPU (gloo, 2 processes) against one process.

One spawned 2-rank job (`_job`) checks, on a tiny random Qwen3-style model (tied LM head),
for compute dtypes fp32 and bf16:
  * three optimizer steps (GRPO seq-mean, SFT token-mean, DAPO token-level losses; global
    batch of 8 sequences split 4 / 4, micro-batched by tokens so the ranks run different
    numbers of real micro-batches and pad with zero-weight ones; clipping active) equal
    the one-process step (plain CausalLM + MasterAdamW + rlfuse clip) on the same global
    batch: losses, grad norms and fp32 masters within TOL (measured numbers are printed);
  * the gathered compute weights are bitwise identical on both ranks after every step,
    and an engine-style forward (`model.forward` inside `gathered_weights`, the first call
    on a freshly sharded model) equals the one-process forward;
  * per-rank bytes of params / grads / optimizer state are half the one-process bytes
    (up to one row per tensor from uneven dim-0 shards);
  * DCP save, reload into a fresh sharded model at the same N, one more step: bitwise the
    same as not stopping; `fail_together` raises on both ranks with rank 1's message;
  * the whole training state gathered to rank 0 in the one-process form
    (`full_adamw_state`, PPO's critic) and sharded again into a fresh model: bitwise;
  * ReplicatedAdamW (LoRA): `grads()` sums every rank's gradients once (a parameter only
    one rank has a gradient for gets it, one no rank has stays None; fp32 accumulation of
    a bf16 parameter), and `check_replicas` stops both ranks when one rank's copy differs.
Then, in this process (no process group): the 2-rank checkpoint loads into an unsharded
model + torch AdamW (resharding 2 -> 1) with weights and optimizer state bitwise equal to
the 2-rank run's, and the rank-0 HF export loads with rlfuse.model.load_model.
Run: python -m pytest -q tests/test_distributed.py -s   (-s prints the measured differences)
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from spawn_ranks import free_port, spawn_ranks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from rlfuse.kernels import use_backend
from rlfuse.kernels.loss.logprob import token_logprobs
from rlfuse.kernels.loss.policy import accumulation_weight, policy_loss
from rlfuse.model import CausalLM, ModelConfig, load_model
from rlfuse.run.batching import PackedBatch, pack_by_tokens
from rlfuse.run.distributed import context as D
from rlfuse.run.distributed import dcp as DCP
from rlfuse.run.distributed import fsdp as FS
from rlfuse.run.distributed.replicated import ReplicatedAdamW, check_replicas
from rlfuse.run.optim import MasterAdamW
from rlfuse.run.optim import clip_grad_norm_ as clip_one_process

WORLD = 2
LR, MAX_NORM = 1e-2, 0.5
ADAM = dict(lr=LR, weight_decay=0.1, eps=1e-8)
BUDGET = 20  # micro-batch token budget: 2-4 micro-batches per rank, unequal counts at every step
STEPS = ("grpo", "sft", "dapo")
# What differs between 2 ranks and 1 process on the same micro-batches: the order of the
# fp32 gradient sums (one process adds micro-batch gradients in order; 2 ranks add each
# micro-batch index across ranks in the reduce-scatter, then accumulate) and the grad-norm
# partial sums. Measured (print with -s): gradients differ by <= 2.1e-6 of max|g| in fp32
# and <= 1e-9 in bf16 (sums of a few bf16 numbers are mostly exact in fp32); losses and
# norms by <= 3.3e-7 relative. Adam turns a gradient difference into
# lr * dg / (|g| + eps): large only where |g| is itself at the rounding level of its sum,
# measured max |master diff| 1.0e-6 = 1e-4 lr (fp32) and 1.2e-7 (bf16) after 3 steps.
# Bounds, ~10x the measurements:
TOL = dict(grad=1e-5, loss=1e-6, master=1e-3 * LR)
CFG = dict(model_type="qwen3", vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
           qk_norm=True, tie_word_embeddings=True)


def _model(dtype) -> CausalLM:
    m = CausalLM(ModelConfig(**CFG))
    m.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))  # large std: non-trivial gradients
    return m.to(dtype)


def _batch(step: int):
    """Global batch of step `step`: 8 (ids, n_ctx, advantage, old log-probs) with fixed seeds."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(8):
        n = int(torch.randint(6, 13, (1,), generator=g))
        ids = torch.randint(0, CFG["vocab_size"], (n,), generator=g).tolist()
        n_ctx = int(torch.randint(2, 5, (1,), generator=g))
        adv = float(torch.randn((), generator=g))
        old = -3.0 + 0.3 * torch.randn(n - n_ctx, generator=g)
        out.append((ids, n_ctx, adv, old))
    return out


def _micro_batches(seqs, world: int) -> list[list[int]]:
    """The micro-batches (indices into seqs) of `world` ranks, each packing its contiguous
    share by BUDGET, in rank order. The one-process reference uses world=2 too: the same
    micro-batches, so bf16 per-micro-batch gradients are the same tensors and only the
    order of the fp32 sums differs (N ranks packing differently from one process is a
    packing difference, like changing micro_batch_tokens, not a distributed one)."""
    k = len(seqs) // world
    return [[r * k + i for i in mb] for r in range(world)
            for mb in pack_by_tokens([len(s[0]) for s in seqs[r * k:(r + 1) * k]], BUDGET)]


def _accumulate(model, seqs, kind: str, totals: tuple[float, float], mbs, n_micro: int | None = None) -> float:
    """Backward of the step's loss over micro-batches `mbs` of `seqs`, each weighted by
    its share of the GLOBAL totals (sequences, target tokens); `n_micro` pads with
    zero-weight micro-batches (a real sequence, loss x 0) up to that count, as every rank
    must run the same number of forward/backward passes. Returns this process's share
    of the loss."""
    total_seqs, total_tok = totals
    mbs = list(mbs) + [None] * ((n_micro or len(mbs)) - len(mbs))
    loss_sum = 0.0
    for mb in mbs:
        chosen = [seqs[i] for i in (mb if mb is not None else [0])]
        batch = PackedBatch.build([(ids, c) for ids, c, _, _ in chosen], "cpu")
        h = model(batch.input_ids, batch.positions, batch.attn)
        logp = token_logprobs(h[batch.rows], model.lm_head_weight, batch.targets)
        ntok = float(batch.targets.numel())
        if kind == "sft":
            loss = -logp.sum() / total_tok
        else:
            old = torch.cat([o for _, _, _, o in chosen])
            adv = torch.cat([torch.full((len(ids) - c,), a) for ids, c, a, _ in chosen])
            loss, _ = policy_loss(logp, old, adv, torch.ones_like(logp), batch.seq_ids, batch.num_seqs,
                                  loss_type=kind)
            loss = loss * accumulation_weight(kind, len(chosen), ntok, int(total_seqs), total_tok)
        if mb is None:
            loss = loss * 0.0
        loss.backward()
        loss_sum += float(loss.detach())
    return loss_sum


def _totals(seqs) -> tuple[float, float]:
    return float(len(seqs)), float(sum(len(ids) - c for ids, c, _, _ in seqs))


def _reference(dtype):
    """One process: plain CausalLM + MasterAdamW on the whole global batch."""
    model = _model(dtype)
    opt = MasterAdamW(model.parameters(), **ADAM)
    rows = []
    for step, kind in enumerate(STEPS):
        seqs = _batch(step)
        loss = _accumulate(model, seqs, kind, _totals(seqs), _micro_batches(seqs, WORLD))
        grads = {n: g.clone() for (n, _), g in zip(model.named_parameters(), opt.grads())}
        norm = clip_one_process(opt.grads(), MAX_NORM)
        opt.step(LR)
        opt.zero_grad()
        masters = {n: w.detach().clone() for (n, _), w in zip(model.named_parameters(), opt.master)}
        rows.append(dict(loss=loss, norm=float(norm), masters=masters, grads=grads,
                         params={n: p.detach().clone() for n, p in model.named_parameters()}))
    return rows


def _full(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _same_on_all_ranks(tensors: dict[str, torch.Tensor]) -> bool:
    """Bitwise: every rank's tensors equal rank 0's."""
    mine = {n: t.detach().view(torch.uint8) if t.dtype != torch.bfloat16 else t.detach().view(torch.int16)
            for n, t in tensors.items()}
    allr = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(allr, mine)
    return all(torch.equal(a[n], allr[0][n]) for a in allr for n in mine)


def _dp_step(ctx, model, opt, step: int, kind: str):
    seqs = _batch(step)
    mine = D.local_slice(seqs, ctx, what="global batch")
    totals = D.global_sums(ctx, _totals(mine))
    mbs = _micro_batches(mine, 1)
    n_local = len(mbs)
    n_micro = D.max_across_ranks(ctx, n_local)
    loss = _accumulate(model, mine, kind, tuple(totals), mbs, n_micro)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    norm = FS.clip_grad_norm_(model.parameters(), MAX_NORM)
    mem = FS.memory_bytes(model, opt, compute_dtype=torch.float32)
    FS.set_lr(opt, LR)
    opt.step()
    mem["optimizer"] = FS.memory_bytes(model, opt, compute_dtype=torch.float32)["optimizer"]
    opt.zero_grad(set_to_none=True)
    m = {"loss": loss, "grad_norm": norm}
    m["padded_ranks"] = float(n_local < n_micro)
    m = D.reduce_metrics(ctx, m, ops={"loss": "sum", "padded_ranks": "sum"})
    return m, mem, n_micro, grads


def _job(rank: int, port: int, out_dir: str):
    torch.set_num_threads(1)
    env = {"WORLD_SIZE": str(WORLD), "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    ctx = D.init_distributed(D.launch_env(env), device_type="cpu", timeout_s=60)
    report = {}
    try:
        with use_backend("torch"):
            # a raising rank: every rank gets RankFailed with rank 1's message
            try:
                with D.fail_together(ctx, "score"):
                    if ctx.rank == 1:
                        raise ValueError("reward function failed on sample 3")
                raise AssertionError("fail_together did not raise")
            except D.RankFailed as e:
                assert str(e) == "score: rank 1 raised ValueError: reward function failed on sample 3", str(e)
            with D.fail_together(ctx, "data"):  # no failure: no raise
                pass
            for dtype in (torch.float32, torch.bfloat16):
                report[str(dtype)] = _check_dtype(ctx, dtype, out_dir)
            _check_replicated(ctx)
    finally:
        D.shutdown()
    if rank == 0:
        with open(os.path.join(out_dir, "report.json"), "w") as f:
            json.dump(report, f, indent=1)


def _check_dtype(ctx, dtype, out_dir: str) -> dict:
    name = str(dtype).replace("torch.", "")
    ref = _reference(dtype) if ctx.is_main else None
    n_params = sum(p.numel() for p in _model(dtype).parameters())
    model = FS.shard_model(_model(dtype), ctx)
    opt = FS.sharded_adamw(model, **ADAM)
    rows = []
    for step, kind in enumerate(STEPS):
        if step == 2:  # checkpoint before the last step; resumed below
            ckpt = os.path.join(out_dir, f"ckpt_{name}")
            DCP.save_sharded(ctx, ckpt, model, opt)
            _save_full(ctx, model, opt, os.path.join(out_dir, f"full_at_ckpt_{name}.pt"))
        m, mem, n_micro, grads = _dp_step(ctx, model, opt, step, kind)
        with FS.gathered_weights(model):
            gathered = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert all(p.dtype == dtype and not isinstance(p, torch.distributed.tensor.DTensor)
                   for p in gathered.values())
        assert _same_on_all_ranks(gathered), f"{name} step {step}: gathered weights differ across ranks"
        full = _full(model)
        # memory: the shards of each rank add up to the whole, each about 1/N of it
        sizes = [None] * WORLD
        torch.distributed.all_gather_object(sizes, mem)
        mib = FS.log_memory(ctx, model, opt, compute_dtype=dtype)  # max over ranks
        assert mib["memory/params_mib"] == max(s["params"] for s in sizes) / 2**20
        assert mib["memory/gathered_mib"] == n_params * dtype.itemsize / 2**20
        n_tensors = len(list(model.parameters()))
        row_bytes = sum(4 * (p.numel() // p.shape[0]) for p in model.parameters())  # one dim-0 row each
        for key, whole, rows_per_tensor in (("params", 4 * n_params, 1), ("grads", 4 * n_params, 1),
                                            ("optimizer", 8 * n_params, 2)):
            extra = 4 * n_tensors if key == "optimizer" else 0  # AdamW's fp32 step counter, on every rank
            per_rank = [s[key] - extra for s in sizes]
            assert sum(per_rank) == whole, (key, per_rank, whole)
            assert max(per_rank) <= whole / WORLD + rows_per_tensor * row_bytes, (key, per_rank, whole)
        if ctx.is_main:
            r = ref[step]
            gmax = max(float(g.abs().max()) for g in r["grads"].values())
            dg = max(float((grads[n] - r["grads"][n]).abs().max()) for n in grads) / gmax
            dm = max(float((full[n] - r["masters"][n]).abs().max()) for n in full)
            dl = abs(m["loss"] - r["loss"]) / abs(r["loss"])
            dn = abs(m["grad_norm"] - r["norm"]) / r["norm"]
            flips = sum(int((gathered[n] != r["params"][n]).sum()) for n in gathered)
            rows.append(dict(step=step, loss=kind, n_micro=n_micro, padded_ranks=m["padded_ranks"], d_master=dm,
                             rel_d_loss=dl, rel_d_norm=dn, rel_d_grad=dg, compute_weights_differing=flips,
                             grad_norm=r["norm"], mem=sizes))
            print(f"[{name}] step {step} {kind}: max|grad diff|/max|grad| {dg:.2e}, max|master diff| {dm:.2e}, "
                  f"rel loss diff {dl:.2e}, rel grad-norm diff {dn:.2e}, "
                  f"compute weights differing {flips}/{n_params}", flush=True)
            assert r["norm"] > MAX_NORM, "clipping must be active for the test to cover it"
            assert dg <= TOL["grad"] and dm <= TOL["master"] and dl <= TOL["loss"] and dn <= TOL["loss"], rows[-1]
        if step == 1:
            before_last = {k: v.clone() for k, v in full.items()}
    final = full

    # resume at the same N: a fresh sharded model whose first call is the engine-style one
    model2 = FS.shard_model(_model(dtype), ctx)
    opt2 = FS.sharded_adamw(model2, **ADAM)
    DCP.load_sharded(ckpt, model2, opt2)
    assert all(torch.equal(before_last[n], t) for n, t in _full(model2).items())
    batch = PackedBatch.build([(ids, c) for ids, c, _, _ in _batch(0)], "cpu")
    with torch.no_grad(), FS.gathered_weights(model2):
        h_engine = model2.forward(batch.input_ids, batch.positions, batch.attn)
        lm_head_is_gathered = model2.lm_head_weight.dtype == dtype
    assert lm_head_is_gathered
    if ctx.is_main:  # the same weights in one process give the same hidden states, bitwise
        plain = _model(dtype)
        with torch.no_grad():
            for n, p in plain.named_parameters():
                p.copy_(before_last[n])
            assert torch.equal(plain(batch.input_ids, batch.positions, batch.attn), h_engine)
    _dp_step(ctx, model2, opt2, 2, STEPS[2])
    assert all(torch.equal(final[n], t) for n, t in _full(model2).items()), "resume at the same N is not exact"

    # the whole state in the one-process form on rank 0 (PPO's critic), then sharded again
    weights, sd = DCP.full_adamw_state(model, opt, dtype)
    got = [weights, sd]
    torch.distributed.broadcast_object_list(got, src=0)  # as state.pt: every rank reads the same file
    model3 = FS.shard_model(_model(dtype), ctx)
    opt3 = FS.sharded_adamw(model3, **ADAM)
    DCP.load_full_adamw_state(model3, opt3, *got)
    assert all(torch.equal(final[n], t) for n, t in _full(model3).items())
    assert got[1]["step"] == len(STEPS) and (got[1]["master"][0] is None) == (dtype == torch.float32)
    for p, p3 in zip(model.parameters(), model3.parameters()):
        assert all(torch.equal(opt.state[p][k].full_tensor(), opt3.state[p3][k].full_tensor())
                   for k in ("exp_avg", "exp_avg_sq"))

    _save_full(ctx, model, opt, os.path.join(out_dir, f"final_{name}.pt"))
    DCP.save_hf_export(ctx, model, os.path.join(out_dir, f"hf_{name}"), dtype=dtype)
    return rows


def _check_replicated(ctx) -> None:
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (3, 2, 2))
    d = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    opt = ReplicatedAdamW([a, b, c, d], ctx, lr=0.1)
    a.grad = torch.tensor([1.0, 2.0, 3.0]) * (ctx.rank + 1)
    if ctx.rank == 1:
        b.grad = torch.tensor([5.0, 7.0])
    (d.float() * torch.tensor([0.5, 0.25]) * (ctx.rank + 1)).sum().backward()  # hook: into the fp32 buffer
    for _ in range(2):  # the second call must not sum again
        grads = opt.grads()
        assert [g.tolist() for g in grads] == [[3.0, 6.0, 9.0], [5.0, 7.0], [1.5, 0.75]], grads
        assert c.grad is None and grads[2].dtype == torch.float32
    opt.step()
    opt.zero_grad()
    lin = torch.nn.Linear(2, 2, bias=False)
    torch.nn.init.constant_(lin.weight, 0.5)
    check_replicas(ctx, lin, "same")  # equal: no error
    if ctx.rank == 1:
        with torch.no_grad():
            lin.weight[0, 0] += 1e-7
    with pytest.raises(ValueError, match="replicated weights differ"):
        check_replicas(ctx, lin, "checkpoint step 3")


def _save_full(ctx, model, opt, path: str) -> None:
    """Rank 0 saves the gathered fp32 weights and optimizer state (what the parent compares)."""
    sd_model, sd_optim = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
    if ctx.is_main:
        torch.save({"model": sd_model, "optim": sd_optim}, path)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    spawn_ranks(_job, WORLD, free_port(), str(out))
    return out


def test_two_ranks_match_one_process_and_resume_exactly(job):
    """The checks run inside the ranks (asserts there fail the spawn); here: they all ran,
    and the zero-weight micro-batch padding was needed at least once."""
    report = json.loads((job / "report.json").read_text())
    assert set(report) == {"torch.float32", "torch.bfloat16"}
    for rows in report.values():
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert any(r["padded_ranks"] > 0 for r in rows)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_rank_checkpoint_loads_in_one_process(job, dtype):
    """Resharding 2 -> 1: DCP load without a process group into an unsharded fp32 model and
    torch AdamW gives the 2-rank run's weights and optimizer state at the save, bitwise."""
    expect = torch.load(job / f"full_at_ckpt_{dtype}.pt", weights_only=False)
    model = _model(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), **ADAM, foreach=False)
    DCP.load_sharded(job / f"ckpt_{dtype}", model, opt)
    sd_model, sd_optim = get_state_dict(model, opt)
    assert set(sd_model) == set(expect["model"]) and set(sd_optim["state"]) == set(expect["optim"]["state"])
    for n, t in expect["model"].items():
        assert torch.equal(sd_model[n], t), n
    for n, st in expect["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(sd_optim["state"][n][k]), torch.as_tensor(v)), (n, k)
    assert float(expect["optim"]["state"]["model.norm.weight"]["step"]) == 2.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rank0_hf_export_loads(job, dtype):
    expect = torch.load(job / f"final_{dtype}.pt", weights_only=False)["model"]
    loaded = load_model(job / f"hf_{dtype}", dtype=dtype)
    assert loaded.lm_head_weight.dtype == getattr(torch, dtype)
    for n, p in loaded.named_parameters():
        assert torch.equal(p, expect[n].to(p.dtype)), n


def test_launch_env_and_local_slice():
    """No process group needed: torchrun's variables parsed into a LaunchEnv, user errors."""
    assert D.launch_env({}) is None  # plain single-process run
    env = {"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert D.launch_env(env) == D.LaunchEnv(rank=2, world_size=4, local_rank=0, master_addr="node0",
                                            master_port=29500, use_agent_store=True)
    with pytest.raises(ValueError, match="RANK=4 must be in"):
        D.launch_env({**env, "RANK": "4"})
    with pytest.raises(ValueError, match="MASTER_PORT='x' is not an integer"):
        D.launch_env({**env, "MASTER_PORT": "x"})
    with pytest.raises(ValueError, match="LOCAL_RANK is not"):
        D.launch_env({k: v for k, v in env.items() if k != "LOCAL_RANK"})

    class Ctx:  # local_slice reads rank and world_size only
        rank, world_size = 1, 3

    assert D.local_slice(list(range(6)), Ctx, what="grpo.prompts_per_step") == [2, 3]
    with pytest.raises(ValueError, match=r"grpo.prompts_per_step = 7 must be a multiple of the number of ranks \(3\)"):
        D.local_slice(list(range(7)), Ctx, what="grpo.prompts_per_step")
