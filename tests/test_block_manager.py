"""Block manager: reference counts, prefix-cache reuse by chained hash, pending blocks,
free-list integrity after finish, preemption and abort. Pure Python, no model."""

import pytest

from rlfuse.engine.cache.blocks import BlockManager, block_hash
from rlfuse.engine.config import SamplingParams
from rlfuse.engine.sequence import Sequence

B = 4  # block size


def _seq(tokens, sid=0):
    return Sequence(sid, f"r{sid}", 0, list(tokens), SamplingParams(), 0, frozenset())


def _admit(bm, seq):
    hits, pending = bm.match_prefix(seq)
    assert not pending
    assert bm.can_allocate(seq, hits)
    bm.allocate(seq, hits)
    return hits


def _compute_all(bm, seq):
    seq.num_computed = seq.num_tokens
    bm.mark_computed(seq)


def test_allocate_free_refcounts():
    bm = BlockManager(8, B)
    a = _seq(range(10))          # 3 blocks (4 + 4 + 2)
    assert _admit(bm, a) == []
    assert len(a.block_table) == 3 and bm.num_free == 5
    bm.check([a])
    bm.free_seq(a)
    assert bm.num_free == 8 and a.block_table == [] and a.num_computed == 0
    bm.check([])


def test_prefix_hit_shares_ready_blocks_and_counts_refs():
    bm = BlockManager(16, B)
    a = _seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    _admit(bm, a)
    _compute_all(bm, a)
    b = _seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43], sid=1)  # same first two blocks
    hits = _admit(bm, b)
    assert hits == a.block_table[:2]
    assert b.num_computed == 8 and b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.check([a, b])
    # a different second block breaks the chain even if a later block's tokens repeat
    c = _seq([1, 2, 3, 4, 0, 0, 0, 0, 9], sid=2)
    assert bm.match_prefix(c) == ([a.block_table[0]], False)
    bm.free_seq(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.free_seq(b)
    bm.check([])
    assert bm.num_free == 16


def test_hash_is_chained_over_the_prefix():
    h0 = block_hash(b"", [1, 2, 3, 4])
    assert block_hash(h0, [5, 6, 7, 8]) != block_hash(block_hash(b"", [0, 2, 3, 4]), [5, 6, 7, 8])
    assert block_hash(b"", [1, 2, 3, 4]) == h0


def test_full_hit_recomputes_last_block():
    bm = BlockManager(16, B)
    a = _seq(range(8))
    _admit(bm, a)
    _compute_all(bm, a)
    b = _seq(range(8), sid=1)
    hits = _admit(bm, b)
    assert hits == a.block_table[:1]            # last block recomputed: >= 1 token to compute
    assert b.num_computed == 4 and b.block_table[1] != a.block_table[1]
    bm.check([a, b])


def test_pending_blocks_make_siblings_wait():
    bm = BlockManager(16, B)
    a = _seq(range(9))
    _admit(bm, a)                                # blocks registered, K/V not computed yet
    b = _seq(range(9), sid=1)
    hits, pending = bm.match_prefix(b)
    assert pending and hits == []
    _compute_all(bm, a)
    hits, pending = bm.match_prefix(b)
    assert not pending and hits == a.block_table[:2]


def test_freed_blocks_stay_cached_until_reused_and_incomplete_ones_are_forgotten():
    bm = BlockManager(4, B)
    a = _seq(range(8))
    _admit(bm, a)
    _compute_all(bm, a)
    table = list(a.block_table)
    bm.free_seq(a)
    bm.check([])
    b = _seq(list(range(8)) + [99], sid=1)
    assert bm.match_prefix(b) == (table, False)      # both blocks still reusable from the free list
    assert bm.can_allocate(b, table)                 # 2 revived + 1 fresh of 4 free
    # a sequence preempted before its K/V was computed must not leave keys behind
    c = _seq([7] * 8, sid=2)
    _admit(bm, c)
    n_keys = len(bm.cached)
    bm.free_seq(c)                               # preempted: never computed
    assert len(bm.cached) == n_keys - 2
    bm.check([])


def test_eviction_reuses_free_blocks_and_drops_their_keys():
    bm = BlockManager(3, B)
    a = _seq(range(8))
    _admit(bm, a)
    _compute_all(bm, a)
    bm.free_seq(a)
    assert len(bm.cached) == 2
    big = _seq(range(100, 112), sid=1)           # needs all 3 blocks: evicts both cached ones
    _admit(bm, big)
    assert bm.num_free == 0
    assert all(bm.blocks[i].hash is None or bm.cached[bm.blocks[i].hash] == i for i in big.block_table)
    assert bm.match_prefix(_seq(range(9), sid=2)) == ([], False)
    bm.check([big])


def test_append_and_decode_blocks_get_registered():
    bm = BlockManager(8, B)
    a = _seq(range(3))
    _admit(bm, a)
    _compute_all(bm, a)
    for t in range(3, 9):                        # decode 6 tokens
        a.token_ids.append(t)
        bm.append_blocks(a, a.num_computed + 1)
        a.num_computed += 1
        bm.mark_computed(a)
    assert len(a.block_table) == 3 and a.num_ready_blocks == 2
    b = _seq(range(9), sid=1)
    assert bm.match_prefix(b)[0] == a.block_table[:2]
    bm.check([a])


@pytest.mark.parametrize("caching", [True, False])
def test_free_list_integrity_under_random_churn(caching):
    import random
    rng = random.Random(0)
    bm = BlockManager(24, B, enable_prefix_caching=caching)
    live, sid = [], 0
    prefixes = [list(range(8)), list(range(50, 62))]
    for _ in range(400):
        op = rng.random()
        if op < 0.45:
            toks = rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randrange(1, 9))]
            s = _seq(toks, sid)
            sid += 1
            hits, pending = bm.match_prefix(s)
            if not pending and bm.can_allocate(s, hits):
                bm.allocate(s, hits)
                live.append(s)
        elif op < 0.75 and live:                 # one compute step (prefill rest or one decode)
            s = rng.choice(live)
            if s.num_computed == s.num_tokens:
                s.token_ids.append(rng.randrange(100))
            if bm.blocks_needed(s, s.num_tokens) <= bm.num_free:
                bm.append_blocks(s, s.num_tokens)
                s.num_computed = s.num_tokens
                bm.mark_computed(s)
        elif live:                               # finish / preempt / abort: all free the blocks
            bm.free_seq(live.pop(rng.randrange(len(live))))
        bm.check(live)
    for s in live:
        bm.free_seq(s)
    bm.check([])
    assert bm.num_free == 24


