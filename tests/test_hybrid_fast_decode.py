"""Fast numerics on a hybrid model (issue 34): the engine decodes linear attention with the
recurrent kernel on a running fp32 state per slot (`GatedDeltaNet.forward_decode` /
`forward_recurrent`, `fused_recurrent_gated_delta_rule(state_slots=...)`), and prefill /
continuation leave that state after each sequence's last token.

  * the kernel's slot pool: each sequence reads and writes its slot in place, the same
    bits as the gather / compute / scatter it replaces, against float64;
  * the layer: the static decode step (fixed shapes, what the CUDA graphs replay) is
    bitwise the eager one-token step on the same rows (the same kernels run), and feeding
    sequences in uneven pieces across 64-token chunk boundaries follows the trainer's
    whole-sequence chunked forward within fp32 rounding;
  * the engine: rollout log-probs against the trainer's (groups, chunked prefill, a small
    pool that preempts, look-ahead) and a multi-turn continuation from a parked state.
Exact numerics keep the chunk path: tests/test_engine_hybrid.py.
Run: python -m pytest -q tests/test_hybrid_fast_decode.py
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
from engine_helpers import one_thread, random_prompts  # noqa: F401  (fixture)
from tiny_hf import tiny_hybrid_model

from rlfuse.consistency.check import default_sweep, run_setting, trainer_logprobs
from rlfuse.engine import LLM, EngineConfig, SamplingParams
from rlfuse.engine.cache import LinearStateCache
from rlfuse.engine.naive import greedy_generate_naive
from rlfuse.engine.sequence import Sequence
from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.gated_delta import fused_recurrent_gated_delta_rule, gdn_gates, recurrent_gated_delta_rule_ref
from rlfuse.model import LinearDecode, LinearSlots, Packed
from rlfuse.model.layers import OffsetRMSNorm

# fast-numerics rollout vs trainer log-probs on the tiny hybrid in fp32 (the static == eager
# tolerance of tests/test_engine_hybrid.py; measured max 3e-6 here)
ATOL_FP32 = 1e-5


def _model(dtype=torch.float32, **over):
    return tiny_hybrid_model(seed=0, vocab_size=128, **over).to(dtype).eval()


# ------------------------------------------------------------------ the kernel's slot pool

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_recurrent_state_slots_update_the_pool_in_place(backend):
    """Sequences (one of them 3 tokens long) read their states from pool slots in any order
    and write them back in place: the same bits as passing the gathered states, the other
    slots untouched, and both against the float64 oracle."""
    gen = torch.Generator().manual_seed(3)
    Hk, Hv, Dk, Dv, lens = 1, 2, 12, 40, [1, 3, 1]
    T = sum(lens)
    q, k = torch.randn(T, Hk, Dk, generator=gen), torch.randn(T, Hk, Dk, generator=gen)
    v = torch.randn(T, Hv, Dv, generator=gen)
    g, beta = -torch.rand(T, Hv, generator=gen) * 0.5, torch.rand(T, Hv, generator=gen)
    cu = torch.tensor([0, 1, 4, 5], dtype=torch.int32)
    pool = torch.randn(6, Hv, Dk, Dv, generator=gen) * 0.3
    slots = torch.tensor([4, 0, 2])
    before = pool.clone()
    with use_backend(backend):
        o_ref, s_ref = fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu, initial_state=pool[slots].clone())
        o, s = fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu, initial_state=pool, state_slots=slots)
    assert s is pool and torch.equal(o, o_ref) and torch.equal(pool[slots], s_ref)
    untouched = torch.tensor([1, 3, 5])
    assert torch.equal(pool[untouched], before[untouched])
    o64, s64 = recurrent_gated_delta_rule_ref(q.double(), k.double(), v.double(), g.double(), beta.double(), cu,
                                              initial_state=before[slots].double())
    torch.testing.assert_close(o.double(), o64, rtol=0, atol=1e-5)
    torch.testing.assert_close(pool[slots].double(), s64, rtol=0, atol=1e-5)


def test_recurrent_state_slots_refuse_a_wrong_pool():
    q = k = torch.randn(2, 1, 4)
    v = torch.randn(2, 2, 4)
    g, beta, cu = torch.zeros(2, 2), torch.ones(2, 2), torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous fp32 pool"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu, initial_state=torch.zeros(3, 2, 4, 4).double(),
                                         state_slots=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"slots must be \(B,\) = \(2,\) int64"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu, initial_state=torch.zeros(3, 2, 4, 4),
                                         state_slots=torch.tensor([0, 1], dtype=torch.int32))


def _raw_decode_inputs(B, Hk, Hv, Dk, Dv, dtype, device="cpu", seed=0):
    """One token per row as forward_decode passes it: q, k, v views of one conv output
    (T, 2 Hk Dk + Hv Dv), the raw projections a, b (T, Hv), A_log and dt_bias (Hv,) in the
    model dtype; a spread wide enough that a + dt_bias crosses softplus's threshold (20)
    and goes far below 0."""
    gen = torch.Generator(device=device).manual_seed(seed)
    mixed = torch.randn(B, 2 * Hk * Dk + Hv * Dv, device=device, generator=gen).to(dtype)
    q, k, v = (x.reshape(B, -1, d) for x, d in zip(mixed.split([Hk * Dk, Hk * Dk, Hv * Dv], -1), (Dk, Dk, Dv)))
    a = (torch.randn(B, Hv, device=device, generator=gen) * 12).to(dtype)
    b = (torch.randn(B, Hv, device=device, generator=gen) * 3).to(dtype)
    A_log = (torch.rand(Hv, device=device, generator=gen) * 2 - 1).to(dtype)
    dt_bias = torch.randn(Hv, device=device, generator=gen).to(dtype)
    return q, k, v, a, b, A_log, dt_bias


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[3], [4, 0, 2, 5, 5]])  # B = 1; out of order, 2 padding rows on scratch 5
def test_recurrent_gate_prologue_equals_the_gates(backend, dtype, slots):
    """`gate_params`: the kernel computes beta = sigmoid(b), g = -exp(A_log) softplus(a +
    dt_bias) from the raw projections in its prologue, on one token a row (cu_seqlens
    None) and on the slot pool: the real rows' outputs and states against the call with
    `gdn_gates`' gates (bitwise on the torch backend, which runs gdn_gates; within fp32
    rounding on Triton's exp / log / sigmoid), and against the float64 oracle with float64
    gates. The padding rows sharing the scratch slot are not compared."""
    Hk, Hv, Dk, Dv = 1, 3, 12, 40
    B = len(slots)
    q, k, v, a, b, A_log, dt_bias = _raw_decode_inputs(B, Hk, Hv, Dk, Dv, dtype, seed=len(slots))
    pool = torch.randn(6, Hv, Dk, Dv, generator=torch.Generator().manual_seed(9)) * 0.3
    before, slot_t, cu = pool.clone(), torch.tensor(slots), torch.arange(B + 1, dtype=torch.int32)
    real = [i for i, s in enumerate(slots) if slots.count(s) == 1]
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    ref_pool = before.clone()
    with use_backend(backend), use_numerics("fast"):
        o_ref, _ = fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu, initial_state=ref_pool, state_slots=slot_t)
        o, _ = fused_recurrent_gated_delta_rule(q, k, v, a, b, None, initial_state=pool, state_slots=slot_t,
                                                gate_params=(A_log, dt_bias))
    untouched = [s for s in range(6) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched])
    sr = slot_t[real]
    if backend == "torch":
        assert torch.equal(o[real], o_ref[real]) and torch.equal(pool[sr], ref_pool[sr])
    else:
        tol = dict(rtol=0, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(o[real], o_ref[real], **tol)
        # bf16: a beta whose sigmoid sits at a bf16 rounding boundary may round one ulp apart
        # (2^-8), which moves the state by 2^-8 k_i delta_j (|k_i| <= 1, |delta_j| a few: < 1e-2)
        torch.testing.assert_close(pool[sr], ref_pool[sr], rtol=0, atol=2e-6 if dtype == torch.float32 else 1e-2)
    g64 = -torch.exp(A_log.double()) * torch.nn.functional.softplus(a.double() + dt_bias.double())
    beta64 = torch.sigmoid(b.double())
    o64, s64 = recurrent_gated_delta_rule_ref(q.double(), k.double(), v.double(), g64, beta64, cu,
                                              initial_state=before[slot_t].double())
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(o[real].double(), o64[real], **tol)
    torch.testing.assert_close(pool[sr].double(), s64[real], **tol)


def test_recurrent_gate_params_refuse_wrong_shapes():
    q = k = torch.randn(2, 1, 4)
    v = torch.randn(2, 2, 4)
    a, b = torch.zeros(2, 2), torch.zeros(2, 2)
    with use_numerics("fast"), pytest.raises(ValueError, match=r"gate_params must be \(A_log, dt_bias\), each"):
        fused_recurrent_gated_delta_rule(q, k, v, a, b, None, gate_params=(torch.zeros(3), torch.zeros(2)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_qwen35_2b_recurrent_gate_prologue(dtype):
    """Qwen3.5-2B widths (16 key / 16 value heads, Dk = Dv = 128), 64 rows on out-of-order
    slots of an 80-slot fp32 pool, gates in the prologue, one token a row: against the
    gdn_gates call within fp32 rounding and the float64 oracle."""
    Hk, Hv, Dk, Dv, B, N = 16, 16, 128, 128, 64, 80
    q, k, v, a, b, A_log, dt_bias = _raw_decode_inputs(B, Hk, Hv, Dk, Dv, dtype, device="cuda", seed=22)
    gen = torch.Generator(device="cuda").manual_seed(23)
    pool = torch.randn(N, Hv, Dk, Dv, device="cuda", generator=gen) * 0.3
    slots = torch.randperm(N - 1, device="cuda", generator=gen)[:B]
    before, ref_pool = pool.clone(), pool.clone()
    cu = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    with use_backend("triton"), use_numerics("fast"):
        o_ref, _ = fused_recurrent_gated_delta_rule(q, k, v, *gdn_gates(a, b, A_log, dt_bias), cu,
                                                    initial_state=ref_pool, state_slots=slots)
        o, _ = fused_recurrent_gated_delta_rule(q, k, v, a, b, None, initial_state=pool, state_slots=slots,
                                                gate_params=(A_log, dt_bias))
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(o, o_ref, **tol)
    # bf16: beta may round one bf16 ulp apart at a rounding boundary (see the CPU test)
    torch.testing.assert_close(pool, ref_pool, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-2)
    g64 = -torch.exp(A_log.double()) * torch.nn.functional.softplus(a.double() + dt_bias.double())
    o64, s64 = recurrent_gated_delta_rule_ref(q.double(), k.double(), v.double(), g64, torch.sigmoid(b.double()),
                                              cu, initial_state=before[slots].double())
    tol = dict(rtol=0, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(o.double(), o64, **tol)
    torch.testing.assert_close(pool[slots].double(), s64, **tol)


# ------------------------------------------------------------------ the layer

def _fast_state(layer, slots: int) -> dict[int, dict[str, torch.Tensor]]:
    """One layer's fast-numerics engine state for `slots` slots (LinearStateCache's layout)."""
    dt = {"model": torch.float32, "fp32": torch.float32}
    return {layer.layer_idx: {n: torch.zeros((slots, *s), dtype=dt[kind])
                              for n, (s, kind) in layer.state_shapes(exact=False).items()}}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_static_decode_step_equals_the_eager_step_bitwise(backend):
    """The static decode step (conv update + the recurrent kernel on the slots in place, no
    host values) against the eager path's one-token step (`forward_slots` ->
    `forward_recurrent`, the prefill conv and the same recurrent kernel) on the same rows:
    outputs and states bitwise, over 2 steps from prefills of 62, 5 and 3 tokens (the
    recurrent kernel only: the interpreter's chunk kernel would double the test's time;
    test_pieces_follow_the_whole_sequence_forward covers the chunk + rest prefill)."""
    model = _model(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    layer = model.model.layers[0].linear_attn
    gen = torch.Generator().manual_seed(5)
    lens, slots = [62, 5, 3], [3, 0, 1]
    states = _fast_state(layer, 5)
    with use_backend(backend), use_numerics("fast"), torch.no_grad():
        x = torch.randn(sum(lens), 64, generator=gen)
        layer.forward_slots(x, LinearSlots.make(states, slots, lens, [0] * 3, 0, "cpu"))
        other = {i: {n: t.clone() for n, t in d.items()} for i, d in states.items()}
        pos = torch.tensor(lens)
        for _ in range(2):
            x = torch.randn(3, 64, generator=gen)
            y_eager = layer.forward_slots(x, LinearSlots.make(states, slots, [1, 1, 1], [0] * 3, 0, "cpu"))
            y_static = layer.forward_decode(x, pos, LinearDecode(other, torch.tensor(slots), pos))
            assert torch.equal(y_eager, y_static)
            for n in states[0]:
                assert torch.equal(states[0][n], other[0][n]), n
            pos += 1


def _count_decode_ops():
    path = Path(__file__).parents[1] / "benchmarks" / "count_decode_ops.py"
    spec = importlib.util.spec_from_file_location("count_decode_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fast_decode_step_launches_no_copy_or_gate_kernels():
    """The kernels of one linear layer's fast decode step (benchmarks/count_decode_ops.py:
    aten ops that launch a kernel, and Triton launches): the projections' GEMMs, the conv
    update on its slots, the recurrent kernel with the gates in its prologue (one token a
    row: no offsets built), the gated norm; no gather / scatter of the conv state, no dtype
    round trips, no separate gate kernels (17 kernels in fp32, 19 in bf16 before: + index_select,
    index_copy_, sigmoid, exp, neg, softplus, add, mul, arange, and 2 casts in bf16). The exact
    step keeps its arithmetic but reads the conv state in its slots too. The layers' offset
    RMSNorm is one kernel (was 6 with its residual add in bf16: the add, x.float(),
    w.float(), 1 + w, the norm, the cast back)."""
    count = _count_decode_ops()
    for dtype in (torch.bfloat16, torch.float32):
        ops = count.decode_step_kernels("fast", dtype)
        assert {k: v for k, v in ops.items() if k != "aten.mm"} == {
            "triton._conv_update_kernel": 1, "triton._recurrent_kernel": 1, "triton._gated_norm_fwd_kernel": 1}, ops
        assert ops["aten.mm"] == 5, ops  # in_proj_qkv, _z, _b, _a, out_proj
    # fused (model/fuse.py): the four input projections one GEMM, its z slice read by the gated norm's strides
    fused = count.decode_step_kernels("fast", torch.bfloat16, fused=True)
    assert {k: v for k, v in fused.items() if k != "aten.mm"} == {
        "triton._conv_update_kernel": 1, "triton._recurrent_kernel": 1, "triton._gated_norm_fwd_kernel": 1}, fused
    assert fused["aten.mm"] == 2, fused  # in_proj (fused), out_proj
    ops = count.decode_step_kernels("exact", torch.bfloat16)
    assert not {"aten.index_select", "aten.index_copy_"} & set(ops) and ops["triton._conv_update_kernel"] == 1, ops
    # Qwen3.5's offset RMSNorm with its residual add, no gradient (every layer's two norms): one kernel
    norm = OffsetRMSNorm(64, 1e-6).bfloat16()
    x, h = torch.randn(2, 3, 64).bfloat16().unbind(0)
    with torch.no_grad(), use_backend("triton"):
        norm(x, h)  # compile outside the count
        kernels = count.KernelCount()
        with kernels, kernels.triton_launches():
            norm(x, h)
    assert dict(kernels.ops) == {"triton._rmsnorm_fwd_kernel": 1}, kernels.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_follow_the_whole_sequence_forward(dtype):
    """Each sequence fed in uneven pieces (a prefill of a whole 64-row chunk plus a rest, a
    whole chunk alone, single tokens, a piece across a chunk boundary) through
    `forward_recurrent` (the chunk kernel, then the recurrent rest): every token's output
    is the trainer's whole-sequence chunked forward's within the dtype's rounding, and the
    running state is the float64 token-by-token oracle's state after the last token."""
    model = tiny_hybrid_model(seed=1).to(dtype)
    layer = model.model.layers[0].linear_attn
    gen = torch.Generator().manual_seed(7)
    lens = [140, 67, 3]
    xs = [torch.randn(n, 64, generator=gen).to(dtype) for n in lens]
    pieces = [[70, 1, 1, 1, 60, 7], [64, 1, 1, 1], [2, 1]]  # a chunk + a rest, a chunk alone, rests only
    with use_backend("torch"), use_numerics("fast"), torch.no_grad():
        whole = layer(torch.cat(xs), None, Packed.from_lengths(lens), None)
        conv = torch.zeros(3, layer.conv_dim, layer.width - 1, dtype=dtype)
        state = torch.zeros(3, layer.n_v, layer.dk, layer.dv)
        outs, done = [[] for _ in lens], [0, 0, 0]
        for step in range(max(len(p) for p in pieces)):
            new = [p[step] if step < len(p) else 0 for p in pieces]
            live = [b for b, n in enumerate(new) if n]
            x = torch.cat([xs[b][done[b]:done[b] + new[b]] for b in live])
            y, c, s = layer.forward_recurrent(x, [new[b] for b in live], conv[live], state[live])
            conv[live], state[live] = c, s
            for b, part in zip(live, y.split([new[b] for b in live])):
                outs[b].append(part)
                done[b] += new[b]
        # the oracle's state after each whole sequence, from the layer's kernel inputs in float64
        cu = Packed.from_lengths(lens).cu_seqlens
        inputs, _, _ = layer.project(torch.cat(xs), cu)
        _, s64 = recurrent_gated_delta_rule_ref(*(x.double() for x in inputs), cu)
    got = torch.cat([torch.cat(o) for o in outs])
    tol = dict(rtol=0, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, whole, **tol)
    torch.testing.assert_close(state.double(), s64, rtol=0, atol=1e-4 if dtype == torch.float32 else 5e-2)


