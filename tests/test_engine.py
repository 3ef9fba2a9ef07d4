"""The engine against the naive full-recompute oracle on a tiny fp32 model (CPU).

Greedy equality is exact (token ids): the engine and the oracle differ only in the
attention's summation order (paged cache vs packed), a few fp32 ulps in the logits,
while the model's smallest top-1/top-2 logit gap on these prompts is ~7e-3.
Log-prob tolerance 2e-5: the same ulp-level differences, measured ~2e-6, x10 margin.
"""

import pytest
import torch
from engine_helpers import (
    VOCAB,
    CharTokenizer,
    one_thread,  # noqa: F401 (fixture)
    random_prompts,
    tiny_model,
)

from rlfuse.engine import LLM, EngineConfig, SamplingParams
from rlfuse.engine.naive import greedy_generate_naive, teacher_forced_logprobs
from rlfuse.kernels import use_backend

LENGTHS = [1, 5, 16, 17, 33, 40]
MAX_NEW = 24
LP_ATOL = 2e-5


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS)


@pytest.fixture(scope="module")
def oracle(model, prompts):
    return greedy_generate_naive(model, prompts, MAX_NEW)


def _llm(model, tokenizer=None, **kw):
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_seqs", 8)
    return LLM(model, tokenizer, EngineConfig(**kw))


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


@pytest.mark.parametrize("kw", [
    dict(enable_prefix_caching=True, enforce_eager=True),
    dict(enable_prefix_caching=False, enforce_eager=True),
    dict(enable_prefix_caching=True, enforce_eager=False),      # static decode buffers, bucket padding
    dict(max_num_batched_tokens=16),                            # chunked prefill, mixed steps
    dict(num_kv_blocks=7, max_num_seqs=6),                      # tiny pool: preemption by recompute
    dict(fuse_projections=True, max_num_batched_tokens=16),     # fused q/k/v, gate/up (the CUDA default)
], ids=["cache-eager", "nocache-eager", "cache-static", "chunked", "preempt", "fused"])
def test_greedy_equals_naive(model, prompts, oracle, kw):
    llm = _llm(model, **kw)
    llm.kv.pool.fill_(float("nan"))              # poisoned: no slot may be read before it is written
    outs = llm.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == oracle
    assert all(o.finish_reason == "length" for o in outs)
    if "num_kv_blocks" in kw:
        assert llm.stats.preemptions > 0
    llm.block_manager.check([])
    assert llm.block_manager.num_free == llm.block_manager.num_blocks


def test_n_samples_share_the_prompt_prefill(model):
    n, P, bs = 4, 37, 16
    (prompt,) = random_prompts([P], seed=5)
    llm = _llm(model)
    outs = llm.generate([prompt], SamplingParams(n=n, temperature=0.0, max_tokens=8))
    ref = greedy_generate_naive(model, [prompt], 8)[0]
    assert len(outs) == n and all(o.output_token_ids == ref for o in outs)
    # the first sample prefills all P tokens; each sibling reuses the 2 full blocks and
    # computes only the 5-token tail: P + (n-1) * (P % bs) computed, (n-1) * 32 cached
    assert llm.stats.prompt_tokens_computed == P + (n - 1) * (P % bs)
    assert llm.stats.prompt_tokens_cached == (n - 1) * (P // bs) * bs
    assert [o.num_cached_prompt_tokens for o in outs] == [0] + [32] * (n - 1)


def test_logprobs_equal_teacher_forced(model, prompts):
    llm = _llm(model)
    for p in (SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=MAX_NEW, seed=3), GREEDY):
        outs = llm.generate(prompts, p)
        comp = [o.output_token_ids for o in outs]
        ref = teacher_forced_logprobs(model, prompts, comp, p.temperature or 1.0)
        for o, r in zip(outs, ref):
            assert o.logprobs.dtype == torch.float32 and o.logprobs.shape == r.shape
            torch.testing.assert_close(o.logprobs, r, rtol=0, atol=LP_ATOL)


def test_mixed_temperatures_in_one_batch(model, prompts):
    llm = _llm(model)
    ps = [SamplingParams(temperature=t, max_tokens=6, seed=1) for t in (0.0, 0.5, 1.0, 1.5, 0.5, 0.0)]
    outs = llm.generate(prompts, ps)
    for o, p, prompt in zip(outs, ps, prompts):
        (r,) = teacher_forced_logprobs(model, [prompt], [o.output_token_ids], p.temperature or 1.0)
        torch.testing.assert_close(o.logprobs, r, rtol=0, atol=LP_ATOL)


