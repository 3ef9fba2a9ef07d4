"""The naive generator: the oracle the engine is tested against.

No KV cache, no scheduler: every step packs all unfinished sequences (prompt + tokens so
far) into one `Packed` batch, recomputes the whole forward and takes the argmax of the
last position's fp32 logits (ties go to the lowest id, `torch.argmax`'s rule). A
sequence stops after `max_new_tokens` tokens or right after emitting an id in `eos_ids`
(the EOS token is part of the returned completion).

`teacher_forced_logprobs` is the trainer's quantity: log p(completion_t | prompt,
completion_<t) at `temperature`, from `rlfuse.kernels.loss.logprob.token_logprobs` on the
final hidden states -- the same function the engine uses to report rollout log-probs.

Slow by design (O(L^2) forwards per sequence, host syncs every step): tests only.
Test: python -m pytest -q tests/test_smollm2.py
"""

from __future__ import annotations

import torch

from rlfuse.engine.media import encode_images, prompt_positions
from rlfuse.kernels.loss.logprob import token_logprobs
from rlfuse.model import CausalLM, Packed


@torch.no_grad()
def greedy_generate_naive(model: CausalLM, prompt_ids: list[list[int]], max_new_tokens: int,
                          eos_ids=()) -> list[list[int]]:
    """Greedy completions (new tokens only) for each prompt."""
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("prompt_ids: every prompt needs at least one token")
    device = model.lm_head_weight.device
    eos = set(int(e) for e in eos_ids)
    seqs = [list(p) for p in prompt_ids]
    out: list[list[int]] = [[] for _ in prompt_ids]
    live = list(range(len(prompt_ids)))
    for _ in range(max_new_tokens):
        if not live:
            break
        lens = [len(seqs[i]) for i in live]
        ids_T = torch.tensor([t for i in live for t in seqs[i]], dtype=torch.long, device=device)
        pos_T = torch.cat([torch.arange(n, device=device) for n in lens])
        h_TD = model(ids_T, pos_T, Packed.from_lengths(lens, device))
        last_B = torch.tensor(lens, device=device).cumsum(0) - 1
        next_B = model.logits(h_TD[last_B]).argmax(-1).tolist()  # host sync: oracle, one per step
        for i, tok in zip(live, next_B):
            seqs[i].append(tok)
            out[i].append(tok)
        live = [i for i in live if out[i][-1] not in eos]
    return out


def teacher_forced_logprobs(model: CausalLM, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                            temperature: float = 1.0, media: list | None = None) -> list[torch.Tensor]:
    """Per-sequence fp32 log-probs (len(completion_b),) of the completion tokens given the
    prompt, in one packed forward. Differentiable when grad is enabled. `media[b]`: prompt
    b's images (vision models): mRoPE positions and the features of each image encoded alone."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("prompt_ids: every prompt needs at least one token")
    device = model.lm_head_weight.device
    full = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    lens = [len(s) for s in full]
    ids_T = torch.tensor([t for s in full for t in s], dtype=torch.long, device=device)
    feats = None
    if media is not None and any(media):
        vision = model.config.vision
        pos_T = torch.cat([prompt_positions(s, tuple(m), vision)[0] for s, m in zip(full, media)], 1).to(device)
        feats = encode_images(model, [m for ms in media for m in ms])
    else:
        pos_T = torch.cat([torch.arange(n, device=device) for n in lens])
    h_TD = model(ids_T, pos_T, Packed.from_lengths(lens, device), feats)
    # row (start_b + P_b - 1 + j) predicts completion token j of sequence b
    rows, start = [], 0
    for p, c, n in zip(prompt_ids, completion_ids, lens):
        rows += range(start + len(p) - 1, start + len(p) - 1 + len(c))
        start += n
    rows_N = torch.tensor(rows, dtype=torch.long, device=device)
    targets_N = torch.tensor([t for c in completion_ids for t in c], dtype=torch.long, device=device)
    logp_N = token_logprobs(h_TD[rows_N], model.lm_head_weight, targets_N, temperature)
    return list(logp_N.split([len(c) for c in completion_ids]))
