"""The engine on a hybrid model (Qwen3.5: Gated DeltaNet + gated full attention): the
linear-attention layers' per-sequence state (rlfuse/engine/cache/linear.py) under continuous
batching, chunked prefill, preemption and groups; greedy generation equals the naive
generator, and in exact numerics every rollout log-prob equals the trainer's bitwise.
Decoding crosses 64-token chunk boundaries (prompts of 70 tokens), where S_c moves on.
Run: python -m pytest -q tests/test_engine_hybrid.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import one_thread, random_prompts  # noqa: F401  (fixture)
from tiny_hf import tiny_hybrid_model

from rlfuse.consistency.check import default_sweep, run_setting, trainer_logprobs
from rlfuse.engine import LLM, EngineConfig, SamplingParams
from rlfuse.engine.cache import LinearStateCache, bytes_per_block
from rlfuse.engine.naive import greedy_generate_naive
from rlfuse.engine.sequence import Sequence
from rlfuse.kernels import use_backend
from rlfuse.kernels.backend import use_numerics
from rlfuse.kernels.gated_delta import CHUNK

PROMPTS = [5, 17, 70, 33]


def _model(dtype=torch.float32, **over):
    return tiny_hybrid_model(seed=0, vocab_size=128, **over).to(dtype).eval()


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16}, {"num_kv_blocks": 12, "block_size": 16}],
                         ids=["eager", "chunked-prefill", "preemption"])
def test_generate_equals_naive_greedy(kw):
    model = _model()
    prompts = random_prompts(PROMPTS)
    with use_backend("torch"):
        llm = LLM(model, None, EngineConfig(max_model_len=256, max_num_seqs=4, **kw))
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        assert [o.output_token_ids for o in outs] == greedy_generate_naive(model, prompts, 40)
    assert llm.runner.static and llm.scheduler.group_state  # hybrid: static decode, hits only in a group
    if "num_kv_blocks" in kw:
        assert llm.stats.preemptions > 0
    lin = llm.runner.linear
    parked = llm.scheduler.parked
    assert lin.num_free + len(parked) == lin.num_slots == 4 and len(lin.slot_of) == len(parked)  # finished: parked
    llm.reset_prefix_cache()
    assert lin.num_free == 4 and not lin.slot_of and llm.block_manager.num_free == llm.kv.num_blocks


def test_sleep_frees_the_linear_state_and_wake_restores_it():
    """sleep() releases the linear-attention state with the KV pool (parked sequences give
    their slots back first); after wake() it is zeroed, every slot free, and generation
    equals the naive generator again."""
    model = _model()
    prompts = random_prompts(PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with use_backend("torch"):
        llm = LLM(model, None, EngineConfig(max_model_len=256, max_num_seqs=4))
        llm.generate(prompts, params)
        lin = llm.runner.linear
        assert lin.slot_of and len(llm.scheduler.parked)  # finished sequences parked with their slots
        llm.sleep()
        assert not lin.tensors and not lin.layers and not lin.slot_of and not len(llm.scheduler.parked)
        llm.wake()
        assert lin.num_free == lin.num_slots == 4
        assert all(t.count_nonzero() == 0 for t in lin.tensors.values())
        outs = llm.generate(prompts, params)
    assert [o.output_token_ids for o in outs] == greedy_generate_naive(model, prompts, 16)


@pytest.mark.parametrize("prompt_len", [70, 45])
def test_a_group_prefills_its_prompt_once(prompt_len):
    """n = 4 samples of a prompt: one member prefills up to the prompt's last full block before
    its last token, the others start there from a copy of its linear-attention state (and its
    cached K/V blocks); greedy, every sample equals the naive generator's."""
    model = _model()
    (p,) = random_prompts([prompt_len])
    with use_backend("torch"):
        llm = LLM(model, None, EngineConfig(max_model_len=256, max_num_seqs=4, block_size=16))
        outs = llm.generate([p], SamplingParams(n=4, temperature=0.0, max_tokens=24, ignore_eos=True))
        want = greedy_generate_naive(model, [p], 24)[0]
    assert [o.output_token_ids for o in outs] == [want] * 4
    shared = (prompt_len - 1) // 16 * 16
    assert sorted(o.num_cached_prompt_tokens for o in outs) == [0] + [shared] * 3


