"""rlfuse's CausalLM against `transformers` on tiny random models of each family.

Checked per family (llama3-rope untied Llama, Qwen2 with qkv bias, Qwen3 with qk-norm and
tied embeddings, see tests/tiny_hf.py):
  * fp32 logits of packed sequences equal transformers' run per sequence (rel < 1e-5);
  * gradients of a token cross-entropy w.r.t. every parameter equal transformers' (fp32);
  * bf16 logits: no worse than transformers' own bf16 against the fp32 gold (see BF16_*);
  * packed vs padded (left and right padding) give bitwise the same per-sequence hidden
    states (the padded path packs to the same tensor), padded rows are zero;
  * activation checkpointing gives bitwise the same gradients.
Exact fp32 parity runs under use_backend("torch") (the readable references).
Run: python -m pytest -q tests/test_model.py
"""

import pytest
import torch
from parity import hf_logits as _hf_logits
from parity import next_token_ce as _loss
from parity import packed_logits as _ours_logits
from tiny_hf import FAMILIES, hf_model, rel_err

from rlfuse.kernels import use_backend
from rlfuse.model import Packed, load_model

LENS = [5, 11, 8]
FP32_LOGITS_TOL = 1e-5
FP32_GRAD_TOL = 1e-5
# bf16: one rounding of a value of size ~1 is 2^-8 = 3.9e-3 relative; after two layers and
# the LM head both implementations land a few roundings away from the fp32 gold. We require
# ours to be within 1.5x transformers' own bf16 error (+ one bf16 ulp of slack), and the two
# bf16 results to differ by less than 4 ulps relative.
BF16_VS_GOLD_FACTOR = 1.5
BF16_VS_HF_TOL = 4 * 2 ** -8


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(family, transformers model, rlfuse model loaded from the transformers checkpoint)."""
    hf = hf_model(request.param, seed=FAMILIES.index(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    ours = load_model(folder, dtype="float32")
    return request.param, hf, ours


def _seqs(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENS]


def test_config_read_from_transformers_checkpoint(pair):
    family, hf, ours = pair
    c, h = ours.config, hf.config
    assert c.model_type == family
    head_dim = getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads
    assert (c.hidden_size, c.num_hidden_layers, c.head_dim) == (h.hidden_size, h.num_hidden_layers, head_dim)
    assert c.tie_word_embeddings == h.tie_word_embeddings
    assert c.qk_norm == (family == "qwen3") and c.attention_bias == (family == "qwen2")
    assert (c.rope_scaling or {}).get("rope_type") == ("llama3" if family == "llama" else None)
    assert sorted(n for n, _ in ours.named_parameters()) == sorted(n for n, _ in hf.named_parameters())


def test_fp32_logits_match_transformers(pair):
    _, hf, ours = pair
    seqs = _seqs(hf.config.vocab_size)
    with torch.no_grad(), use_backend("torch"):
        err = rel_err(_ours_logits(ours, seqs), _hf_logits(hf, seqs))
    assert err < FP32_LOGITS_TOL, err


def test_fp32_grads_match_transformers(pair):
    _, hf, ours = pair
    seqs = _seqs(hf.config.vocab_size, seed=1)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    with use_backend("torch"):
        _loss(_ours_logits(ours, seqs), seqs).backward()
    _loss(_hf_logits(hf, seqs), seqs).backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: no gradient"
        err = rel_err(p.grad, hf_params[name].grad)
        assert err < FP32_GRAD_TOL, f"{name}: rel err {err:.2e}"


def test_bf16_logits_close_to_transformers(pair, tmp_path):
    family, hf, _ = pair
    seqs = _seqs(hf.config.vocab_size, seed=2)
    with torch.no_grad():
        gold = _hf_logits(hf, seqs)
        hf.save_pretrained(tmp_path)
        hf_bf16 = type(hf).from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="eager").eval()
        ours_bf16 = load_model(tmp_path, dtype="bfloat16")
        assert ours_bf16.lm_head_weight.dtype == torch.bfloat16
        theirs = _hf_logits(hf_bf16, seqs)
        mine = _ours_logits(ours_bf16, seqs)
    err_hf, err_ours = rel_err(theirs, gold), rel_err(mine, gold)
    assert err_ours <= BF16_VS_GOLD_FACTOR * err_hf + 2 ** -8, (family, err_ours, err_hf)
    assert rel_err(mine, theirs) < BF16_VS_HF_TOL


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_equals_packed(pair, side):
    _, hf, ours = pair
    seqs = _seqs(hf.config.vocab_size, seed=3)
    S = max(LENS)
    ids = torch.full((len(seqs), S), 7)
    mask = torch.zeros((len(seqs), S), dtype=torch.long)
    for b, s in enumerate(seqs):
        sl = slice(S - len(s), S) if side == "left" else slice(0, len(s))
        ids[b, sl], mask[b, sl] = s, 1
    with torch.no_grad(), use_backend("torch"):
        padded = ours.forward_padded(ids, mask)
        packed = ours(torch.cat(seqs), torch.cat([torch.arange(len(s)) for s in seqs]), Packed.from_lengths(LENS))
        single = [ours(s, torch.arange(len(s)), Packed.from_lengths([len(s)])) for s in seqs]
    start = 0
    for b, s in enumerate(seqs):
        rows = padded[b][mask[b].bool()]
        assert torch.equal(rows, packed[start:start + len(s)])
        assert torch.equal(padded[b][~mask[b].bool()], torch.zeros_like(padded[b][~mask[b].bool()]))
        # one sequence alone: same math, other matmul shapes -> rounding-level differences only
        assert rel_err(rows, single[b]) < FP32_LOGITS_TOL
        start += len(s)


def test_activation_checkpointing_same_grads(pair):
    _, hf, ours = pair
    seqs = _seqs(hf.config.vocab_size, seed=4)
    grads = []
    for ckpt in (False, True):
        ours.zero_grad(set_to_none=True)
        ours.gradient_checkpointing = ckpt
        try:
            with use_backend("torch"):
                _loss(_ours_logits(ours, seqs), seqs).backward()
        finally:
            ours.gradient_checkpointing = False
        grads.append({n: p.grad.clone() for n, p in ours.named_parameters()})
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


def test_checkpoint_recompute_keeps_the_forward_backend(pair):
    """On CUDA, backward (and so the checkpoint recompute) runs on autograd's device thread,
    where the backend context variable is back at its default. Simulated here by calling
    backward outside the `use_backend` block: the recompute must still use the forward's
    backend ("triton" under the interpreter; the default "auto" would pick the references
    for CPU tensors and save a different set of tensors)."""
    _, hf, ours = pair
    seqs = _seqs(hf.config.vocab_size, seed=5)[:1]
    ours.zero_grad(set_to_none=True)
    ours.gradient_checkpointing = True
    try:
        with use_backend("triton"):
            loss = _loss(_ours_logits(ours, seqs), seqs)
        loss.backward()
    finally:
        ours.gradient_checkpointing = False
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ours.parameters())
