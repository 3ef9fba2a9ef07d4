"""Scheduler: chunked prefill under the token budget, max_num_seqs, preemption of the
newest sequence by recompute, no admission in a preempting step, siblings that wait for
a shared prefix. The model is simulated: a step marks the scheduled tokens computed and
appends one token to each sequence whose chunk reached its end."""

from rlfuse.engine.cache.blocks import BlockManager
from rlfuse.engine.config import EngineConfig, SamplingParams
from rlfuse.engine.scheduler import Scheduler
from rlfuse.engine.sequence import Sequence, Status


def _setup(num_blocks=64, block_size=4, **kw):
    cfg = EngineConfig(block_size=block_size, **kw)
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(cfg, bm), bm


def _add(sched, tokens, sid):
    s = Sequence(sid, f"r{sid}", 0, list(tokens), SamplingParams(), 0, frozenset())
    sched.add(s)
    return s


def _step(sched, bm):
    """Run one simulated step; returns the batch."""
    batch = sched.schedule()
    for s, n in zip(batch.seqs, batch.num_new):
        s.num_computed += n
        bm.mark_computed(s)
        if s.num_computed == s.num_tokens:
            s.token_ids.append(1000 + s.num_tokens)
    bm.check(sched.running)
    return batch


def test_chunked_prefill_respects_the_token_budget():
    sched, bm = _setup(max_num_batched_tokens=8)
    a = _add(sched, range(20), 0)
    b = _add(sched, range(100, 103), 1)
    sizes = []
    for _ in range(3):
        batch = _step(sched, bm)
        assert batch.num_tokens <= 8
        sizes.append([(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new)])
    # a's 20 tokens go 8 + 8 + 4; b gets the remaining budget of the third step
    assert sizes == [[(0, 8)], [(0, 8)], [(0, 4), (1, 3)]]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    batch = _step(sched, bm)                     # both decode now
    assert batch.is_decode and [s.seq_id for s in batch.seqs] == [0, 1]


def test_max_num_seqs_limits_running():
    sched, bm = _setup(max_num_seqs=2)
    seqs = [_add(sched, range(i, i + 3), i) for i in range(4)]
    batch = _step(sched, bm)
    assert [s.seq_id for s in batch.seqs] == [0, 1] and len(sched.waiting) == 2
    seqs[0].status = Status.FINISHED
    sched.finish([seqs[0]])
    batch = _step(sched, bm)
    assert [s.seq_id for s in batch.seqs] == [1, 2]  # a slot freed: the next waiting one enters


def test_preempts_newest_by_recompute_and_resumes():
    # 3 sequences of 4 prompt tokens fill 3 of 4 blocks; decodes then need a block each
    sched, bm = _setup(num_blocks=4, block_size=4)
    seqs = [_add(sched, range(10 * i, 10 * i + 4), i) for i in range(3)]
    _step(sched, bm)                             # prefill all three (1 block each)
    batch = _step(sched, bm)                     # decode: a gets the last free block, b needs one: c preempted
    assert [s.seq_id for s in batch.preempted] == [2]
    assert seqs[2].status is Status.WAITING and seqs[2].block_table == [] and sched.waiting[0] is seqs[2]
    assert [s.seq_id for s in batch.seqs] == [0, 1] and seqs[1].status is Status.RUNNING
    assert bm.num_free == 0
    seqs[0].status = Status.FINISHED
    sched.finish([seqs[0]])                      # frees 2 blocks
    batch = _step(sched, bm)                     # c comes back: recompute prompt + its sampled token
    assert seqs[2] in batch.seqs
    j = batch.seqs.index(seqs[2])
    # its block went to b when it was preempted, so nothing is cached: prompt + 1 output recomputed
    assert batch.num_new[j] == 5
    assert seqs[2].num_output_tokens == 2      # its earlier output was kept, one more sampled


def test_preempting_itself_when_it_is_the_newest():
    sched, bm = _setup(num_blocks=2, block_size=4)
    a = _add(sched, range(4), 0)
    b = _add(sched, range(10, 14), 1)
    _step(sched, bm)
    batch = _step(sched, bm)                     # a needs a block: b (newest) goes, a decodes
    assert [s.seq_id for s in batch.preempted] == [1] and batch.seqs == [a]
    for _ in range(3):
        batch = _step(sched, bm)                 # a fills its second block; b cannot come back
        assert batch.seqs == [a] and not batch.preempted
    batch = _step(sched, bm)                     # a needs a third block: the newest running is a itself
    assert batch.preempted == [a] and batch.seqs == [] and a.status is Status.WAITING
    assert bm.num_free == 2 and list(sched.waiting) == [a, b]


def test_no_admission_in_a_step_that_preempted():
    sched, bm = _setup(num_blocks=3, block_size=4)
    a = _add(sched, range(4), 0)
    b = _add(sched, range(10, 14), 1)
    _step(sched, bm)
    c = _add(sched, [7], 2)                      # would fit in a block freed by the preemption
    batch = _step(sched, bm)
    assert batch.preempted == [b] and batch.seqs == [a] and c.status is Status.WAITING
    batch = _step(sched, bm)                     # b needs 2 blocks (its cached one + 1), 1 is free:
    assert batch.seqs == [a] and list(sched.waiting) == [b, c]  # first come first served, c waits


def test_siblings_wait_for_the_shared_prefix_then_reuse_it():
    sched, bm = _setup(block_size=4)
    prompt = list(range(10))                     # 2 full blocks + 2 tokens
    group = [_add(sched, prompt, i) for i in range(4)]
    batch = _step(sched, bm)
    assert batch.seqs == [group[0]] and batch.num_new == [10]
    batch = _step(sched, bm)
    assert batch.seqs[0] is group[0] and batch.num_new[0] == 1
    assert batch.seqs[1:] == group[1:] and batch.num_new[1:] == [2, 2, 2]
    assert batch.num_prompt_cached == 3 * 8
    shared = group[0].block_table[:2]
    assert all(s.block_table[:2] == shared for s in group)
    assert [bm.blocks[b].ref_count for b in shared] == [4, 4]
