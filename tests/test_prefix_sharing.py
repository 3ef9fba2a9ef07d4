"""Shared-prompt packing (grpo.share_prefix): a group packed as [prompt, completion_1, ...,
completion_G] against the unshared [prompt + completion_g] x G.

Forward, exact numerics: the completions' attention output, lse and log-probs are bitwise
the unshared ones (torch references and the Triton kernels under TRITON_INTERPRET=1).
Backward: the prompt's gradients sum the G completions' terms in another order, so
gradients agree to rounding only. Tolerances, from the measurements in docs/numerics.md
("Shared prompts"):
* attention in fp64 (no fp32 step inside): max |d grad| <= 64 * 2^-53 * max |grad| (measured
  <= 8 ulps: the sums of G = 3 or 4 terms regrouped);
* the model in fp32: per parameter tensor max |d grad| <= 2e-5 * max |grad| (measured
  4.6e-7-5.7e-7, ~4-5 fp32 ulps of the largest entry; a reordered fp32 sum of n terms may move
  by up to ~n u of its magnitude, and the weight gradients here sum ~200 rows: 2e-5 ~ 170 u).
  The model's RMSNorm and RoPE compute in fp32 even for fp64 weights, so fp32 is the
  precision the model-level check can ask for.
Run: python -m pytest -q tests/test_prefix_sharing.py
"""

import pytest
import torch
from train_setup import tiny_cfg

from rlfuse.kernels import use_backend, use_numerics
from rlfuse.kernels.attention.varlen import SharedPrefix, varlen_attention
from rlfuse.kernels.loss.logprob import token_logprobs
from rlfuse.model import CausalLM, pack_by_tokens
from rlfuse.model.config import ModelConfig
from rlfuse.run.batching import PackedBatch, shared_contexts

DEV = "cuda" if torch.cuda.is_available() else "cpu"
P, COMPLETIONS = 70, [5, 66, 0]  # a prompt straddling two 64-key tiles; an empty completion


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _layouts(dtype, hq=4, hkv=2, dh=16, seed=0, P=P, COMPLETIONS=COMPLETIONS, reads=None):
    """q, k, v of one unshared sequence before the group (length 9), then the group: as
    (unshared tensors, cu), (shared tensors, cu, SharedPrefix) and the row maps of the
    group's rows: unshared row -> shared row, for prompt copies and completions.
    reads[c]: the prompt keys completion c reads (default all P: a GRPO group; fewer: split
    agent turns whose contexts part ways inside the shared trunk)."""
    reads = [P] * len(COMPLETIONS) if reads is None else reads
    g = _g(seed)

    def rnd(n, h):
        return torch.randn(n, h, dh, generator=g).to(dtype)

    other = [rnd(9, h) for h in (hq, hkv, hkv)]
    prompt = [rnd(P, h) for h in (hq, hkv, hkv)]
    comps = [[rnd(c, h) for h in (hq, hkv, hkv)] for c in COMPLETIONS]
    un = [torch.cat([other[i]] + [t for c, r in zip(comps, reads) for t in (prompt[i][:r], c[i])]) for i in range(3)]
    sh = [torch.cat([other[i], prompt[i]] + [c[i] for c in comps]) for i in range(3)]
    un_lens, sh_lens = [9] + [r + c for c, r in zip(COMPLETIONS, reads)], [9, P] + COMPLETIONS
    cu = [torch.tensor([0, *n]).cumsum(0).to(torch.int32).to(DEV) for n in (un_lens, sh_lens)]
    prefix = SharedPrefix.from_groups(sh_lens, [None, None] + [1] * len(COMPLETIONS), DEV, [None, None, *reads])
    comp_rows, prompt_rows, u, s = [], [], 9, 9 + P  # (unshared row, shared row)
    for c, r in zip(COMPLETIONS, reads):
        prompt_rows.append((torch.arange(u, u + r), torch.arange(9, 9 + r)))
        comp_rows.append((torch.arange(u + r, u + r + c), torch.arange(s, s + c)))
        u, s = u + r + c, s + c
    un = [t.to(DEV) for t in un]
    sh = [t.to(DEV) for t in sh]
    return (un, cu[0], max(un_lens)), (sh, cu[1], max(sh_lens), prefix), comp_rows, prompt_rows


