"""A tiny full-recompute sampler with the trainer's `Sampler` interface (tests only).

Stands in for the engine where a test must not depend on it: every step packs all live
sequences, recomputes the forward, samples from softmax(logits / T) with a seeded
torch.Generator (argmax when T == 0) and reports token_logprobs at
logprob_temperature(T), the same quantity the engine reports. Slow (O(L^2)), fine for completions of a few tokens.
"""

from __future__ import annotations

import torch

from rlfuse.engine.config import logprob_temperature
from rlfuse.kernels.loss.logprob import token_logprobs
from rlfuse.model import Packed
from rlfuse.rollout.sampler import Sample


class TinySampler:
    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.eos = set(tokenizer.eos_token_ids)
        self.calls = 0
        self.asleep = False

    @torch.no_grad()
    def generate(self, prompt_ids, *, n, temperature, top_p=1.0, top_k=0, max_tokens, seed):
        assert top_p == 1.0 and top_k == 0, "TinySampler: no filtering"
        self.calls += 1
        m = self.model
        dev = m.lm_head_weight.device
        gen = torch.Generator(device="cpu").manual_seed(seed)
        seqs = [list(p) for p in prompt_ids for _ in range(n)]
        outs = [[] for _ in seqs]
        lps = [[] for _ in seqs]
        live = list(range(len(seqs)))
        for _ in range(max_tokens):
            if not live:
                break
            lens = [len(seqs[i]) for i in live]
            ids = torch.tensor([t for i in live for t in seqs[i]], device=dev)
            pos = torch.cat([torch.arange(k, device=dev) for k in lens])
            h = m(ids, pos, Packed.from_lengths(lens, dev))
            last = h[torch.tensor(lens, device=dev).cumsum(0) - 1]
            logits = m.logits(last)
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, -1).cpu()
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1).to(dev)
            lp = token_logprobs(last, m.lm_head_weight, nxt, logprob_temperature(temperature))
            for i, t, l in zip(live, nxt.tolist(), lp.tolist()):
                seqs[i].append(t)
                outs[i].append(t)
                lps[i].append(l)
            live = [i for i in live if outs[i][-1] not in self.eos]
        return [Sample(i // n, outs[i], torch.tensor(lps[i], dtype=torch.float32),
                       bool(outs[i]) and outs[i][-1] not in self.eos,
                       self.tokenizer.decode(outs[i], skip_special_tokens=True)) for i in range(len(seqs))]

    def sleep(self):
        self.asleep = True

    def wake(self):
        self.asleep = False
