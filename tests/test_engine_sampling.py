"""Sampling through the engine follows the filtered softmax: chi-square on the first
token of N samples of one prompt (n = N, max_tokens = 1), per filter setting.

Expected probabilities come from this file's own filter (written from the definitions,
not from rlfuse.kernels.sampling.draw) on the oracle's fp32 logits. Cells with expected count
< 5 are pooled into one. Significance 1e-3 with fixed seeds, so the test is
deterministic; every kept token must be inside the filtered support.
"""

import math

import pytest
import torch
from engine_helpers import (
    one_thread,  # noqa: F401 (fixture)
    random_prompts,
    tiny_model,
)

from rlfuse.engine import LLM, EngineConfig, SamplingParams
from rlfuse.model import Packed

N = 3000


def _filtered_probs(logits: torch.Tensor, T: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    s = logits.double() / T
    V = s.numel()
    keep = torch.ones(V, dtype=torch.bool)
    order = s.argsort(descending=True)
    if 0 < top_k < V:
        kth = s[order[top_k - 1]]
        keep &= s >= kth
    if top_p < 1.0:
        p = torch.where(keep, s, torch.tensor(float("-inf"), dtype=s.dtype)).softmax(0)
        mass_before = 0.0
        allowed = torch.zeros(V, dtype=torch.bool)
        for i in order.tolist():          # smallest prefix (most likely first) reaching top_p
            if not keep[i]:
                continue
            allowed[i] = True
            mass_before += float(p[i])
            if mass_before >= top_p:
                break
        keep &= allowed
    if min_p > 0:
        p = s.softmax(0)
        keep &= p >= min_p * p.max()
    q = torch.where(keep, s, torch.tensor(float("-inf"), dtype=s.dtype)).softmax(0)
    return q


def _chi2_sf(x: float, df: int) -> float:
    try:
        from scipy.stats import chi2
        return float(chi2.sf(x, df))
    except ImportError:  # Wilson-Hilferty normal approximation
        z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
        return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def setup():
    model = tiny_model(std=0.15)
    (prompt,) = random_prompts([21], seed=11)
    with torch.no_grad():
        h = model(torch.tensor(prompt), torch.arange(len(prompt)), Packed.from_lengths([len(prompt)]))
        logits = model.logits(h[-1])
    llm = LLM(model, None, EngineConfig(max_model_len=64, max_num_seqs=256, max_num_batched_tokens=4096))
    return llm, prompt, logits


@pytest.mark.parametrize("T,top_k,top_p,min_p", [
    (1.0, 6, 1.0, 0.0),
    (0.7, 0, 0.6, 0.0),
    (1.3, 0, 1.0, 0.3),
    (1.0, 20, 0.8, 0.1),
    (1.0, 0, 1.0, 0.0),
])
def test_first_token_frequencies_match_the_filtered_softmax(setup, T, top_k, top_p, min_p):
    llm, prompt, logits = setup
    q = _filtered_probs(logits, T, top_k, top_p, min_p)
    support = int((q > 0).sum())
    assert support >= 3, "setting too narrow to test"
    outs = llm.generate([prompt], SamplingParams(n=N, temperature=T, top_k=top_k, top_p=top_p, min_p=min_p,
                                                 max_tokens=1, seed=2024))
    first = torch.tensor([o.output_token_ids[0] for o in outs])
    counts = torch.bincount(first, minlength=q.numel()).double()
    assert counts[q == 0].sum() == 0, "sampled a token outside the filtered support"
    exp = q * N
    big = exp >= 5
    obs_c = torch.cat([counts[big], counts[~big & (q > 0)].sum().view(1)])
    exp_c = torch.cat([exp[big], exp[~big & (q > 0)].sum().view(1)])
    if exp_c[-1] == 0:
        obs_c, exp_c = obs_c[:-1], exp_c[:-1]
    stat = float(((obs_c - exp_c) ** 2 / exp_c).sum())
    pval = _chi2_sf(stat, len(exp_c) - 1)
    assert pval > 1e-3, f"chi2 {stat:.1f} on {len(exp_c) - 1} df, p = {pval:.2e}"
    # the reported log-prob is the unfiltered softmax at T, whatever the filter
    lp = (logits.double() / T).log_softmax(0)[first].float()
    got = torch.stack([o.logprobs[0] for o in outs])
    torch.testing.assert_close(got, lp, rtol=0, atol=2e-5)