def test_seeded_sampling_reproduces_whatever_the_batch(model, prompts):
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=1234)
    a = _llm(model).generate(prompts, p)
    b = _llm(model, max_num_seqs=2, enforce_eager=True).generate(prompts, p)   # other batches, other order
    c = _llm(model).generate([prompts[3]], p)                                   # alone
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    assert c[0].output_token_ids == a[3].output_token_ids
    d = _llm(model).generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, seed=99))
    assert [o.output_token_ids for o in d] != [o.output_token_ids for o in a]
    # the n samples of one request differ from each other; the key is (seed, prompt, k):
    # the same prompt twice with one seed samples the same, a request's samples are reproducible
    e = _llm(model).generate([prompts[2], prompts[2]], SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7))
    assert len({tuple(o.output_token_ids) for o in e[:3]}) == 3
    assert [o.output_token_ids for o in e[:3]] == [o.output_token_ids for o in e[3:]]


@pytest.mark.parametrize("eager", [True, False])
def test_in_place_weight_update_is_used_by_the_next_generate(prompts, eager):
    model = tiny_model(seed=3)
    llm = _llm(model, enforce_eager=eager)
    first = [o.output_token_ids for o in llm.generate(prompts, GREEDY)]
    assert first == greedy_generate_naive(model, prompts, MAX_NEW)
    new = tiny_model(seed=4)
    with torch.no_grad():
        for p, q in zip(model.parameters(), new.parameters()):
            p.copy_(q)                           # in place: the trainer's optimizer step
    second = [o.output_token_ids for o in llm.generate(prompts, GREEDY)]
    assert second != first
    assert second == greedy_generate_naive(model, prompts, MAX_NEW)  # no stale prefix-cache K/V


def test_sleep_releases_the_pool_and_wake_restores_it(model, prompts, oracle):
    llm = _llm(model)
    shape, nbytes = llm.kv.pool.shape, llm.kv.nbytes
    assert nbytes == 2 * 2 * llm.kv.num_blocks * 16 * 2 * 16 * 4  # K+V x layers x blocks x tokens x Hkv x Dh x fp32
    # sleep in the middle of a run: requests are preempted, resume by recompute after wake
    for i, pr in enumerate(prompts):
        llm.add_request(pr, GREEDY, request_id=str(i))
    done = {}
    for _ in range(5):
        done.update({c.request_id: c for c in llm.step()})
    llm.sleep()
    assert llm.kv.pool is None and llm.kv.kv_caches == [] and llm.asleep
    with pytest.raises(RuntimeError, match="asleep"):
        llm.step()
    llm.wake()
    assert llm.kv.pool.shape == shape and llm.kv.nbytes == nbytes and len(llm.kv.kv_caches) == 2
    llm.kv.pool.fill_(float("nan"))              # the new pool's contents are garbage: all recomputed
    while llm.has_unfinished():
        done.update({c.request_id: c for c in llm.step()})
    assert [done[str(i)].output_token_ids for i in range(len(prompts))] == oracle


