"""Exact numerics across turns: every model token's rollout log-prob == the trainer's, bitwise.

A tiny random model plays multi-turn episodes on the real engine (exact numerics) against
the scripted tool of rlfuse.rollout.exactness (observations of varying length after varying
delays, episodes ending at different turns, so the batch changes as episodes wait and end).
Each setting must exercise what it names (prefix-cache hits on continuation turns,
observations prefilled in chunks, preemptions), every model token's log-prob must equal the
trainer's teacher-forced log-prob over the whole trajectory (observations as context)
bitwise, and the trajectories' ids must be the same in every setting (preemption and caching
lose nothing). Fast numerics must differ, so the comparison can fail.
Run: python -m pytest -q tests/test_rollout_exact.py
"""

import pytest
from agent_setup import chat_tokenizer
from engine_helpers import (
    one_thread,  # noqa: F401 (fixture)
    tiny_model,
)

from rlfuse.kernels import use_backend
from rlfuse.rollout.exactness import compare, multi_turn_setting, play

SETTINGS = {
    "plain": dict(),
    "chunked prefill": dict(max_num_batched_tokens=8),
    "forced preemption": dict(num_kv_blocks=12),
    "prefix cache off": dict(enable_prefix_caching=False),
    "combined": dict(max_num_batched_tokens=8, num_kv_blocks=12, enforce_eager=True, look_ahead=False),
}


@pytest.fixture(scope="module")
def setup():
    tok = chat_tokenizer("qwen2")
    return tiny_model(vocab=tok.vocab_size, std=0.05), tok


def test_multi_turn_rollout_logprobs_are_the_trainers_bitwise(setup):
    model, tok = setup
    ids = None
    with use_backend("torch"):
        for name, over in SETTINGS.items():
            eps, m, stats = play(model, tok, numerics="exact", engine=over, seed=5)
            assert max(e.turns for e in eps) >= 3 and len({e.turns for e in eps}) > 1, name
            if over.get("enable_prefix_caching", True):
                # a small pool evicts some cached blocks of waiting episodes
                assert m["rollout/continuation_cached_frac"] > (0.05 if "num_kv_blocks" in over else 0.5), (name, m)
            else:
                assert m["rollout/continuation_cached_frac"] == 0
            if "num_kv_blocks" in over:
                assert stats["preemptions"] > 0, name
            if "max_num_batched_tokens" in over:
                # every observation is longer than a step's budget: it is prefilled in chunks
                gaps = [b[0] - a[1] for e in eps for a, b in zip(e.turn_spans, e.turn_spans[1:])]
                assert gaps and min(gaps) > over["max_num_batched_tokens"], name
            t, r, first = compare(model, eps, numerics="exact", micro_batch_tokens=200)
            assert t.numel() > 100 and bool((t == r).all()) and first is None, (name, first)
            got = [(e.prompt_ids, e.token_ids, e.loss_mask) for e in eps]
            assert ids is None or got == ids, name  # the same trajectories whatever the setting
            ids = got


def test_check_row_and_fast_numerics_differs(setup):
    model, tok = setup
    with use_backend("torch"):
        exact = multi_turn_setting(model, tok, numerics="exact", engine=SETTINGS["combined"], seed=1)
        fast = multi_turn_setting(model, tok, numerics="fast", engine={}, seed=1)
    assert exact.bitwise_frac == 1.0 and exact.max_abs == 0.0 and exact.tokens > 50
    assert exact.engine_stats["preemptions"] > 0
    assert fast.bitwise_frac < 1.0 and fast.first_diff is not None


@pytest.mark.slow
@pytest.mark.parametrize("over", [dict(), dict(max_num_batched_tokens=8, num_kv_blocks=12)],
                         ids=["plain", "chunked-preempted"])
def test_multi_turn_on_a_hybrid_continues_from_the_parked_state_bitwise(over):
    """The tiny Qwen3.5 (Gated DeltaNet + gated attention): each continuation turn takes over
    the finished turn's linear-attention state and KV blocks (rlfuse/engine/cache/parked.py)
    and prefills only the observation (unless it was evicted: 9 episodes contend for 8 state
    slots), and every model token's log-prob equals the trainer's (~2 min a setting on one
    loaded core)."""
    from tiny_hf import tiny_hybrid_model

    tok = chat_tokenizer("qwen2")
    model = tiny_hybrid_model(seed=1, std=0.05, vocab_size=tok.vocab_size)
    with use_backend("torch"):
        eps, m, stats = play(model, tok, numerics="exact", engine=over, seed=5)
        assert max(e.turns for e in eps) >= 3
        if not over:
            assert m["rollout/continuation_cached_frac"] > 0.3, m
        else:
            assert stats["preemptions"] > 0
        t, r, first = compare(model, eps, numerics="exact", micro_batch_tokens=200)
    assert t.numel() > 100 and bool((t == r).all()) and first is None, first