def test_state_slots_admit_copy_for_a_group_preempt_and_free():
    """The second kind of cache state (engine/cache/state.py): one slot per sequence, zeroed
    on admission, a group's members copy the state the prompt left, free returns the slot."""
    import torch

    from rlfuse.engine.cache.state import StateSlots

    st = StateSlots(3, {"conv": (2, 3), "recurrent": (2, 2, 2)}, torch.float32)
    a, b, c, d = (_seq([1, 2, 3], sid=i) for i in range(4))
    for s in (a, b, c):
        assert st.can_admit(s)
        st.admit(s)
    assert st.num_free == 0 and not st.can_admit(d) and st.can_admit(a)  # admitted twice: same slot
    with pytest.raises(RuntimeError, match="no free slot"):
        st.admit(d)
    assert (st.needed(a, 1000), st.slot(a), st.slot(b), st.slot(c)) == (0, 0, 1, 2)
    for t in st.tensors.values():
        t[st.slot(a)] = torch.randn(t.shape[1:])
        t[st.slot(c)] = 7.0
    st.copy_for_group(a, [b])
    for t in st.tensors.values():
        assert torch.equal(t[1], t[0]) and bool((t[2] == 7.0).all())  # c untouched
    st.free(b)  # preempted: its slot goes back, and comes back zeroed for the next sequence
    st.free(b)  # a second free is a no-op
    assert st.num_free == 1 and st.can_admit(d)
    st.admit(d)
    assert st.slot(d) == 1 and all(not t[1].any() for t in st.tensors.values())