def test_invalid_requests_name_the_request_and_others_complete(model, prompts, oracle):
    for bad, field in ((dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                       (dict(top_p=1.5), "top_p"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
                       (dict(min_p=2.0), "min_p"), (dict(top_k=-2), "top_k"), (dict(seed=-1), "seed")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    llm = _llm(model)
    a = llm.add_request(prompts[0], GREEDY, request_id="good-a")
    for prompt, params, msg in (([1] * 128, GREEDY, "max_model_len"), ([], GREEDY, "empty"),
                                ([VOCAB], GREEDY, "token ids"), ("text", GREEDY, "tokenizer"),
                                ([1, 2], SamplingParams(stop=("x",)), "stop strings"),
                                ([1, 2], dict(temperature=1.0), "SamplingParams")):
        with pytest.raises(ValueError, match=rf"request 'bad'.*{msg}"):
            llm.add_request(prompt, params, request_id="bad")
    b = llm.add_request(prompts[1], GREEDY, request_id="good-b")
    done = {}
    while llm.has_unfinished():
        done.update({c.request_id: c for c in llm.step()})
    assert done[a].output_token_ids == oracle[0] and done[b].output_token_ids == oracle[1]
    with pytest.raises(ValueError, match=r"request '1'.*max_model_len") as e:
        llm.generate([prompts[0], [1] * 200, prompts[2]], GREEDY)
    assert "request '0'" not in str(e.value)
    assert not llm.has_unfinished()              # nothing queued; the engine still works
    assert [o.output_token_ids for o in llm.generate(prompts[:2], GREEDY)] == oracle[:2]


def test_stop_ids_min_tokens_ignore_eos_and_max_model_len(prompts, oracle):
    k = 5
    eos = oracle[4][k]                           # the 6th greedy token of prompt 4 acts as EOS
    model = tiny_model(eos=eos)
    llm = _llm(model)
    first = oracle[4].index(eos)
    (o,) = llm.generate([prompts[4]], GREEDY)
    assert o.output_token_ids == oracle[4][:first + 1] and o.finish_reason == "stop"
    (o,) = llm.generate([prompts[4]], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert o.output_token_ids == oracle[4] and o.finish_reason == "length"
    (o,) = llm.generate([prompts[4]], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=first + 3))
    assert eos not in o.output_token_ids[:first + 3]   # masked until min_tokens
    assert o.output_token_ids[:first] == oracle[4][:first]
    stop_id = oracle[2][3]
    (o,) = _llm(tiny_model()).generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                                   stop_token_ids=(stop_id,)))
    assert o.output_token_ids == oracle[2][:oracle[2].index(stop_id) + 1] and o.finish_reason == "stop"
    short = _llm(tiny_model(), max_model_len=48)
    (o,) = short.generate([prompts[5]], GREEDY)   # 40-token prompt: 8 tokens left in the context
    assert o.output_token_ids == oracle[5][:8] and o.finish_reason == "length"


def test_text_and_stop_strings(model, prompts, oracle):
    tok = CharTokenizer()
    llm = _llm(model, tok)
    text = tok.decode(oracle[1])
    stop = text[6:8]
    cut = text.find(stop)
    (o,) = llm.generate([tok.decode(prompts[1])], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=(stop,)))
    assert o.prompt_token_ids == prompts[1]
    assert o.finish_reason == "stop" and o.text == text[:cut]
    assert o.output_token_ids == oracle[1][:cut + len(stop)]
    (o,) = llm.generate([prompts[1]], GREEDY)
    assert o.text == text


def test_streaming_and_abort(model, prompts, oracle):
    llm = _llm(model)
    ids = [llm.add_request(p, GREEDY) for p in prompts[:3]]
    for _ in range(4):
        assert llm.step() == []
    aborted = llm.abort(ids[1])
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort"
    partial = aborted[0].output_token_ids
    assert 0 < len(partial) < MAX_NEW and partial == oracle[1][:len(partial)]
    assert aborted[0].logprobs.shape == (len(partial),)
    queued = llm.add_request(prompts[3], GREEDY)
    assert llm.abort(queued)[0].output_token_ids == []   # aborted while waiting
    done = {}
    while llm.has_unfinished():
        done.update({c.request_id: c for c in llm.step()})
    assert set(done) == {ids[0], ids[2]}
    assert done[ids[0]].output_token_ids == oracle[0] and done[ids[2]].output_token_ids == oracle[2]
    llm.block_manager.check([])
    assert llm.block_manager.num_free == llm.block_manager.num_blocks
    assert len(llm.runner.free_rows) == llm.config.max_num_seqs


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_cuda_graphs_equal_eager_and_naive():
    """fp32 on the GPU: Triton kernels with IEEE dots, so the same exact-equality argument
    as on CPU holds; the graphs replay decode batches padded to their bucket."""
    model = tiny_model(device="cuda")
    prompts = random_prompts([1, 5, 16, 17, 33, 40, 64, 3, 9])
    ref = greedy_generate_naive(model, prompts, 40)
    kw = dict(max_model_len=256, max_num_seqs=16, num_kv_blocks=256)
    eager = LLM(model, None, EngineConfig(enforce_eager=True, **kw))
    graphs = LLM(model, None, EngineConfig(**kw))
    p = SamplingParams(temperature=0.0, max_tokens=40)
    a = [o.output_token_ids for o in eager.generate(prompts, p)]
    outs = graphs.generate(prompts, p)
    b = [o.output_token_ids for o in outs]
    assert graphs.stats.graph_steps > 0 and eager.stats.graph_steps == 0
    assert a == b == ref
    tf = teacher_forced_logprobs(model, prompts, b, 1.0)
    for o, r in zip(outs, tf):
        torch.testing.assert_close(o.logprobs, r.cpu(), rtol=0, atol=LP_ATOL)
    # graphs keep pointing at the live parameters
    with torch.no_grad():
        for q in model.parameters():
            q.mul_(1.25)
    c = [o.output_token_ids for o in graphs.generate(prompts, p)]
    assert c == greedy_generate_naive(model, prompts, 40) and c != b
    # and survive sleep / wake (recaptured over the new pool)
    graphs.sleep()
    graphs.wake()
    assert [o.output_token_ids for o in graphs.generate(prompts, p)] == c


