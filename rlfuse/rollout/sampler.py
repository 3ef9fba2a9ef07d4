"""The trainer's view of the inference engine: prompts in, `Sample`s out.

The trainer reaches `rlfuse.engine` only through `EngineSampler` (its public API:
`LLM.generate(token_ids, SamplingParams)`, `sleep()`, `wake()`). Anything with the same
three methods (`Sampler` protocol) can stand in, e.g. a test's tiny sampler.

A Sample's `logprobs` are the engine's log p(token) under softmax(logits / T) before
top-k/top-p filtering, T = `rlfuse.engine.config.logprob_temperature(temperature)`, from `rlfuse.kernels.logprob.token_logprobs` -- exactly the
quantity the trainer recomputes, so they serve as the PPO "old" log-probs.
Order: prompt-major, `n` samples per prompt (sample k of prompt i at i * n + k).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from rlfuse.engine import SamplingParams


@dataclasses.dataclass(slots=True)
class Sample:
    prompt_index: int
    token_ids: list[int]
    logprobs: torch.Tensor  # (len(token_ids),) fp32, CPU
    truncated: bool
    """Stopped by max_tokens rather than EOS / a stop condition."""
    text: str


class Sampler(Protocol):
    def generate(self, prompt_ids: list[list[int]], *, n: int, temperature: float, top_p: float, top_k: int,
                 max_tokens: int, seed: int) -> list[Sample]: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


class EngineSampler:
    """`Sampler` over `rlfuse.engine.LLM` (a flat, prompt-major list of Completions)."""

    def __init__(self, llm, tokenizer):
        self.llm, self.tokenizer = llm, tokenizer

    def generate(self, prompt_ids, *, n, temperature, top_p=1.0, top_k=0, max_tokens, seed) -> list[Sample]:
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                seed=seed % 2**32)
        self.llm.wake()  # no-op when awake; the KV pool must exist to generate
        outs = self.llm.generate(prompt_ids, params)
        if len(outs) != len(prompt_ids) * n:
            raise RuntimeError(f"engine returned {len(outs)} completions for {len(prompt_ids)} prompts x n={n}")
        samples = []
        for j, c in enumerate(outs):
            text = c.text if c.text is not None else self.tokenizer.decode(c.output_token_ids,
                                                                          skip_special_tokens=True)
            samples.append(Sample(j // n, list(c.output_token_ids), c.logprobs.float(), c.finish_reason == "length",
                                  text))
        return samples

    def sleep(self) -> None:
        self.llm.sleep()

    def wake(self) -> None:
        self.llm.wake()