def test_a_layout_for_the_other_numerics_is_refused():
    model = _model(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    layer = model.model.layers[0].linear_attn
    states = _fast_state(layer, 2)
    with use_numerics("exact"), torch.no_grad(), pytest.raises(ValueError, match="laid out for fast numerics"):
        layer.forward_decode(torch.randn(1, 64), torch.zeros(1, dtype=torch.long),
                             LinearDecode(states, torch.tensor([0]), torch.zeros(1, dtype=torch.long)))


def test_fast_cache_holds_the_running_state_only():
    """Fast numerics: per layer the conv inputs and one fp32 state (no 64-row tail buffer)."""
    model = _model()
    fast = LinearStateCache(model, 3, torch.float32, "cpu", exact=False)
    exact = LinearStateCache(model, 3, torch.float32, "cpu", exact=True)
    assert set(fast.layers[0]) == {"conv", "recurrent"} and fast.nbytes < exact.nbytes
    a = Sequence(0, "r0", 0, [1, 2, 3], SamplingParams(), seed=0, stop_ids=frozenset())
    st = fast.step([a], [0], [70])
    assert st.tail_lens == [0] and st.write_at[0].numel() == 0 and st.read_at[0].numel() == 0


# ------------------------------------------------------------------ the engine

def test_engine_static_decode_equals_eager_bitwise_without_padding():
    """The engine's static decode path against its eager path in fast numerics, with a
    bucket for every batch size (no padding rows, so every op sees the same shapes): 3
    sequences (n = 2 samples of a 58-token prompt: a group state copy; decode crosses the
    64-token boundary), sampling, look-ahead: tokens and log-probs bitwise. (With padding
    rows the batch's GEMMs differ in shape and torch's CPU GEMMs round by shape:
    tests/test_engine_hybrid.py::test_static_decode_equals_eager_bitwise compares within
    1e-5 there.)"""
    model = _model()
    prompts = random_prompts([58, 30])
    p = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1, n=n) for n in (2, 1)]
    outs = {}
    with use_backend("torch"):
        for eager in (True, False):
            llm = LLM(model, None, EngineConfig(max_model_len=256, max_num_seqs=4, block_size=16,
                                                enforce_eager=eager, cuda_graph_batch_sizes=(1, 2, 3, 4)))
            outs[eager] = llm.generate(prompts, p)
            assert llm.runner.static != eager and (eager or llm.stats.look_ahead_steps > 0)
    for a, b in zip(outs[True], outs[False]):
        assert a.output_token_ids == b.output_token_ids and torch.equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("name", ["combined", "fp8 KV cache"])
