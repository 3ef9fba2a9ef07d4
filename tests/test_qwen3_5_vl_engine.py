"""Exact rollouts of the tiny Qwen3.5-VL (hybrid text tower + vision tower) on image-text
prompts, CPU: the engine prefills with the image features (each distinct image encoded once),
keeps each sequence's linear-attention state, copies it to the members of a GRPO group sharing
the prompt, decodes (static path with look-ahead, and eager), and its log-probs equal the
trainer's bitwise -- with chunked prefill splitting images, forced preemption and
micro-batched teacher forcing too. Regression: the static decode step took the
linear-attention tail length from the token's RoPE position, which an image prompt's mRoPE
delta moves off its index.

    python -m pytest -q tests/test_qwen3_5_vl_engine.py            (the full sweep: -m slow)
"""

import argparse
import json

import pytest
import torch

from rlfuse.cli import main
from rlfuse.cli.check import _vision_prompts
from rlfuse.consistency.check import Setting, run_setting
from rlfuse.kernels import use_numerics
from rlfuse.model import CausalLM, LinearDecode, LinearSlots, ModelConfig
from rlfuse.model.arch.qwen3_5_vl import tiny_hybrid_vl_fields
from rlfuse.model.layers.gated_deltanet import CHUNK


@pytest.fixture(scope="module")
def vl():
    model = CausalLM(ModelConfig(**tiny_hybrid_vl_fields()))
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    # the first three: 2 images, 1 (the first prompt's first image), none; two distinct images
    prompts, media = _vision_prompts(argparse.Namespace(seed=0), model, 4)
    assert [len(m) for m in media[:3]] == [2, 1, 0]
    assert len({m.media_hash for ms in media[:3] for m in ms}) == 2
    return model, prompts, media


@pytest.mark.parametrize("setting", [
    Setting(name="groups", num_prompts=3, n=4),
    Setting(name="chunked, preempted, eager", num_prompts=3, n=2, micro_batch_tokens=64,
            engine=dict(num_kv_blocks=8, max_num_batched_tokens=16, enforce_eager=True, look_ahead=False)),
], ids=lambda s: s.name)
def test_rollout_logprobs_equal_the_trainers_bitwise(vl, setting):
    model, prompts, media = vl
    r = run_setting(model, prompts, setting, numerics="exact", max_tokens=10, temperature=1.0, seed=0, media=media)
    assert r.tokens == setting.batch * 10
    assert r.bitwise_frac == 1.0, (r.first_diff, r.max_abs)
    st = r.engine_stats
    assert st["vision_encodes"] == 2  # once per distinct image, whatever the group size
    if setting.n == 4:  # the group members started from a copy of the prompt's state and KV
        assert st["prompt_tokens_cached"] > 0 and st["look_ahead_steps"] > 0
    else:
        assert st["preemptions"] > 0


def test_static_decode_reads_the_tail_at_the_token_index():
    """forward_decode (exact numerics) on a row whose RoPE position is its index + delta
    (an image prompt) equals the eager continuation at that index."""
    model = CausalLM(ModelConfig(**tiny_hybrid_vl_fields()))
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(1))
    layer = model.model.layers[0].linear_attn
    shapes = layer.state_shapes(True)
    states = {0: {n: torch.zeros(2, *s, dtype=torch.float32) for n, (s, _) in shapes.items()}}
    g = torch.Generator().manual_seed(2)
    with use_numerics("exact"), torch.no_grad():
        layer.forward_slots(torch.randn(CHUNK + 5, 64, generator=g), LinearSlots.make(states, [1], [CHUNK + 5], [0],
                                                                                       CHUNK, "cpu"))
        for n in ("q", "k", "v", "g", "beta"):  # rows past the 5-row tail: never to be read (zeros would be inert)
            states[0][n][1, 5:] = torch.randn(states[0][n][1, 5:].shape, generator=g)
        other = {0: {n: t.clone() for n, t in states[0].items()}}
        x = torch.randn(1, 64, generator=g)
        y_eager = layer.forward_slots(x, LinearSlots.make(states, [1], [1], [5], CHUNK, "cpu"))
        index = torch.tensor([CHUNK + 5])
        y_static = layer.forward_decode(x, index - 9, LinearDecode(other, torch.tensor([1]), index))
    assert torch.equal(y_eager, y_static)


@pytest.mark.slow
def test_check_tiny_vision_hybrid_cli(tmp_path):
    """`rlfuse check --tiny --vision --hybrid`: every setting of the sweep bitwise (~15 s)."""
    assert main(["check", "--tiny", "--vision", "--hybrid", "--max-batch", "12", "--max-tokens", "12",
                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["settings"] and all(r["bitwise_frac"] == 1.0 for r in report["settings"])


def test_one_token_prompt_chunk_in_a_decode_batch_runs_eager(vl, monkeypatch):
    """Regression (the GPU check's `combined` row, 97% bitwise): preemption + chunked prefill
    left a recomputed image prompt one prompt token to compute in a step where every other
    sequence decoded; the all-1-token batch took the static decode path, which places a token
    at index + delta and injects no image features (an image prompt's token before its last
    image has its own 3-row mRoPE position). Such a step now runs eager."""
    from rlfuse.engine.step import ModelRunner

    model = vl[0]
    prompts, media = _vision_prompts(argparse.Namespace(seed=0), model, 32)
    seen, launch = [], ModelRunner.launch

    def spy(self, seqs, num_new, feed=None):
        if feed is None and all(n == 1 for n in num_new):
            seen.append(any(s.mrope is not None and s.num_computed < s.num_prompt_tokens for s in seqs))
        return launch(self, seqs, num_new, feed)

    monkeypatch.setattr(ModelRunner, "launch", spy)
    s = Setting(name="pool and chunks", num_prompts=8, n=4,
                engine=dict(num_kv_blocks=24, max_num_batched_tokens=30))
    r = run_setting(model, prompts, s, numerics="exact", max_tokens=48, temperature=1.0, seed=0, media=media)
    assert any(seen), "no 1-token image-prompt chunk in a decode batch: the case is not exercised"
    assert r.engine_stats["preemptions"] > 0
    assert r.bitwise_frac == 1.0, (r.first_diff, r.max_abs)