GPU_SHAPE = dict(hq=16, hkv=8, dh=128, P=300, COMPLETIONS=[1, 63, 64, 257, 0])  # Qwen3-0.6B heads
PARTIAL = dict(COMPLETIONS=[5, 30, 66, 3], reads=[P, 40, 5, 64])  # split turns: some read part of the trunk
GPU_PARTIAL = dict(hq=16, hkv=8, dh=128, P=300, COMPLETIONS=[1, 63, 257, 64], reads=[300, 129, 7, 64])


@pytest.mark.parametrize("backend", ["torch", "triton", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reads", ["all", "partial"])
def test_exact_attention_over_a_shared_prefix_is_bitwise_the_unshared(backend, dtype, reads):
    if backend == "triton" and reads == "partial" and dtype == torch.bfloat16:
        pytest.skip("the interpreter is slow: partial reads run in fp32 on the CPU, both dtypes on the GPU")
    shape = (GPU_SHAPE if reads == "all" else GPU_PARTIAL) if backend == "gpu" else (
        {} if reads == "all" else PARTIAL)
    backend = "triton" if backend == "gpu" else backend
    (un, cu_u, max_u), (sh, cu_s, max_s, prefix), comp_rows, prompt_rows = _layouts(dtype, **shape)
    with use_backend(backend), use_numerics("exact"):
        o_u, lse_u = varlen_attention(*un, cu_u, max_u, return_lse=True)
        o_s, lse_s = varlen_attention(*sh, cu_s, max_s, return_lse=True, prefix=prefix)
    for ru, rs in comp_rows + prompt_rows[:1] + [(torch.arange(9), torch.arange(9))]:
        assert torch.equal(o_u[ru], o_s[rs]) and torch.equal(lse_u[:, ru], lse_s[:, rs])
    with use_backend(backend):  # fast numerics: the same function, to rounding
        o_f = varlen_attention(*sh, cu_s, max_s, prefix=prefix)
    torch.testing.assert_close(o_f, o_s, rtol=0, atol=4 * 2.0**-8 if dtype == torch.bfloat16 else 1e-5)


def _grads(tensors, cu, max_len, prefix, do):
    xs = [t.detach().clone().requires_grad_() for t in tensors]
    o = varlen_attention(*xs, cu, max_len, prefix=prefix)
    return o.detach(), torch.autograd.grad(o, xs, do)


def _fold(grads, n_shared, comp_rows, prompt_rows):
    """Unshared gradients in the shared layout: the prompt copies' rows summed."""
    out = []
    for g in grads:
        f = g.new_zeros((n_shared, *g.shape[1:]))
        f[:9] = g[:9]
        for (ru, rs), (pu, ps) in zip(comp_rows, prompt_rows):
            f[rs] = g[ru]
            f[ps] += g[pu]
        out.append(f)
    return out


@pytest.mark.parametrize("reads", ["all", "partial"])
def test_shared_prefix_gradients_match_the_unshared_in_fp64(reads):
    (un, cu_u, max_u), (sh, cu_s, max_s, prefix), comp_rows, prompt_rows = _layouts(
        torch.float64, seed=1, **({} if reads == "all" else PARTIAL))
    do_s = torch.randn(sh[0].shape, generator=_g(2), dtype=torch.float64)
    do_u = torch.zeros(un[0].shape, dtype=torch.float64)  # the prompt's own rows: once, in the first copy
    do_u[:9 + P] = do_s[:9 + P]
    for ru, rs in comp_rows:
        do_u[ru] = do_s[rs]
    with use_backend("torch"):
        _, g_u = _grads(un, cu_u, max_u, None, do_u)
        _, g_s = _grads(sh, cu_s, max_s, prefix, do_s)
    for name, a, b in zip("qkv", _fold(g_u, sh[0].shape[0], comp_rows, prompt_rows), g_s):
        assert (a - b).abs().max() <= 64 * 2.0**-53 * a.abs().max(), name


@pytest.mark.parametrize("where", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reads", ["all", "partial"])
def test_triton_shared_prefix_backward_vs_fp64_reference(where, dtype, reads):
    if where == "cpu" and reads == "partial" and dtype == torch.bfloat16:
        pytest.skip("the interpreter is slow: partial reads run in fp32 on the CPU, both dtypes on the GPU")
    """The Triton backward (dK/dV reading the prompt's readers, each masked to the keys it
    reads; dQ the gathered key tiles) against the fp64 reference on the same layout: no worse
    than the reference in the same dtype, plus 4 u of the gold's magnitude (the rule of
    tests/test_kernel_attention.py)."""
    shape = (GPU_SHAPE if reads == "all" else GPU_PARTIAL) if where == "gpu" else ({} if reads == "all" else PARTIAL)
    _, (sh, cu, max_len, prefix), _, _ = _layouts(dtype, seed=3, **shape)
    do = torch.randn(sh[0].shape, generator=_g(4)).to(dtype).to(DEV)
    with use_backend("torch"):
        _, gold = _grads([t.double() for t in sh], cu, max_len, prefix, do.double())
        _, ref = _grads(sh, cu, max_len, prefix, do)
    with use_backend("triton"):
        _, got = _grads(sh, cu, max_len, prefix, do)
    for name, x, r, g in zip("qkv", got, ref, gold):
        err, ref_err = (x.double() - g).abs().max(), (r.double() - g).abs().max()
        u = 2.0**-24 if dtype == torch.float32 else 2.0**-8
        assert err <= 4 * ref_err + 4 * u * g.abs().max(), (name, float(err), float(ref_err))


# ------------------------------------------------------------------ packing and the model
def _seqs(vocab=64):
    g = _g(5)

    def r(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    p1, p2 = r(40), r(20)
    return ([(p1 + r(c), 40) for c in (5, 30, 1, 0)]   # a group of 4 (one empty completion)
            + [(p2 + r(c), 20) for c in (9, 3)]         # a group of 2
            + [(r(30), 12)]                             # alone
            + [(p2[:6] + r(4), 6), (p2[:6] + r(3), 6)])  # a group below share_min=8: unshared


def test_packing_counts_a_shared_prompt_once():
    seqs = _seqs()
    shared = shared_contexts(seqs, 8)
    assert shared == [0, 40, 40, 40, 0, 20, 0, 0, 0]
    un = PackedBatch.build(seqs, "cpu")
    sh = PackedBatch.build(seqs, "cpu", share_min=8)
    assert un.attn.prefix is None and sh.num_tokens == un.num_tokens - 3 * 40 - 20
    assert torch.equal(sh.targets, un.targets) and torch.equal(sh.seq_ids, un.seq_ids)
    # each target's hidden row holds the same token at the same position in both layouts
    key_un, key_sh = (torch.stack([b.input_ids[b.rows], b.positions[b.rows]]) for b in (un, sh))
    assert torch.equal(key_un, key_sh)
    lengths = [len(s) for s, _ in seqs]
    # lengths 45 70 41 40 | 29 23 | 30 | 10 9: a follower costs its completion only
    assert pack_by_tokens(lengths, 100, shared) == [[0, 1, 2, 3], [4, 5, 6, 7, 8]]
    assert pack_by_tokens(lengths, 100) == [[0], [1], [2, 3], [4, 5, 6, 7], [8]]
    # a group split over micro-batches: the first sequence of a micro-batch pays its prompt
    assert pack_by_tokens(lengths, 60, shared) == [[0], [1], [2, 3], [4, 5], [6, 7, 8]]


def _model(dtype=torch.float32, layers=2):
    cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      qk_norm=True)
    m = CausalLM(cfg)
    m.init_weights(std=0.1, generator=_g(6))
    return m.to(dtype)


def _logprobs(model, batch, weights=None):
    h = model(batch.input_ids, batch.positions, batch.attn)
    lp = token_logprobs(h[batch.rows], model.lm_head_weight, batch.targets, 1.0)
    if weights is not None:
        model.zero_grad()
        (lp * weights).sum().backward()
    return lp.detach()


@pytest.mark.parametrize("backend", ["torch", "triton", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_exact_logprobs_of_shared_and_unshared_packing_are_bitwise_equal(backend):
    seqs = _seqs()
    if backend == "triton":  # the interpreter is slow: one layer, the first group and the short one
        seqs = seqs[:2] + seqs[-2:]
    model = _model(torch.bfloat16 if backend == "gpu" else torch.float32,
                   layers=1 if backend == "triton" else 2).to(DEV)
    backend = "triton" if backend == "gpu" else backend
    with use_backend(backend), use_numerics("exact"), torch.no_grad():
        un = _logprobs(model, PackedBatch.build(seqs, DEV))
        sh = _logprobs(model, PackedBatch.build(seqs, DEV, share_min=8))
    assert torch.equal(un, sh)


def test_model_gradients_agree_within_the_stated_tolerance():
    seqs = _seqs()
    model = _model()
    w = torch.randn(sum(len(s) - n for s, n in seqs), generator=_g(7))
    grads = []
    with use_backend("torch"):  # fast numerics: the exact references' backward is the same autograd, slower
        for share_min in (0, 8):
            _logprobs(model, PackedBatch.build(seqs, "cpu", share_min=share_min), w)
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, a in grads[0].items():
        b = grads[1][name]
        assert (a - b).abs().max() <= 2e-5 * a.abs().max(), name
    assert any(not torch.equal(a, grads[1][n]) for n, a in grads[0].items())  # a real reordering


# ------------------------------------------------------------------ a GRPO step
def test_grpo_step_with_share_prefix_on_and_off(tmp_path):
    """The real engine in exact numerics: with share_prefix the trainer's log-probs still
    equal the rollout's (mismatch 0), the loss equals the unshared run's bitwise (one
    micro-batch: the same per-token values summed in the same order), and the parameters
    after the step agree to fp32 rounding of the reordered gradient sums. optim.eps = 1 keeps
    Adam's first step g / (|g| + eps) near-linear in g: with the default 1e-8, an element
    whose gradient is ~eps turns a last-bit difference into an lr-sized one."""
    from rlfuse.data.prompts import PromptStream, build_prompts
    from rlfuse.train.grpo import GRPOStep
    from rlfuse.train.loop import make_optimizer
    from rlfuse.train.session import open_session

    runs = {}
    for share in ("false", "true"):
        cfg = tiny_cfg(tmp_path / share, "engine.numerics=exact", f"grpo.share_prefix={share}",
                       "grpo.share_prefix_min_tokens=2", "grpo.check_every=1", "grpo.max_new_tokens=6",
                       "grpo.micro_batch_tokens=10000", "optim.eps=1.0")
        ses = open_session(cfg)
        init = {n: p.detach().clone() for n, p in ses.model.named_parameters()}
        prompts = build_prompts(ses.train_rows, ses.tokenizer, cfg.data)
        tr = GRPOStep(cfg, ses.model, ses.sampler, ses.rewards(), PromptStream(prompts, seed=0),
                         make_optimizer(ses.model, cfg))
        m = tr.step(0)
        runs[share] = (m, {n: p.detach().clone() for n, p in ses.model.named_parameters()})
    (m0, p0), (m1, p1) = runs["false"], runs["true"]
    assert float(m1["mismatch/max_abs"]) == 0.0 and float(m1["mismatch/full_max_abs"]) == 0.0
    assert torch.equal(torch.as_tensor(m0["loss"]), torch.as_tensor(m1["loss"]))
    moved = max(float((a - init[name]).abs().max()) for name, a in p0.items())
    assert moved > 1e-4  # the step's update, against which the tolerance below is small
    for name, a in p0.items():
        torch.testing.assert_close(p1[name], a, rtol=1e-6, atol=1e-7, msg=name)