def test_fast_rollout_log_probs_follow_the_trainers(name):
    """`rlfuse check`'s settings in fast numerics: "combined" (n = 2 samples of each prompt:
    group state copies, chunked prefill, look-ahead decode, micro-batch packing) and the
    fp8 KV cache (the full-attention layer's K/V in fp8 beside the linear-attention state;
    the trainer reads K/V quantized with the engine's scales): every rollout log-prob
    within fp32 rounding of the trainer's; decode crosses the 64-token boundary (a
    70-token prompt)."""
    model = _model()
    s = dataclasses.replace({x.name: x for x in default_sweep(8, small_pool_blocks=10, chunk_tokens=16)}[name],
                            num_prompts=2, n=2)
    with use_backend("torch"):
        r = run_setting(model, random_prompts([70, 14]), s, numerics="fast", max_tokens=10, temperature=1.0)
    assert r.tokens == 40 and r.max_abs < ATOL_FP32, (r.row(), r.first_diff)
    assert r.engine_stats["look_ahead_steps"] > 0


def test_preempted_sequences_recompute_their_running_state():
    """A pool too small for 4 sequences: preempted ones drop their slot and recompute from
    their first token (prefill through the chunk kernel + the recurrent rest), then decode
    on; every sampled log-prob follows the trainer's, greedy tokens the naive generator's."""
    model = _model()
    prompts = random_prompts([5, 17, 70, 33])
    kw = dict(max_model_len=256, max_num_seqs=4, num_kv_blocks=12, block_size=16)
    with use_backend("torch"):
        llm = LLM(model, None, EngineConfig(**kw))
        outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=28, ignore_eos=True, seed=2))
        assert llm.stats.preemptions > 0
        with use_numerics("fast"):
            want = trainer_logprobs(model, [(p, o.output_token_ids) for p, o in zip(prompts, outs)], 1.0)
        greedy = LLM(model, None, EngineConfig(**kw)).generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True))
        assert [o.output_token_ids for o in greedy] == greedy_generate_naive(model, prompts, 28)
    for o, w in zip(outs, want):
        torch.testing.assert_close(o.logprobs, w, rtol=0, atol=ATOL_FP32)