@pytest.mark.gpu
def test_gpu_torch_backend_decodes_eagerly():
    """kernel_backend torch on CUDA: its reference KV store selects rows with a boolean mask
    (a host sync), which a CUDA graph capture cannot hold; the engine decodes eagerly instead
    of failing the capture, and equals the naive loop."""
    model = tiny_model(device="cuda")
    prompts = random_prompts([1, 5, 16, 33])
    p = SamplingParams(temperature=0.0, max_tokens=20)
    with use_backend("torch"):
        llm = LLM(model, None, EngineConfig(max_model_len=128, max_num_seqs=8, num_kv_blocks=64))
        out = [o.output_token_ids for o in llm.generate(prompts, p)]
        assert llm.runner.decode is None and llm.stats.graph_steps == 0
        assert out == greedy_generate_naive(model, prompts, 20)


@pytest.mark.gpu
def test_gpu_sleep_frees_at_least_the_pool_and_budget_is_respected():
    model = tiny_model(device="cuda", dtype=torch.bfloat16)
    frac = 0.5
    llm = LLM(model, None, EngineConfig(max_model_len=256, max_num_seqs=16, gpu_memory_fraction=frac))
    llm.generate(random_prompts([5, 30]), SamplingParams(temperature=1.0, max_tokens=20, seed=0))
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    assert total - free <= frac * total + 512 * 2**20   # the pool was sized from the budget (slack: graphs)
    before = torch.cuda.memory_allocated()
    llm.sleep()
    after = torch.cuda.memory_allocated()
    assert before - after >= llm.kv.nbytes
    llm.wake()
    assert torch.cuda.memory_allocated() - after >= llm.kv.nbytes
    outs = llm.generate(random_prompts([5, 30]), SamplingParams(temperature=1.0, max_tokens=20, seed=0))
    assert len(outs) == 2


def test_triton_kernels_drive_the_engine_on_cpu(model):
    """The engine's inputs meet the Triton kernels' contracts (dtypes, strides, padding
    rows): with backend "triton" (Triton's interpreter here) greedy equals the oracle and
    seeded sampling equals the reference backend's, on the static decode path with
    chunked prefill."""
    prompts = random_prompts([1, 5, 17, 33])
    kw = dict(max_num_batched_tokens=24)
    sampled = SamplingParams(temperature=0.9, top_p=0.8, top_k=30, max_tokens=5, seed=1)
    with use_backend("triton"):
        llm = _llm(model, **kw)
        greedy = [o.output_token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5))]
        a = [o.output_token_ids for o in llm.generate(prompts, sampled)]
    with use_backend("torch"):
        b = [o.output_token_ids for o in _llm(model, **kw).generate(prompts, sampled)]
    assert greedy == greedy_generate_naive(model, prompts, 5)
    assert a == b


def test_kernel_warmup_runs_every_paged_variant_and_writes_nothing(model, prompts, oracle):
    """The warm-up that compiles the paged-attention variants before any timed step (run
    by hand here: it is CUDA-only at init) goes through the real forward with the Triton
    kernels, leaves the KV pool bit-identical (slots -1), and generation still equals the
    oracle afterwards."""
    from rlfuse.kernels import use_backend

    llm = _llm(model, max_num_seqs=40)  # 40 rows: the no-split prefill shape (2 x 4 "SMs" / 2 kv heads) fits
    with use_backend("triton"):
        llm.kv.pool.normal_()  # known, NaN-free contents (the pool is uninitialized memory)
        before = llm.kv.pool.clone()
        llm.runner._warm_paged_kernels(force=True)
        assert torch.equal(llm.kv.pool, before)
    outs = llm.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == oracle


