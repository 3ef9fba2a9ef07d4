"""What the parity tests against transformers share: our packed forward's logits, transformers'
per sequence, and the mean next-token cross-entropy of a packed (T, V) logits tensor."""

import torch
import torch.nn.functional as F

from rlfuse.model import Packed


def packed_logits(model, seqs):
    """Our model on the sequences packed into one (T,) batch, each from position 0 -> (T, V)."""
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    return model.logits(model(ids, pos, Packed.from_lengths([len(s) for s in seqs])))


def hf_logits(hf, seqs):
    """transformers' model on each sequence alone, fp32, concatenated as `packed_logits`."""
    return torch.cat([hf(input_ids=s[None]).logits[0].float() for s in seqs])


def next_token_ce(logits, seqs):
    """Next-token cross-entropy over all sequences of a packed (T, V) logits tensor."""
    parts, start = [], 0
    for s in seqs:
        parts.append(F.cross_entropy(logits[start:start + len(s) - 1], s[1:], reduction="sum"))
        start += len(s)
    return torch.stack(parts).sum() / sum(len(s) - 1 for s in seqs)