@pytest.mark.parametrize("look_ahead", [True, False])
def test_a_new_turn_continues_from_the_recurrent_state(look_ahead):
    """Multi-turn in fast numerics: turn 1 decodes recurrently and stops on a token, its
    running state is parked; turn 2 takes it over, computes only its new tokens and its
    log-probs follow the trainer's on the whole conversation."""
    model = _model()
    (p,) = random_prompts([60])
    with use_backend("torch"):
        llm = LLM(model, None, EngineConfig(max_model_len=256, max_num_seqs=2, block_size=16, look_ahead=look_ahead))
        greedy = greedy_generate_naive(model, [p], 16)[0]
        stop = greedy[12]
        first = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop]))[0]
        assert first.output_token_ids == greedy[:greedy.index(stop) + 1]
        computed = len(p) + len(first.output_token_ids) - (not look_ahead)
        turn2 = p + first.output_token_ids + random_prompts([5], seed=5)[0]
        before = llm.stats.prompt_tokens_computed
        second = llm.generate([turn2], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=3))[0]
        assert llm.stats.prompt_tokens_computed - before == len(turn2) - computed
        assert llm.scheduler.parked.taken == 1 and second.num_cached_prompt_tokens == computed
        with use_numerics("fast"):
            want = trainer_logprobs(model, [(turn2, second.output_token_ids)], 1.0)[0]
    torch.testing.assert_close(second.logprobs, want, rtol=0, atol=ATOL_FP32)