def test_look_ahead_changes_nothing_but_the_overlap(model, prompts):
    """Look-ahead decode (the next step launched before the current one is read, its input
    ids fed on the device) gives the same tokens, log-probs and finish reasons as the
    plain loop, including sequences that stop on a token (their look-ahead sample is
    discarded) or by length, and leaves the block pool and table rows clean."""
    params = [SamplingParams(temperature=1.0, max_tokens=m, seed=7 + i, stop_token_ids=[3, 11])
              for i, m in enumerate([24, 5, 24, 9, 24, 17])]
    runs = {}
    for la in (True, False):
        llm = _llm(model, look_ahead=la)
        outs = llm.generate(prompts, params)
        runs[la] = ([o.output_token_ids for o in outs], [o.finish_reason for o in outs],
                    torch.stack([torch.nn.functional.pad(o.logprobs, (0, 24 - len(o.logprobs))) for o in outs]))
        assert llm.block_manager.num_free == llm.block_manager.num_blocks
        assert len(llm.runner.free_rows) == llm.config.max_num_seqs
        if la:
            assert llm.stats.look_ahead_steps > 10 and llm.stats.discarded_tokens > 0
        else:
            assert llm.stats.look_ahead_steps == 0
    assert runs[True][0] == runs[False][0] and runs[True][1] == runs[False][1]
    assert set(runs[True][1]) == {"stop", "length"}
    assert torch.equal(runs[True][2], runs[False][2])


def test_runner_passes_16_byte_aligned_tensors_to_kernels(model, monkeypatch):
    """Triton specializes a kernel on each pointer's 16-byte alignment: a tensor argument
    whose offset moves with the batch (a slice of one upload) compiles a second variant
    mid-generate (seconds on a GPU; the nano-vllm protocol's first run paid four). Every
    tensor the runner hands to the sampler, the log-prob and the attention kernels must
    start on a 16-byte boundary, whatever the batch: odd batch sizes, B = 1, chunked
    prefill, mixed steps, min_tokens masks, several temperatures."""
    import rlfuse.engine.step.sampler as mr
    import rlfuse.model.layers.attention as tr

    bad = []

    def checked(name, fn):
        def w(*a, **k):
            for i, x in enumerate(list(a) + list(k.values())):
                if isinstance(x, torch.Tensor) and x.data_ptr() % 16:
                    bad.append((name, i, tuple(x.shape)))
            return fn(*a, **k)
        return w

    for mod, name in ((mr, "sample"), (mr, "token_logprobs"), (tr, "paged_attention"), (tr, "qk_norm_rope")):
        monkeypatch.setattr(mod, name, checked(name, getattr(mod, name)))
    llm = _llm(model, max_num_seqs=7, max_num_batched_tokens=23)
    prompts = random_prompts([1, 2, 3, 5, 7, 17, 30, 9, 4])
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0][i % 3], max_tokens=3 + 2 * i, min_tokens=i % 3,
                             top_p=0.9, seed=i) for i in range(len(prompts))]
    llm.generate(prompts, params)
    assert not bad, bad[:5]


def test_look_ahead_while_requests_wait_for_a_full_running_set(model, monkeypatch):
    """More requests than max_num_seqs: look-ahead runs while the queue waits and the
    running set is full, stops when a slot frees (admission happens in a plain step), and
    the results equal the plain loop's (token stops included; log-probs to LP_ATOL)."""
    from rlfuse.engine.llm import LLM as _LLM

    prompts = random_prompts([3, 8, 5, 12, 7, 2, 9, 4, 6, 10])
    params = [SamplingParams(temperature=1.0, max_tokens=6 + 3 * (i % 4), seed=i, stop_token_ids=[5])
              for i in range(len(prompts))]
    waited = []
    orig = _LLM._look_ahead

    def spy(self, cur):
        nxt = orig(self, cur)
        if nxt is not None and self.scheduler.waiting:
            waited.append(len(nxt.batch.seqs))
        return nxt

    monkeypatch.setattr(_LLM, "_look_ahead", spy)
    runs = {}
    for la in (True, False):
        llm = _llm(model, look_ahead=la, max_num_seqs=4)
        outs = llm.generate(prompts, params)
        runs[la] = outs
        assert llm.block_manager.num_free == llm.block_manager.num_blocks
    for a, b in zip(runs[True], runs[False]):
        assert (a.output_token_ids, a.finish_reason) == (b.output_token_ids, b.finish_reason)
        # a slot freed by a token stop is refilled one step later: the newcomer's prefill
        # lands in a different step (other chunk neighbours), so log-probs agree to the
        # engine's ulp-level tolerance, not bitwise
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=LP_ATOL, rtol=0)
    assert waited and all(n == 4 for n in waited)
