"""An agent episode whose calls do not extend one another (a Qwen3-style template that strips
earlier reasoning) trains as several samples (`Sample.split_parts`) whose common prefixes the
trainer packs once (rlfuse.run.batching.share_plan): 8 split turns cost <= 1.3x the tokens of
the same episode merged into one sample, and in exact numerics the log-probs and the loss are
bitwise those of the unshared packing (gradients agree to rounding: docs/numerics.md,
"Shared prompts").
Run: python -m pytest -q tests/test_split_episodes.py
"""

import torch
from train_setup import TINY_MODEL, tiny_cfg

from rlfuse.rollout import Sample
from rlfuse.run import NonFiniteGuard, PackedBatch, share_plan
from rlfuse.train.grpo_update import GRPOUpdate
from rlfuse.train.loop import make_optimizer
from rlfuse.train.session import open_session

PROMPT, THINK, ANSWER, OBS, TURNS = 40, 12, 3, 5, 8


def _ids(n, g, vocab=20):
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _episode(seed=0):
    """(merged Sample, split Sample) of one 8-turn episode: turn k samples THINK reasoning and
    ANSWER answer ids; the next context keeps the answer, drops the reasoning and adds OBS
    observation ids. Log-probs are placeholders (the loss only needs them finite)."""
    g = torch.Generator().manual_seed(seed)
    prompt = _ids(PROMPT, g)
    turns = [(_ids(THINK, g), _ids(ANSWER, g), _ids(OBS, g)) for _ in range(TURNS)]
    merged, mask = [], []
    for k, (think, ans, obs) in enumerate(turns):
        merged += think + ans
        mask += [1] * (THINK + ANSWER)
        if k + 1 < TURNS:
            merged += obs
            mask += [0] * OBS
    pieces, ctx = [], list(prompt)
    for think, ans, obs in turns:
        out = think + ans
        pieces.append(Sample(0, out, torch.full((len(out),), -1.0), False, "", torch.ones(len(out)), list(ctx)))
        ctx = ctx + ans + obs  # the template keeps the answer, strips the reasoning
    split = pieces[-1]
    split.split_parts = pieces[:-1]
    whole = Sample(0, merged, torch.full((len(merged),), -1.0), False, "", torch.tensor(mask, dtype=torch.float32),
                   list(prompt))
    return whole, split


def test_share_plan_packs_a_growing_history_once():
    _, split = _episode()
    seqs = [(p.prompt_ids + p.token_ids, len(p.prompt_ids)) for p in [*split.split_parts, split]]
    runs, trunks, p = share_plan(seqs, 16, link=[0] * len(seqs))
    assert runs == [list(range(TURNS))] and trunks[0] == split.prompt_ids  # the last context extends the others
    assert p == [len(s.prompt_ids) for s in [*split.split_parts, split]]
    assert share_plan(seqs, 16, link=list(range(TURNS)))[0] == [[i] for i in range(TURNS)]  # other episodes: unshared
    sh, un = PackedBatch.build(seqs, "cpu", 16, [0] * TURNS), PackedBatch.build(seqs, "cpu")
    assert torch.equal(sh.targets, un.targets) and torch.equal(sh.seq_ids, un.seq_ids)
    key_un, key_sh = (torch.stack([b.input_ids[b.rows], b.positions[b.rows]]) for b in (un, sh))
    assert torch.equal(key_un, key_sh)  # every target predicted from the same token at the same position


def _update(tmp_path, share_min):
    model = dict(TINY_MODEL, max_position_embeddings=512)
    cfg = tiny_cfg(tmp_path, "engine.numerics=exact", f"grpo.share_prefix_min_tokens={share_min}",
                   "grpo.micro_batch_tokens=100000", model={"random_init": model})
    ses = open_session(cfg)
    return GRPOUpdate(cfg, ses.model, make_optimizer(ses.model, cfg), NonFiniteGuard()), ses.model


def test_split_turns_train_at_most_1_3x_the_merged_tokens_and_bitwise_the_unshared_loss(tmp_path):
    whole, split = _episode()
    adv = [torch.tensor([0.5])]
    runs = {}
    for name, sample, share_min in (("merged", whole, 16), ("shared", split, 16), ("unshared", split, 10**9)):
        up, model = _update(tmp_path / name, share_min)
        capture = ([], [], [])
        sums, n_tok = up.accumulate_gradients([], [sample], adv, [0], capture)
        runs[name] = (n_tok, sums["loss"].detach(), torch.cat(capture[0]),
                      {n: p.grad.clone() for n, p in model.named_parameters()})
    (n_m, *_), (n_s, loss_s, lp_s, g_s), (n_u, loss_u, lp_u, g_u) = runs["merged"], runs["shared"], runs["unshared"]
    assert n_s <= 1.3 * n_m < n_u  # 216 against 195 merged and 664 unshared
    assert torch.equal(lp_s, lp_u) and torch.equal(loss_s, loss_u)
    assert len(lp_s) == TURNS * (THINK + ANSWER)  # every turn trained, the reasoning included
    for name, a in g_u.items():
        assert (a - g_s[name]).abs().max() <= 2e-5 * a.abs().max(), name
    # the trainer's log-probs of a split episode come back joined, in the pieces' order
    up, _ = _update(tmp_path / "lp", 16)
    lp = up.trainer_logprobs([], [split], [0])
    assert torch.equal(lp[0], lp_s)


def test_an_agent_episode_that_splits_trains_every_segment():
    """AgentSampler's sample of a split episode: the last segment, the earlier ones as its
    split_parts, every sampled token trained once."""
    from types import SimpleNamespace

    from rlfuse.rollout.agent import AgentSession, Call
    from rlfuse.serve.agents import AgentSampler

    ses = AgentSession()
    for prompt, out in (([1, 2], [3, 4]), ([1, 2, 3, 4, 9], [5]), ([1, 2, 7], [8, 6])):  # the third edits history
        ses.record(Call([], prompt, out, [-0.5] * len(out), "stop", "", "", [], None, None))
    ses.reward = 1.0
    me = SimpleNamespace(_piece=AgentSampler._piece)
    s, segs = AgentSampler._sample(me, SimpleNamespace(ids=[1]), 0, ses)
    assert len(segs) == 2 and (s.prompt_ids, s.token_ids, s.env_reward) == ([1, 2, 7], [8, 6], 1.0)
    (a,) = s.split_parts
    assert (a.prompt_ids, a.token_ids, a.loss_mask.tolist()) == ([1, 2], [3, 4, 9, 5], [1, 1, 0, 1])
    trained = sum(float(p.loss_mask.sum()) for p in GRPOUpdate.pieces(s))
    assert trained == ses.sampled_tokens == 5
