"""The generation benchmark's cases (`make_cases`).

Cases (all temperature-sampled, ignore_eos):
  nanovllm  the protocol nano-vllm and RL.cu publish: Python random.seed(0); 256 prompts
            of U[100, 1024] ids ~ U[0, 10000], then per sequence max_tokens ~ U[100, 1024]
            (drawn in that order), temperature 0.6; one-sequence warm-up first;
  fixed     256 prompts of 128 ids, 512 new tokens each, temperature 0.6;
  grpo      32 prompts of 250 ids x n = 8 completions of 512 tokens, temperature 1.0;
            counts prompt tokens computed vs taken from the prefix cache (each prompt
            once + 7 x (250 mod 16) tail tokens: 32 * 250 + 32 * 7 * 10 = 10,240);
  decode    256 prompts of 512 ids, 256 new tokens each, temperature 0.6 (issue 34's decode
            target: B = 256 with 512-token prompts).
`small` divides lengths and counts (ids < 150 for the tiny vocab): a CPU smoke test.
Test: python -m pytest -q tests/test_engine_bench.py
"""

from __future__ import annotations

import dataclasses
import random

from rlfuse.engine.config import SamplingParams


@dataclasses.dataclass(slots=True)
class Case:
    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def n(self) -> list[int]:
        return [p.n for p in self.params]


def make_cases(small: bool, names) -> list[Case]:
    """The three cases; `small` divides lengths and counts (ids < 150 for the tiny vocab)."""
    d, id_hi = (32, 150) if small else (1, 10000)
    out = []
    for name in names:
        if name == "nanovllm":  # draws in nano-vllm's order: prompt lengths and ids, then max_tokens
            rng = random.Random(0)
            n, lo, hi = 256 // d, 100 // d, 1024 // d
            prompts = [[rng.randint(0, id_hi) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
            params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(lo, hi))
                      for _ in range(n)]
        elif name == "fixed":
            rng = random.Random(1)
            n, P, O = (8, 16, 16) if small else (256, 128, 512)
            prompts = [[rng.randint(0, id_hi) for _ in range(P)] for _ in range(n)]
            params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=O)] * n
        elif name == "decode":
            rng = random.Random(3)
            n, P, O = (8, 16, 16) if small else (256, 512, 256)
            prompts = [[rng.randint(0, id_hi) for _ in range(P)] for _ in range(n)]
            params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=O)] * n
        elif name == "grpo":
            rng = random.Random(2)
            n, g, P, O = (4, 4, 25, 16) if small else (32, 8, 250, 512)
            prompts = [[rng.randint(0, id_hi) for _ in range(P)] for _ in range(n)]
            params = [SamplingParams(n=g, temperature=1.0, ignore_eos=True, max_tokens=O, seed=i) for i in range(n)]
        else:
            raise ValueError(f"bench case {name!r}: expected one of nanovllm, fixed, grpo, decode")
        out.append(Case(name, prompts, params))
    return out
