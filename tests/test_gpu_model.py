"""Model-level GPU check: rlfuse's CausalLM vs `transformers` in bf16 on CUDA.

Cases: tiny Llama (llama3 rope, untied), tiny Qwen2 (qkv bias), tiny Qwen3 (qk-norm, tied)
and a random Qwen3-0.6B-shaped model (hidden 1024, intermediate 3072, 28 layers, 16 q / 8 kv
heads, head_dim 128, vocab 151936, tied). For each:
  1. a transformers model is built from the config with random weights (matrices
     N(0, 0.02), norms 1 + N(0, 0.1^2), biases N(0, 0.1^2)), rounded to bf16 and saved
     (safetensors, bf16); rlfuse loads that folder onto the GPU in bf16 (`load_model`);
  2. gold = the same bf16-representable weights in fp32 (transformers, eager attention,
     TF32 off), so the errors below are compute precision only;
  3. loss = mean over tokens of -log p(next token) for B sequences of length S (ours from
     `token_logprobs` on hidden states, transformers from log_softmax of its logits);
     logits rel. error ||x - gold|| / ||gold|| and per-parameter gradient rel. error, for
     ours and for transformers' own bf16, both against gold;
  4. forward+backward time (median of ITERS after WARMUP) and peak memory above what was
     allocated before the step (weights excluded: gradients + activations + temporaries),
     for transformers (sdpa attention), rlfuse, rlfuse with activation checkpointing.
PASS: ours_logits_err <= 1.5 * hf_logits_err + 2^-8, and for every parameter
ours_grad_err <= 1.5 * hf_grad_err + 2^-7 (bf16 unit roundoff 2^-8; "no worse than
transformers in the same dtype", with one-ulp-scale slack for a different summation order).
Kernel backend: rlfuse runs under "auto" (the Triton kernels where they exist), then
"torch" (the PyTorch references).

Run on a GPU machine:  python -m pytest -m gpu -s tests/test_gpu_model.py
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
import torch
import transformers

from rlfuse.kernels import use_backend
from rlfuse.kernels.loss.logprob import token_logprobs
from rlfuse.model import Packed, load_model

TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6)
CASES = {
    "tiny-llama": (transformers.LlamaConfig, dict(
        TINY, head_dim=32, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64, "rope_theta": 500000.0}), (4, 256)),
    "tiny-qwen2": (transformers.Qwen2Config, dict(
        TINY, tie_word_embeddings=False, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), (4, 256)),
    "tiny-qwen3": (transformers.Qwen3Config, dict(
        TINY, head_dim=64, tie_word_embeddings=True, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), (4, 256)),
    "qwen3-0.6b-shape": (transformers.Qwen3Config, dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960,
        rms_norm_eps=1e-6, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), (4, 512)),
}
WARMUP, ITERS = 2, 5
U_BF16 = 2.0 ** -8


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@torch.no_grad()
def randomize_(model, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            v = 1 + 0.1 * torch.randn(p.shape, generator=g)
        elif name.endswith(".bias"):
            v = 0.1 * torch.randn(p.shape, generator=g)
        else:
            v = 0.02 * torch.randn(p.shape, generator=g)
        p.copy_(v.to(torch.bfloat16).float())  # bf16-representable: gold and bf16 models share weights


def hf_loss(model, ids_BS):
    logits = model(input_ids=ids_BS).logits.float()  # (B, S, V)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids_BS[:, 1:, None]).squeeze(-1)
    return -logp.mean(), logits


def ours_loss(model, ids_BS):
    B, S = ids_BS.shape
    dev = ids_BS.device
    h = model(ids_BS.flatten(), torch.arange(S, device=dev).repeat(B), Packed.from_lengths([S] * B, dev))
    h_BSD = h.view(B, S, -1)
    logp = token_logprobs(h_BSD[:, :-1].reshape(-1, h.shape[-1]), model.lm_head_weight, ids_BS[:, 1:].reshape(-1))
    return -logp.mean(), h_BSD


def grads(model):
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def fwd_bwd(fn, model, ids):
    model.zero_grad(set_to_none=True)
    loss, _ = fn(model, ids)
    loss.backward()
    return loss


def bench(fn, model, ids, device):
    """(median ms of forward+backward, peak bytes above what was allocated before)."""
    for _ in range(WARMUP):
        fwd_bwd(fn, model, ids)
    model.zero_grad(set_to_none=True)
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(ITERS):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fwd_bwd(fn, model, ids)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fwd_bwd(fn, model, ids)
            times.append(1e3 * (time.perf_counter() - t))
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else 0
    model.zero_grad(set_to_none=True)
    return statistics.median(times), peak


def run_case(name, device, backends, tmp: Path, shape=None):
    cls, kw, (B, S) = CASES[name]
    B, S = shape or (B, S)
    cfg = cls(**kw)
    torch.manual_seed(0)
    with torch.device(device):
        gold = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomize_(gold, seed=len(name))
    folder = tmp / name
    gold.to(torch.bfloat16).save_pretrained(folder)
    gold.float()
    n_params = sum(p.numel() for p in gold.parameters())
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(1)).to(device)

    fwd_bwd(hf_loss, gold, ids)
    with torch.no_grad():
        gold_logits = gold(input_ids=ids).logits.float()
    gold_g = grads(gold)
    del gold
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa")
    hf = hf.to(device).train()
    fwd_bwd(hf_loss, hf, ids)
    with torch.no_grad():
        hf_logits = hf(input_ids=ids).logits.float()
    hf_g = grads(hf)
    hf_logit_err = rel_err(hf_logits, gold_logits)
    hf_ms, hf_peak = bench(hf_loss, hf, ids, device)
    del hf, hf_logits
    rows = [dict(case=name, impl="transformers", backend="-", params=n_params, B=B, S=S, logits_err=hf_logit_err,
                 grad_err_max=max(rel_err(hf_g[n], gold_g[n]) for n in gold_g), ms=hf_ms, peak_gib=hf_peak / 2**30,
                 ok=True)]

    ours = load_model(folder, device=device, dtype="bfloat16")
    for backend in backends:
        with use_backend(backend):
            fwd_bwd(ours_loss, ours, ids)
            g = grads(ours)
            with torch.no_grad():
                _, h = ours_loss(ours, ids)
                logits = ours.logits(h)
            logit_err = rel_err(logits, gold_logits)
            del logits, h
            missing = sorted(set(gold_g) - set(g))
            errs = {n: (rel_err(g[n], gold_g[n]), rel_err(hf_g[n], gold_g[n])) for n in gold_g if n in g}
            worst = max(errs, key=lambda n: errs[n][0] - 1.5 * errs[n][1])
            ok = (not missing and logit_err <= 1.5 * hf_logit_err + U_BF16
                  and all(e <= 1.5 * h_ + 2 * U_BF16 for e, h_ in errs.values()))
            ms, peak = bench(ours_loss, ours, ids, device)
            ours.gradient_checkpointing = True
            ms_ck, peak_ck = bench(ours_loss, ours, ids, device)
            ours.gradient_checkpointing = False
        rows.append(dict(case=name, impl="rlfuse", backend=backend, params=n_params, B=B, S=S, logits_err=logit_err,
                         grad_err_max=max(e for e, _ in errs.values()), worst_param=worst,
                         worst_param_errs=errs[worst], missing_grads=missing, ms=ms, peak_gib=peak / 2**30,
                         ckpt_ms=ms_ck, ckpt_peak_gib=peak_ck / 2**30, ok=ok))
    del ours
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", list(CASES))
def test_model_matches_transformers_in_bf16(name, tmp_path):
    """PASS rule in the module docstring; each row also carries fwd+bwd time and peak memory
    (printed with `-s`)."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 gold must be real fp32
    torch.backends.cudnn.allow_tf32 = False
    rows = run_case(name, "cuda", ["auto", "torch"], tmp_path)
    for r in rows:
        print({k: v for k, v in r.items() if k not in ("worst_param_errs", "missing_grads")})
    bad = [r for r in rows if not r["ok"]]
    assert not bad, "\n".join(f"{r['case']} {r['backend']}: worst param {r.get('worst_param')} (ours, hf) err "
                              f"{r.get('worst_param_errs')}, missing grads {r.get('missing_grads')}" for r in bad)