@pytest.mark.parametrize("look_ahead", [True, False])
def test_a_new_turn_continues_from_the_parked_state(look_ahead):
    """Multi-turn: a finished sequence is parked with its linear-attention state and its KV
    blocks; the next turn (its tokens + new ones, a new request) takes both over and computes
    only the new tokens, in exact numerics with the trainer's log-probs bitwise. Turn 1 stops
    on a token (with look-ahead, the step in flight computes that token too: the parked
    state holds it), turn 2 ends by length; a third request that continues nothing
    recomputes its prompt; a weight update drops the parked sequences."""
    model = _model()
    (p,) = random_prompts([20])
    with use_backend("torch"):
        llm = LLM(model, None, EngineConfig(max_model_len=256, max_num_seqs=2, block_size=16, numerics="exact",
                                            look_ahead=look_ahead))
        greedy = greedy_generate_naive(model, [p], 16)[0]
        stop = greedy[12]  # turn 1 stops at the first occurrence of the 13th greedy token
        first = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop]))[0]
        assert first.finish_reason == "stop" and first.output_token_ids == greedy[:greedy.index(stop) + 1]
        parked = llm.scheduler.parked
        assert len(parked) == 1 and llm.runner.linear.num_free == 1
        computed = len(p) + len(first.output_token_ids) - (not look_ahead)
        turn2 = p + first.output_token_ids + random_prompts([5], seed=5)[0]
        before = llm.stats.prompt_tokens_computed
        second = llm.generate([turn2], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=3))[0]
        assert llm.stats.prompt_tokens_computed - before == len(turn2) - computed and parked.taken == 1
        assert second.num_cached_prompt_tokens == computed
        with use_numerics("exact"):
            want = trainer_logprobs(model, [(turn2, second.output_token_ids)], 1.0)[0]
        assert torch.equal(second.logprobs, want)
        other = random_prompts([10], seed=9)
        before = llm.stats.prompt_tokens_computed
        llm.generate(other, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        assert llm.stats.prompt_tokens_computed - before == 10 and len(parked) == 2  # 2 slots: both parked
        with torch.no_grad():
            model.lm_head_weight.mul_(1.0)  # an in-place update, even one that changes no value
        turn3 = turn2 + second.output_token_ids + [1, 2]
        third = llm.generate([turn3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
        assert third.num_cached_prompt_tokens == 0 and parked.taken == 1
        assert third.output_token_ids == greedy_generate_naive(model, [turn3], 3)[0]


@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_static_decode_equals_eager_bitwise(numerics):
    """The static decode path (fixed-shape buffers, the linear-attention state read and
    written through slot indices; exact: a 64-row chunk per row with its valid length
    masked, fast: the recurrent kernel on the slots in place: what the CUDA graphs replay
    on a GPU) against the eager path: 3 sequences in a bucket of 4
    (one padding row on the scratch slot), n = 2 samples of one prompt (the group state
    copy), sampling, look-ahead; decode crosses a 64-token chunk boundary (a 58-token
    prompt, 12 new tokens: the state moves on at position 63). Exact numerics: tokens and
    log-probs bitwise; fast: the same tokens, log-probs within fp32 rounding."""
    model = _model()
    prompts = random_prompts([58, 30])
    p = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1, n=n) for n in (2, 1)]
    outs = {}
    with use_backend("torch"):
        for eager in (True, False):
            llm = LLM(model, None, EngineConfig(max_model_len=256, max_num_seqs=4, block_size=16, numerics=numerics,
                                                enforce_eager=eager, cuda_graph_batch_sizes=(1, 2, 4)))
            outs[eager] = llm.generate(prompts, p)
            assert llm.runner.static != eager and (eager or llm.stats.look_ahead_steps > 0)
            lin = llm.runner.linear
            assert lin.num_free + len(llm.scheduler.parked) == lin.num_slots  # finished: parked or freed
    for a, b in zip(outs[True], outs[False]):
        assert a.output_token_ids == b.output_token_ids
        if numerics == "exact":
            assert torch.equal(a.logprobs, b.logprobs)
        else:
            torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_kv_pool_holds_the_full_attention_layers_only():
    """3 of the tiny hybrid's 4 layers are linear attention: the paged pool holds K/V for the
    fourth only (kv_caches indexed by layer, None for the others), and on CPU the cache
    budget (cpu_kv_cache_gib) pays for the linear-attention state first."""
    model = _model()
    mc = model.config
    with use_backend("torch"):
        llm = LLM(model, None, EngineConfig(max_model_len=256, max_num_seqs=4, block_size=16))
        assert llm.kv.shape[1] == 1 and [i for i, c in enumerate(llm.kv.kv_caches) if c is not None] == [3]
        per_block = bytes_per_block(mc, 16, torch.float32)
        assert per_block == 2 * 1 * 16 * mc.num_key_value_heads * mc.head_dim * 4
        assert llm.kv.nbytes == llm.kv.num_blocks * per_block
        budget = (llm.runner.linear.nbytes + 5 * per_block) / 2**30
        small = LLM(model, None, EngineConfig(max_model_len=256, max_num_seqs=4, block_size=16,
                                              cpu_kv_cache_gib=budget))
        assert small.kv.num_blocks == 5
        (p,) = random_prompts([40])
        out = small.generate([p], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
        assert out.output_token_ids == greedy_generate_naive(model, [p], 30)[0]


def _sweep():
    return {s.name: s for s in default_sweep(8, small_pool_blocks=10, chunk_tokens=16)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_rollout_log_probs_equal_the_trainers(dtype):
    """`rlfuse check`'s combined setting (n = 4 samples of a prompt, chunked prefill, a small
    pool, look-ahead, micro-batch packing) on the tiny hybrid, exact numerics, torch backend;
    the prompt crosses a chunk boundary. The full sweep: test_exact_full_sweep (slow)."""
    model = _model(dtype)
    prompts = random_prompts([70, 14])
    s = dataclasses.replace(_sweep()["combined"], num_prompts=2, n=2)
    with use_backend("torch"):
        for name in ("combined",):
            r = run_setting(model, prompts, s, numerics="exact", max_tokens=10, temperature=1.0)
            assert r.tokens > 0 and r.bitwise_frac == 1.0 and r.max_abs == 0.0, (name, r.row(), r.first_diff)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_full_sweep(dtype):
    """Every setting of `rlfuse check`'s sweep (8 sequences, 24 tokens; ~100 s a dtype on one core)."""
    model = _model(dtype)
    prompts = random_prompts([14, 30, 70, 7, 40, 3, 18, 9])
    with use_backend("torch"):
        for s in default_sweep(8, small_pool_blocks=10, chunk_tokens=16):
            r = run_setting(model, prompts, s, numerics="exact", max_tokens=24, temperature=1.0)
            assert r.tokens > 0 and r.bitwise_frac == 1.0 and r.max_abs == 0.0, (s.name, r.row(), r.first_diff)


@pytest.mark.slow
def test_exact_sweep_triton_is_bitwise():
    """The Triton kernels (interpreted on CPU): two settings, fp32."""
    model = _model(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    prompts = random_prompts([70, 9])
    sweep = _sweep()
    with use_backend("triton"):
        for name in ("batch 1", "chunked prefill"):
            r = run_setting(model, prompts, sweep[name], numerics="exact", max_tokens=4, temperature=1.0)
            assert r.bitwise_frac == 1.0, (name, r.row(), r.first_diff)


def _seq(i: int) -> Sequence:
    return Sequence(i, f"r{i}", 0, [1, 2, 3], SamplingParams(), seed=0, stop_ids=frozenset())


def test_state_bookkeeping_admit_free_copy():
    model = _model()
    cache = LinearStateCache(model, 3, torch.float32, "cpu", exact=True)
    assert cache.layer_ids == [0, 1, 2] and set(cache.layers[0]) == {"conv", "chunk", "q", "k", "v", "g", "beta"}
    a, b, c, d = (_seq(i) for i in range(4))
    st = cache.step([a, b], [0, 0], [5, 70])  # admitted at their first token
    assert st.tail_lens == [0, 0] and len(st.write_at[0]) == 5 + 70 - CHUNK
    for t in cache.tensors.values():
        t[cache.slot(a)].fill_(1.0)
    cache.admit(c)
    cache.copy_for_group(a, [b, c])  # a group's members start from the prompt's state
    assert all(torch.equal(t[cache.slot(b)], t[cache.slot(a)]) and t[cache.slot(c)].eq(1).all()
               for t in cache.tensors.values())
    assert not cache.can_admit(d)
    cache.free(b)  # finish or preemption: the slot returns
    cache.step([d], [0], [1])
    assert all(t[cache.slot(d)].eq(0).all() for t in cache.tensors.values())  # a new sequence starts at zero
    d.state_from = a  # a group member's state: copied at admission
    cache.free(d)
    st = cache.step([d], [16], [1])
    assert d.state_from is None and all(torch.equal(t[cache.slot(d)], t[cache.slot(a)])
                                        for t in cache.tensors.values())
    with pytest.raises(RuntimeError, match="resumes at token 64 without its linear-attention state"):
        cache.free(d)
        cache.step([d], [64], [1])


def test_check_cli_hybrid_flag(tmp_path, capsys):
    """--hybrid builds the tiny hybrid (fast part); without --tiny it is refused in one line."""
    import argparse

    from rlfuse.cli import check, main

    p = argparse.ArgumentParser()
    check.add_arguments(p)
    model, tok = check._model(p.parse_args(["--tiny", "--hybrid"]), "cpu")
    assert model.config.is_hybrid and tok is None
    assert main(["check", str(tmp_path), "--hybrid", "--out", str(tmp_path / "o")]) != 0
    assert "--hybrid picks the tiny hybrid model" in capsys.readouterr().err


@pytest.mark.slow
def test_check_cli_tiny_hybrid_is_bitwise(tmp_path, capsys):
    """`rlfuse check --tiny --hybrid` in exact numerics reads 100% (~150 s on one CPU core)."""
    import json

    from rlfuse.cli import main

    rc = main(["check", "--tiny", "--hybrid", "--numerics", "exact", "--max-batch", "4", "--max-tokens", "6",
               "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr()
    report = json.loads((tmp_path / "check.json").read_text())
    names = [r["name"] for r in report["settings"]]  # the sweep's 10, fp8 KV, multi-turn, the agent row (serve extra)
    assert len(names) == 12 + ("agent via OpenAI API" in names) and "multi-turn, scripted tool" in names
    assert all(r["bitwise_frac"] == 1.0 and r["tokens"] > 0 for r in report["settings"])


def test_generate_cli_and_api_on_a_hybrid_folder(tmp_path, capsys):
    """A saved Qwen3.5 folder (rlfuse's tiny hybrid + a byte tokenizer): `rlfuse generate`
    runs it, and the Python API's load_model + the engine decode as the naive generator."""
    import json

    from serve_helpers import byte_tokenizer

    from rlfuse.api import load_model
    from rlfuse.cli import main
    from rlfuse.model import save_model

    folder = tmp_path / "q35"
    save_model(tiny_hybrid_model(seed=2, vocab_size=264, eos_token_id=257), folder)
    byte_tokenizer().save(folder)
    assert main(["generate", str(folder), "--prompt", "12+7=", "--prompt", "hello", "--max-tokens", "6",
                 "--n", "2", "--json"]) == 0
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert len(rows) == 4
    model, _ = load_model(folder, device="cpu")
    assert model.config.is_hybrid
    prompts = random_prompts([9, 66])
    with use_backend("torch"):
        outs = LLM(model.eval(), None, EngineConfig(max_model_len=128, max_num_seqs=2)).generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert [o.output_token_ids for o in outs] == greedy_generate_naive(model, prompts, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_hybrid_cuda_graphs_equal_eager_bitwise(dtype):
    """The hybrid decode step captured as CUDA graphs (Triton kernels) against the eager
    engine, exact numerics: every token and log-prob bitwise, over bucket padding (14, then
    fewer running sequences), a group of n = 4 (state copies), look-ahead and decode
    across 64-token chunk boundaries; then the same rollout against the trainer's log-probs
    (`rlfuse check`'s combined setting), and the graphs still see an in-place weight update."""
    model = _model(dtype).cuda()
    prompts = random_prompts([58, 30, 1, 17, 64, 100])
    params = [SamplingParams(temperature=1.0, max_tokens=90, ignore_eos=True, seed=3, n=2 if i else 4)
              for i in range(len(prompts))]
    kw = dict(max_model_len=512, max_num_seqs=16, numerics="exact", num_kv_blocks=256, block_size=16)
    eager = LLM(model, None, EngineConfig(enforce_eager=True, **kw))
    graphs = LLM(model, None, EngineConfig(**kw))
    a, b = eager.generate(prompts, params), graphs.generate(prompts, params)
    assert graphs.runner.use_graphs and graphs.stats.graph_steps > 0 and eager.stats.graph_steps == 0
    for x, y in zip(a, b):
        assert x.output_token_ids == y.output_token_ids and torch.equal(x.logprobs, y.logprobs)
    s = dataclasses.replace(_sweep()["combined"], num_prompts=2, n=4)
    r = run_setting(model, random_prompts([70, 14]), s, numerics="exact", max_tokens=80, temperature=1.0)
    assert r.tokens > 0 and r.bitwise_frac == 1.0 and r.max_abs == 0.0, (r.row(), r.first_diff)
    with torch.no_grad():
        for q in model.parameters():
            q.mul_(1.01)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [o.output_token_ids for o in eager.generate(prompts, greedy)]
    assert [o.output_token_ids for o in graphs.generate(prompts, greedy)] == want
