"""What the parity tests against transformers share: our packed forward's logits, transformers'
per sequence, and the mean next-token cross-entropy of a packed (T, V) logits tensor."""

import torch
import torch.nn.functional as F

from rlfuse.model import Packed


def packed_logits(model, seqs):
    """Our model on the sequences packed into one (T,) batch, each from position 0 -> (T, V)."""
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s), device=ids.device) for s in seqs])
    return model.logits(model(ids, pos, Packed.from_lengths([len(s) for s in seqs], device=ids.device)))


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


def check_routed_grads(hf, ours, seqs, aux_coef: float, num_experts: int, tol: float):
    """One batch of same-length rows through transformers (its aux loss counts every row), the
    same rows packed through ours: logits, the load-balancing loss, the total loss and every
    parameter's gradient (each nonzero, relative error < tol)."""
    from tiny_hf import rel_err

    from rlfuse.kernels import use_backend
    from rlfuse.model.layers.moe import collect_router_stats, load_balancing_loss

    ids = torch.stack(seqs)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    out = hf(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    with use_backend("torch"):
        mine = packed_logits(ours, seqs)
        aux = load_balancing_loss(collect_router_stats(ours), num_experts)
        loss = next_token_ce(mine, seqs) + aux_coef * aux
    loss.backward()
    assert rel_err(mine.detach(), out.logits.detach().reshape(mine.shape)) < 1e-5
    torch.testing.assert_close(aux, out.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, out.loss, rtol=1e-5, atol=1e-6)
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: no gradient"
        err = rel_err(p.grad, theirs[name].grad)
        assert err < tol, f"{name}: rel err {err:.2e}"