def _decode_logprobs_within_the_trainers_rounding(model, outs, seqs, dtype, tol):
    """fp32: the engine's log-probs within `tol` of the trainer's. bf16: fast numerics decode
    on an fp32 running state and train with the chunked rule, so their roundings differ by
    construction (0.155 max, 0.0145 mean apart on an H200); the rule is that the engine's
    log-probs are no farther from the fp32 model's than the bf16 trainer's are."""
    with use_numerics("fast"):
        want = trainer_logprobs(model, seqs, 1.0)
    gap = torch.cat([(o.logprobs.to(w.device) - w).abs() for o, w in zip(outs, want)])
    if dtype == torch.float32:
        assert gap.max() <= tol, gap.max()
        return
    with use_numerics("fast"):
        gold = trainer_logprobs(copy.deepcopy(model).float(), seqs, 1.0)
    d_eng = torch.cat([(o.logprobs.to(g.device) - g).abs() for o, g in zip(outs, gold)])
    d_tr = torch.cat([(w - g).abs() for w, g in zip(want, gold)])
    assert d_eng.mean() <= 2 * d_tr.mean() + 1e-3 and d_eng.max() <= 2 * d_tr.max() + 2 ** -5, \
        (d_eng.mean(), d_tr.mean(), d_eng.max(), d_tr.max())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fast_hybrid_decode_with_cuda_graphs(dtype):
    """On CUDA (Triton kernels), fast numerics: the decode CUDA graphs (the recurrent kernel
    on the slot pool, in place) against the eager engine and against the trainer, over
    bucket padding, a group of n = 4, look-ahead and decode across 64-token chunk
    boundaries; greedy tokens equal across graph / eager (fp32; bf16 up to a near-tie),
    log-probs within the dtype's rounding of each other and of the trainer's, also after an
    in-place weight update."""
    model = _model(dtype).cuda()
    prompts = random_prompts([58, 30, 1, 17, 64, 100])
    kw = dict(max_model_len=512, max_num_seqs=16, numerics="fast", num_kv_blocks=256, block_size=16)
    eager = LLM(model, None, EngineConfig(enforce_eager=True, **kw))
    graphs = LLM(model, None, EngineConfig(**kw))
    greedy = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    a, b = eager.generate(prompts, greedy), graphs.generate(prompts, greedy)
    assert graphs.runner.use_graphs and graphs.stats.graph_steps > 0 and eager.stats.graph_steps == 0
    assert "recurrent" in graphs.runner.linear.layers[0]
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # bf16: max 1.2e-2 measured on the CPU's torch path
    for x, y in zip(a, b):
        agree = next((i for i, (s, t) in enumerate(zip(x.output_token_ids, y.output_token_ids)) if s != t), None)
        # a near-tie may flip a greedy token under different rounding; up to there they agree
        stop = len(x.output_token_ids) if agree is None else agree
        torch.testing.assert_close(x.logprobs[:stop], y.logprobs[:stop], rtol=0, atol=tol)
        if dtype == torch.float32:
            assert agree is None
    params = [SamplingParams(temperature=1.0, max_tokens=90, ignore_eos=True, seed=3, n=2 if i else 4)
              for i in range(len(prompts))]
    outs = graphs.generate(prompts, params)
    seqs = [(list(o.prompt_token_ids), list(o.output_token_ids)) for o in outs]
    _decode_logprobs_within_the_trainers_rounding(model, outs, seqs, dtype, tol)
    with torch.no_grad():
        for q in model.parameters():
            q.mul_(1.01)
    outs = graphs.generate(prompts[:2], params[:2])
    seqs = [(list(o.prompt_token_ids), list(o.output_token_ids)) for o in outs]
    # the updated weights: the graphs read them too
    _decode_logprobs_within_the_trainers_rounding(model, outs, seqs, dtype, tol)
