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

from rlfuse.consistency.check import default_sweep, run_setting
from rlfuse.engine import LLM, EngineConfig, SamplingParams
from rlfuse.engine.cache import LinearStateCache
from rlfuse.engine.naive import greedy_generate_naive
from rlfuse.engine.sequence import Sequence
from rlfuse.kernels import use_backend
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
    assert not llm.runner.static and llm.scheduler.group_state  # hybrid: eager decode, hits only in a group
    if "num_kv_blocks" in kw:
        assert llm.stats.preemptions > 0
    lin = llm.runner.linear
    assert lin.num_free == len(lin.tensors[next(iter(lin.tensors))]) and not lin.slot_of  # every slot freed


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


def test_a_new_turn_continues_correctly():
    """Multi-turn: the second turn's prompt is the first turn's tokens plus new ones; the same
    engine serves it (the state of the finished turn is freed; the turn recomputes its
    prompt, since prefix reuse is off for hybrid models) and equals the naive generator."""
    model = _model()
    (p,) = random_prompts([40])
    with use_backend("torch"):
        llm = LLM(model, None, EngineConfig(max_model_len=256, max_num_seqs=2))
        first = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
        turn2 = p + first.output_token_ids + random_prompts([9], seed=5)[0]
        second = llm.generate([turn2], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
        assert second.output_token_ids == greedy_generate_naive(model, [turn2], 20)[0]


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
    cache = LinearStateCache(model, 3, torch.float32, "cpu")
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
    assert len(report["settings"]) == 12
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
